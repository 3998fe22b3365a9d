"""The serving benchmark: stock vLLM and vLLM with the epilora plugin, in one run, each engine
in its own process (dummy weights of a real model's shapes, `quantization="fp8"`, vLLM's
default torch.compile and CUDA graphs).

Scenarios (`--scenarios`):
* `tpot1`: batch 1, one rank-64 adapter: time per output token, the median of `--reps`
  generations of `--output-tokens` tokens (a 1-token generation's time taken off: TPOT
  excludes prefill), plus each engine's start time and KV-cache tokens (its log line).

Systems: `epilora` (the plugin), `vllm-default` (stock LoRA; the plugin off), `vllm-dual-stream`
(stock LoRA on a second stream, VLLM_LORA_ENABLE_DUAL_STREAM=1), `no-lora` (stock, LoRA off).
Every engine also generates greedily for four prompts with the adapter; the table says where
the systems' tokens agree.

    python3 benchmarks/serving.py --models qwen3-8b --out results/h200/serving.json
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from epilora_testing.results import results_text

# config.json of each model (dummy weights: vLLM needs the architecture and shapes only).
CONFIGS = {
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                 "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000, "tie_word_embeddings": False, "hidden_act": "silu",
                 "attention_bias": False, "torch_dtype": "bfloat16"},
    "llama3.1-8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "vocab_size": 128256, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-5, "rope_theta": 500000, "tie_word_embeddings": False,
                    "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16"},
}
SYSTEMS = ("epilora", "vllm-default", "vllm-dual-stream", "no-lora")
RANK = 64
CHECK_PROMPTS = [[100 + 7 * i + j for j in range(16)] for i in range(4)]


def system_env(system: str) -> dict:
    env = {"EPILORA_VLLM_DISABLE": "0" if system == "epilora" else "1",
           "VLLM_LORA_ENABLE_DUAL_STREAM": "1" if system == "vllm-dual-stream" else "0"}
    return {**os.environ, **env}


def prepare_model(model: str, root: Path) -> tuple[Path, Path]:
    """The dummy model's config and a random rank-64 adapter of its shapes (PEFT format)."""
    from epilora_testing.tiny_models import write_lora_adapter

    model_dir = root / model
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(CONFIGS[model]))
    adapter = root / f"{model}-r{RANK}"
    if not (adapter / "adapter_config.json").exists():
        write_lora_adapter(adapter, model_dir, rank=RANK, seed=1, std=0.02)
    return model_dir, adapter


def worker(args) -> None:
    """One engine: start it, time batch-1 decoding, generate the check prompts; print a JSON
    line of results."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version_string
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    lora = args.system != "no-lora"
    llm = LLM(args.model_dir, load_format="dummy", quantization="fp8", skip_tokenizer_init=True,
              enable_lora=lora, max_loras=1, max_lora_rank=RANK, max_model_len=4096,
              max_num_seqs=32, gpu_memory_utilization=0.85, seed=0)
    start_s = time.perf_counter() - t0
    request = LoRARequest("tenant", 1, args.adapter) if lora else None
    prompt = [TokensPrompt(prompt_token_ids=list(range(1000, 1000 + args.prompt_tokens)))]

    def run(tokens: int, lora_request) -> float:
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0,
                                ignore_eos=True, detokenize=False)
        begin = time.perf_counter()
        llm.generate(prompt, params, lora_request=lora_request, use_tqdm=False)
        return time.perf_counter() - begin

    def tpots(lora_request) -> list[float]:
        run(args.output_tokens, lora_request)  # warm-up: adapter loaded, graphs touched
        out = []
        for _ in range(args.reps):
            full, first = run(args.output_tokens, lora_request), run(1, lora_request)
            out.append((full - first) / (args.output_tokens - 1) * 1e3)
        return out

    with_adapter = tpots(request)
    # A request without an adapter in a LoRA engine: what LoRA costs every tenant.
    base_request = tpots(None) if lora else None
    params = SamplingParams(max_tokens=32, temperature=0.0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in CHECK_PROMPTS], params,
                        lora_request=request, use_tqdm=False)
    import torch

    print("RESULT " + json.dumps({"start_s": start_s, "tpot_ms": with_adapter,
                                  "tpot_ms_base_request": base_request,
                                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "vllm": vllm_version_string,
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}),
          flush=True)


def run_worker(cmd: list[str], *, timeout: int, env: dict | None = None) -> tuple[str, bool]:
    """One engine's worker process: its stdout and stderr, and whether it exited 0 in time
    (a timed-out worker's output so far)."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.stdout + proc.stderr, proc.returncode == 0
    except subprocess.TimeoutExpired as e:
        return (e.stdout or b"").decode() + (e.stderr or b"").decode(), False


def results_of(log: str) -> list[dict]:
    """Every `RESULT {json}` line a worker printed, in order."""
    return [json.loads(line[7:]) for line in log.splitlines() if line.startswith("RESULT ")]


def kv_cache_tokens(log: str) -> int | None:
    match = re.search(r"GPU KV cache size: ([\d,]+) tokens", log)
    return int(match.group(1).replace(",", "")) if match else None


LOG_NAME = re.compile(r"serving-(?P<model>[\w.-]+?)-(?P<system>epilora|vllm-default|"
                      r"vllm-dual-stream|no-lora)\.log$")


def rows_from_log(model: str, system: str, log: str) -> tuple[list, list | None]:
    """The rows of one engine's run, from its log (its RESULT line and vLLM's KV-cache line),
    and its greedy tokens; no rows if the engine did not finish."""
    results = results_of(log)
    if not results:
        return [], None
    result = results[0]
    base = {"bench": "serving", "model": model, "base": "fp8", "system": system,
            "adapters": 0 if system == "no-lora" else 1,
            "rank": None if system == "no-lora" else RANK, "tp": 1}
    rows = [{**base, "metric": "tpot_ms", "batch": 1,
             "value": statistics.median(result["tpot_ms"]), "n": len(result["tpot_ms"]),
             "samples": result["tpot_ms"]},
            {**base, "metric": "start_s", "value": result["start_s"], "n": 1}]
    if result.get("tpot_ms_base_request"):
        rows.append({**base, "metric": "tpot_ms_base_request", "batch": 1,
                     "value": statistics.median(result["tpot_ms_base_request"]),
                     "n": len(result["tpot_ms_base_request"]),
                     "samples": result["tpot_ms_base_request"]})
    for key in ("gpu", "torch", "vllm"):
        for row in rows:
            row["_" + key] = result.get(key)
    kv = kv_cache_tokens(log)
    if kv is not None:
        rows.append({**base, "metric": "kv_cache_tokens", "value": kv, "n": 1})
    return rows, result["tokens"]


def agreement_rows(tokens: dict) -> list:
    """How many check prompts' greedy tokens the plugin shares with each stock LoRA system."""
    rows = []
    for (model, system), theirs in tokens.items():
        ours = tokens.get((model, "epilora"))
        if system in ("epilora", "no-lora") or ours is None:
            continue
        rows.append({"bench": "serving", "model": model, "system": "epilora",
                     "against": system, "metric": "same_greedy_outputs",
                     "value": sum(a == b for a, b in zip(ours, theirs, strict=True)),
                     "n": len(ours)})
    return rows


def collect(log_dirs: list[Path]) -> list:
    """Every engine log under `log_dirs` as rows (a later directory's log of the same model
    and system replaces an earlier one's), then the agreement rows."""
    logs = {}
    for directory in log_dirs:
        for path in sorted(Path(directory).glob("serving-*.log")):
            match = LOG_NAME.search(path.name)
            if match:
                logs[(match["model"], match["system"])] = (path, path.read_text())
    rows, tokens = [], {}
    for (model, system), (path, log) in logs.items():
        engine_rows, engine_tokens = rows_from_log(model, system, log)
        # Which run: the log's folder (benchmarks/results/<gpu>/serving-logs/<commit>/).
        rows += [{**row, "log": f"{path.parent.name}/{path.name}"} for row in engine_rows]
        if engine_tokens is not None:
            tokens[(model, system)] = engine_tokens
    return rows + agreement_rows(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-8b"], choices=list(CONFIGS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--scenarios", nargs="+", default=["tpot1"], choices=["tpot1"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=257)
    parser.add_argument("--timeout", type=int, default=400, help="seconds per engine")
    parser.add_argument("--work", default="/tmp/epilora-serving", help="models and adapters")
    parser.add_argument("--logs", default=None, help="where each engine's log goes")
    parser.add_argument("--collect", nargs="+", default=None, metavar="LOG_DIR",
                        help="run no engine: the result file from these directories' engine "
                             "logs (several device calls' runs in one file)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--git-sha", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.collect:
        rows = collect([Path(d) for d in args.collect])
        print(table(rows))
        if args.out:
            write(args, rows)
        return None

    work, logs = Path(args.work), Path(args.logs or args.work)
    logs.mkdir(parents=True, exist_ok=True)
    failures = []
    for model in args.models:
        model_dir, adapter = prepare_model(model, work)
        for system in args.systems:
            log_path = logs / f"serving-{model}-{system}.log"
            cmd = [sys.executable, __file__, "--worker", "--system", system, "--model-dir",
                   str(model_dir), "--adapter", str(adapter), "--reps", str(args.reps),
                   "--prompt-tokens", str(args.prompt_tokens),
                   "--output-tokens", str(args.output_tokens)]
            print(f"{model} {system} ...", flush=True)
            log, ok = run_worker(cmd, env=system_env(system), timeout=args.timeout)
            log_path.write_text(log)
            if not ok or not rows_from_log(model, system, log)[0]:
                failures.append(f"{model} {system}: failed, see {log_path}")
                print(failures[-1], flush=True)
            rows = collect([logs])  # after every engine: a later timeout loses none
            if args.out:
                write(args, rows)
    print(table(rows))
    if failures:
        sys.exit("\n".join(failures))


def table(rows: list) -> str:
    lines = [f"{'model':12} {'system':18} {'metric':20} value"]
    for r in rows:
        what = r["metric"] + (f" vs {r['against']}" if "against" in r else "")
        lines.append(f"{r['model']:12} {r['system']:18} {what:20} {r['value']:.4g}")
    return "\n".join(lines)


def _command() -> str:
    """This run's command line without machine-specific paths (their values) and the commit."""
    words, dropping = [], False
    for word in sys.argv[1:]:
        if word.startswith("--"):
            dropping = word in ("--out", "--logs", "--git-sha", "--work", "--collect")
            words.append(word + (" ..." if word == "--collect" else "")) if (
                not dropping or word == "--collect") else None
        elif not dropping:
            words.append(word)
    return " ".join(["python3", "benchmarks/serving.py", *words])


def write(args, rows) -> None:
    """The result file; its GPU and versions are the engines' own (each worker reports them),
    so the file can be made from logs on a machine without a GPU (`--collect`)."""
    env = {}
    for key in ("gpu", "torch", "vllm"):
        values = {row.pop("_" + key) for row in rows if "_" + key in row}
        env[key] = values.pop() if len(values) == 1 else sorted(map(str, values)) or None
    sha = args.git_sha or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    meta = {"git_sha": sha or "unknown",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **env, "command": _command()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(results_text(meta, rows))


if __name__ == "__main__":
    main()
