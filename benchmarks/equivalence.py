"""Greedy outputs of vLLM with the plugin against stock vLLM's LoRA path on real weights:
SmolLM2-135M-Instruct on an FP8 base, the serving demo's four tenants' adapters (PEFT-trained,
rank 8, every projection), 16 questions in one batch (question i for tenant i mod 4), 64
greedy tokens each.

Systems, each engine in its own process: `epilora` (the plugin, vLLM's default torch.compile
and CUDA graphs), `epilora-eager` (the plugin, `enforce_eager`), and stock vLLM's LoRA path
(the plugin off) in its own configurations: `vllm-default`, `vllm-dual-stream`
(VLLM_LORA_ENABLE_DUAL_STREAM=1) and `vllm-eager`; `vllm-default-again` is `vllm-default` run
again, the floor of run-to-run differences (vLLM's split-K shrink adds with atomics). Bases:
`fp8-online` (the bf16 checkpoint with `quantization="fp8"`) and `fp8-checkpoint`
(llm-compressor's FP8-dynamic format, written by `epilora-fp8-checkpoint`). Rows: for every
base and pair of systems, on how many of the 16 requests their tokens are identical, and the
first differing position of each other request.

Run `tools/serve_demo.py` first (it makes the checkpoints and adapters under `--root`):

    python3 benchmarks/equivalence.py --root ~/.cache/epilora/serve-demo \
        --out results/h200/equivalence.json

`--collect RUN_DIR ...` runs no engine: the result file from the engines' logs, each folder one
run (its engines' logs, e.g. of several device calls while the machine kept the demo's files),
named by the folder. Systems are paired within a run only: the demo trains its adapters afresh
on the GPU in every run, and stock's answers of two runs were not all the same
(results/h200/equivalence-logs/96d2a0d and 4b45e7b).
"""

import argparse
import itertools
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serving import (  # noqa: I001 (the serving benchmark's)
    environment,
    kill_workers_on_term,
    results_of,
    run_meta,
    run_worker,
    system_env,
)

from epilora_testing.results import results_text

SYSTEMS = ("epilora", "epilora-eager", "vllm-default", "vllm-default-again", "vllm-dual-stream",
           "vllm-eager")
BASES = ("fp8-online", "fp8-checkpoint")
TENANTS = ("pirate", "french", "robot", "cowboy")  # tools/serve_demo.py's, in its order
QUESTIONS = [
    "What is the capital of Italy?", "What is the largest planet?",
    "How many days are in a week?", "What do bees make?", "What is the boiling point of water?",
    "Who painted the Mona Lisa?", "What is the tallest animal?", "How many continents are there?",
    "What gas do plants breathe in?", "What is the opposite of hot?",
    "What language is spoken in Brazil?", "How many hours are in a day?",
    "What is frozen water called?", "Which planet is closest to the sun?",
    "What is the color of grass?", "How many wheels does a bicycle have?"]
TOKENS = 64
# Stock's LoRA path against which the plugin is judged (the issue: at least 14 of 16 equal).
REFERENCE = "vllm-default"


def worker(args) -> None:
    """One engine: the 16 requests in one batch; print their tokens as a JSON line."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    root = Path(args.root)
    tokenizer = AutoTokenizer.from_pretrained(root / "bf16")
    model = {"fp8-online": {"model": str(root / "bf16"), "quantization": "fp8"},
             "fp8-checkpoint": {"model": str(root / "fp8")}}[args.base]
    # A fixed KV cache (no memory profiling): the engines of a run share the GPU.
    llm = LLM(**model, enable_lora=True, max_loras=len(TENANTS), max_lora_rank=8,
              max_model_len=1024, max_num_seqs=16, dtype="bfloat16", seed=0,
              kv_cache_memory_bytes=2 << 30, enforce_eager=args.system.endswith("-eager"))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in QUESTIONS]
    lora = [LoRARequest(t, i + 1, str(root / t)) for i, t in enumerate(TENANTS)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0),
                        lora_request=[lora[i % len(lora)] for i in range(len(prompts))],
                        use_tqdm=False)
    print("RESULT " + json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs], **environment()}), flush=True)


def first_difference(a: list, b: list) -> int | None:
    """The first position where two token lists differ (a length counts), None if equal."""
    if a == b:
        return None
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def pair_rows(base: str, tokens: dict) -> list:
    """For every pair of systems that finished: how many requests' tokens are identical, and
    where each other request's first differ."""
    rows = []
    for a, b in itertools.combinations([s for s in SYSTEMS if s in tokens], 2):
        where = [first_difference(x, y) for x, y in zip(tokens[a], tokens[b], strict=True)]
        rows.append({"bench": "equivalence", "model": "smollm2-135m", "base": base,
                     "system": a, "against": b, "metric": "same_greedy_outputs",
                     "value": sum(w is None for w in where), "n": len(where),
                     "first_difference": where, "tokens": TOKENS, "adapters": len(TENANTS)})
    return rows


LOG_NAME = re.compile(rf"equivalence-(?P<base>{'|'.join(BASES)})-"
                      rf"(?P<system>{'|'.join(SYSTEMS)})\.log$")


def print_pairs(rows: list) -> None:
    for r in rows:
        if r["metric"] == "same_greedy_outputs":
            print(f"{r.get('run', ''):8} {r['base']:15} {r['system']:16} vs {r['against']:18} "
                  f"{r['value']:2} of {r['n']}")


def log_name(base: str, system: str) -> str:
    return f"equivalence-{base}-{system}.log"


def collect(run_dir: Path) -> dict:
    """{(base, system): the engine's result} from every engine log in one run's folder that
    has one (an engine cut off by its time limit has none)."""
    results = {}
    for path in sorted(Path(run_dir).glob("equivalence-*.log")):
        match = LOG_NAME.search(path.name)
        found = results_of(path.read_text()) if match else []
        if found:
            results[(match["base"], match["system"])] = found[0]
    return results


def collect_runs(run_dirs: list[Path]) -> tuple[list, dict]:
    """`result_rows` of each run's folder, every row marked with its run (the folder's name);
    the environment of the last run that has one."""
    names = [Path(d).name for d in run_dirs]
    if len(set(names)) < len(names):
        raise ValueError(f"two runs of one name in {names}: a run is named by its folder")
    rows, env = [], {}
    for run_dir in run_dirs:
        results = collect(run_dir)
        if not results:
            raise ValueError(f"{run_dir}: no engine log with a result (a run's folder?)")
        run_rows, run_env = result_rows(results)
        rows += [{**row, "run": Path(run_dir).name} for row in run_rows]
        env = run_env or env
    return rows, env


def result_rows(results: dict) -> tuple[list, dict]:
    """The pair rows of every base, then each system's texts; and the engines' environment."""
    rows, env = [], {}
    for base in BASES:
        finished = {s: r for (b, s), r in results.items() if b == base and r}
        rows += pair_rows(base, {s: r["tokens"] for s, r in finished.items()})
        for s in (s for s in SYSTEMS if s in finished):
            env = {k: finished[s][k] for k in ("gpu", "torch", "vllm")}
            rows.append({"bench": "equivalence", "model": "smollm2-135m", "base": base,
                         "system": s, "metric": "texts", "value": len(finished[s]["texts"]),
                         "texts": finished[s]["texts"]})
    return rows, env


def write(path: str, git_sha: str | None, command: str, rows: list, env: dict) -> None:
    meta = {**run_meta(git_sha), **env, "command": command, "questions": QUESTIONS,
            "tenants": list(TENANTS), "reference": REFERENCE}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(results_text(meta, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="tools/serve_demo.py's work folder (to run engines)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--bases", nargs="+", default=list(BASES), choices=BASES)
    parser.add_argument("--jobs", type=int, default=5, help="engines at once on the GPU")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per engine")
    parser.add_argument("--logs", default="/tmp/epilora-equivalence")
    parser.add_argument("--collect", nargs="+", default=None, metavar="RUN_DIR",
                        help="run no engine: the result file from these runs' engine logs")
    parser.add_argument("--out", default=None)
    parser.add_argument("--git-sha", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    kill_workers_on_term()
    if args.collect:
        rows, env = collect_runs([Path(d) for d in args.collect])
        print_pairs(rows)
        if args.out:
            write(args.out, args.git_sha, "python3 benchmarks/equivalence.py --collect "
                  "(the engines' logs of the runs " + ", ".join(
                      Path(d).name for d in args.collect) + ")", rows, env)
        return None
    if not args.root:
        parser.error("--root is required to run engines (or --collect RUN_DIR ...)")
    for tenant in TENANTS:
        if not (Path(args.root) / tenant / "adapter_config.json").exists():
            sys.exit(f"{args.root}/{tenant}: no adapter (run tools/serve_demo.py first)")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    cases = list(itertools.product(args.bases, args.systems))

    def run(case):
        base, system = case
        cmd = [sys.executable, __file__, "--worker", "--root", args.root, "--system", system,
               "--base", base]
        log, ok = run_worker(cmd, env=system_env(system), timeout=args.timeout)
        (logs / log_name(base, system)).write_text(log)
        results = results_of(log)
        print(f"{base} {system}: {'done' if ok and results else 'FAILED'}", flush=True)
        return case, (results[0] if ok and results else None)

    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(run, cases))
    rows, env = result_rows(results)
    print_pairs(rows)
    if args.out:
        write(args.out, args.git_sha, " ".join(["python3 benchmarks/equivalence.py", "--systems",
                                                *args.systems, "--bases", *args.bases]),
              rows, env)
    failed = [f"{b} {s}" for (b, s), r in results.items() if r is None]
    if failed:
        sys.exit("failed: " + ", ".join(failed) + f" (logs in {logs})")
    return None


if __name__ == "__main__":
    main()
