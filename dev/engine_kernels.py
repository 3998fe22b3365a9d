"""GPU: which kernels one batch-1 decode step of a whole vLLM engine runs, and for how long, per
system (benchmarks/serving.py's systems and variants of the plugin's environment), so a gap in
the serving benchmark's TPOT can be traced to kernels.

Each system's engine runs in its own process, in-process engine core (so the torch profiler sees
the GPU), dummy weights of the model's shapes cut to `--layers` layers, vLLM's default
torch.compile and CUDA graphs. It profiles a generation of 1 token (the prefill) and one of
`--steps` + 1 tokens; per kernel name, the difference divided by `--steps` is that kernel's
count and time per decode step. It also keeps the kernel sequence of the last decode step and
the step's wall time (TPOT), whose difference from the kernels' sum is the GPU's idle time
between them (launch gaps, host work).

    python3 dev/engine_kernels.py --out out/engine_kernels.json
"""

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import serving  # noqa: E402 (the serving benchmark's models, adapters and systems)

# name -> (serving.py's system, extra environment)
SYSTEMS = {
    "no-lora": ("no-lora", {}),
    "epilora": ("epilora", {}),
    "epilora-vllm-quant": ("epilora", {"EPILORA_VLLM_QUANTIZE": "vllm"}),
    "epilora-kernels-quant": ("epilora", {"EPILORA_VLLM_QUANTIZE": "kernels"}),
    # each projection's GEMM pulls the next's weight into L2 (epilora_kernels.L2Prefetch)
    "epilora-prefetch-8": ("epilora", {"EPILORA_VLLM_PREFETCH_MIB": "8"}),
    "epilora-prefetch-24": ("epilora", {"EPILORA_VLLM_PREFETCH_MIB": "24"}),
    "epilora-prefetch-start-24": ("epilora", {"EPILORA_VLLM_PREFETCH_MIB": "24",
                                              "EPILORA_VLLM_PREFETCH_AT": "start"}),
    # the decode path's K1 as the programmatic dependent of the kernel before it
    "epilora-after-previous": ("epilora", {"EPILORA_DECODE_AFTER_PREVIOUS": "1"}),
    # the decode path on vLLM's codes in one launch, the shrink's programs first in K2's grid
    "epilora-one-launch": ("epilora", {"EPILORA_DECODE_ONE_LAUNCH": "1"}),
    # the engine-start tuner with and without K2's decode tiles swapped (wgmma, the weight by
    # TMA; tried by default)
    "epilora-swap-ab": ("epilora", {"EPILORA_TUNE_SWAP_AB": "1"}),
    "epilora-unswapped": ("epilora", {"EPILORA_TUNE_SWAP_AB": "0"}),
    "vllm-dual-stream": ("vllm-dual-stream", {}),
}


def kernels_of(trace_path: Path) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every GPU kernel in a chrome trace, by start."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    out = [(e["ts"], e["dur"], e["name"]) for e in events
           if e.get("cat") == "kernel" and "dur" in e]
    return sorted(out)


def worker(args) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    lora = args.system != "no-lora"
    llm = LLM(args.model_dir, load_format="dummy", quantization="fp8", skip_tokenizer_init=True,
              enable_lora=lora, max_loras=1, max_lora_rank=serving.RANK, max_model_len=4096,
              max_num_seqs=32, gpu_memory_utilization=0.85, seed=0)
    prompt = [TokensPrompt(prompt_token_ids=list(range(1000, 1064)))]

    def generate(tokens: int, request) -> float:
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0,
                                ignore_eos=True, detokenize=False)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        llm.generate(prompt, params, lora_request=request, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - begin

    requests = {args.name: None}
    if lora:  # a request with the adapter, then one without in the same engine
        requests = {args.name: LoRARequest("tenant", 1, args.adapter),
                    f"{args.name}/base-request": None}
    for name, request in requests.items():
        print("RESULT " + json.dumps(profile_request(args, name, request, generate)), flush=True)


def profile_request(args, name: str, request, generate) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    generate(args.steps + 1, request)  # warm-up
    tpot = statistics.median([(generate(args.steps + 1, request) - generate(1, request))
                              / args.steps * 1e6 for _ in range(3)])
    traces = {}
    for tokens in (1, args.steps + 1):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(tokens, request)
        path = Path(args.work) / f"{name.replace('/', '-')}-{tokens}.json"
        prof.export_chrome_trace(str(path))
        traces[tokens] = kernels_of(path)
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for sign, tokens in ((-1, 1), (1, args.steps + 1)):
        for _, dur, kernel in traces[tokens]:
            per_name[kernel][0] += sign
            per_name[kernel][1] += sign * dur
    kernels = sorted(({"name": n, "per_step": c / args.steps, "us_per_step": t / args.steps}
                      for n, (c, t) in per_name.items() if c), key=lambda k: -k["us_per_step"])
    # The last decode step: the kernels after the last gap at least half the longest (the
    # host's turn between steps), i.e. from the start of the last step's graph replay.
    seq = traces[args.steps + 1]
    gaps = [seq[i + 1][0] - (seq[i][0] + seq[i][1]) for i in range(len(seq) - 1)]
    cut = max((i + 1 for i, g in enumerate(gaps) if g >= max(gaps) / 2), default=0)
    return {
        "name": name, "tpot_us": tpot, "kernels": kernels,
        "kernel_us_per_step": sum(k["us_per_step"] for k in kernels),
        "launches_per_step": sum(k["per_step"] for k in kernels),
        "last_step": [{"start_us": round(t - seq[cut][0], 2), "us": d, "name": n}
                      for t, d, n in seq[cut:]],
        "gpu": torch.cuda.get_device_name()}


def layer_period_us(step: list[dict]) -> float:
    """A layer's time in the decode step's kernel sequence: the median start-to-start time of
    consecutive attention kernels (the 4-layer engine's TPOT is mostly host time and the
    lm_head, so the layers' own time is read here; NaN without two attentions)."""
    starts = [k["start_us"] for k in step
              if "FlashAttn" in k["name"] and "Combine" not in k["name"]]
    gaps = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return statistics.median(gaps) if gaps else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b", choices=list(serving.CONFIGS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--systems", nargs="+", default=["no-lora", "epilora"],
                        choices=list(SYSTEMS))
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds per engine (4 layers of an 8B model took over 120 s)")
    parser.add_argument("--share-cache", action="store_true",
                        help="one kernels' cache for every system: the first tunes and the rest"
                             " run its tiles (for variants that change launches, not tiles)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    work = Path(tempfile.mkdtemp(prefix="engine-kernels-"))
    serving.CONFIGS[args.model] = {**serving.CONFIGS[args.model],
                                   "num_hidden_layers": args.layers}
    model_dir, (adapter,) = serving.prepare_model(args.model, work, 1)
    out, results = Path(args.out), []
    for name in args.systems:
        system, extra = SYSTEMS[name]
        cmd = [sys.executable, __file__, "--worker", "--name", name, "--system", system,
               "--model-dir", str(model_dir), "--adapter", str(adapter), "--work", str(work),
               "--steps", str(args.steps), "--out", str(out)]
        # by default each system's own kernels' cache: the start-time tuner tunes for each (a
        # shared one hands the first system's choices to the next, swapped tiles or not)
        cache = work / ("cache" if args.share_cache else f"cache-{name}")
        env = {**serving.system_env(system), **extra, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "EPILORA_CACHE_DIR": str(cache)}
        print(f"{name} ...", flush=True)
        log, ok = serving.run_worker(cmd, env=env, timeout=args.timeout)
        out.with_name(f"engine_kernels-{name}.log").write_text(log)
        found = serving.results_of(log)
        if not found:  # (on a cold machine an engine with the plugin took over 160 s)
            why = "exited without one" if ok else f"failed, or ran past --timeout {args.timeout} s"
            print(f"{name}: no result ({why}; its log: engine_kernels-{name}.log)", flush=True)
        results += found
        out.write_text(json.dumps({"model": args.model, "layers": args.layers,
                                   "git_sha": os.environ.get("EPILORA_GIT_SHA"),
                                   "results": results}, indent=1))
    for r in results:
        print(f"\n{r['name']}: TPOT {r['tpot_us']:.1f} us, kernels {r['kernel_us_per_step']:.1f}"
              f" us in {r['launches_per_step']:.0f} launches per step, a layer"
              f" {layer_period_us(r['last_step']):.1f} us")
        for k in r["kernels"][:25]:
            print(f"  {k['per_step']:6.1f} x {k['us_per_step']:8.1f} us  {k['name'][:90]}")
    print(summary(results))


def summary(results: list[dict]) -> str:
    """A line per engine, in run order: its layer's time with the adapter, and without one in
    the same engine (its `/base-request`, the result after it) and the difference, which
    compares engines across runs and cards better than the layer's time alone."""
    rows = [f"\n{'system, in run order':<32} {'a layer, us':>11} {'its base request':>18}"
            f" {'over it':>9}"]
    for i, r in enumerate(results):
        if r["name"].endswith("/base-request"):
            continue
        layer = layer_period_us(r["last_step"])
        after = results[i + 1] if i + 1 < len(results) else None
        if after is not None and after["name"] == f"{r['name']}/base-request":
            own = layer_period_us(after["last_step"])
            rows.append(f"{r['name']:<32} {layer:11.1f} {own:18.1f} {layer - own:9.1f}")
        else:
            rows.append(f"{r['name']:<32} {layer:11.1f}")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
