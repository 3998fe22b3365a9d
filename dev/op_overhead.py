"""The host time of one eager `epilora_kernels.lora_linear` call on the fused path (a prefill
batch above vLLM's CUDA-graph sizes), and of the same call through a `LoraProjection` (`-bound`,
as the plugin calls), and where the latter's goes (cProfile), on a GPU: a model's qkv, o,
gate_up and down shapes (benchmarks/models.py; Qwen3-8B's by default), 32 rank-64 slots, 520
tokens round robin, vLLM's codes.

Why it exists: dev/prefill_probe.py found the plugin's op at 0.7 ms of host time per call in an
eager 520-token step (144 calls, 101 ms of a 159 ms step whose kernels take 28 ms), where stock
vLLM's LoRA ops take ~0.09 ms each.

    python dev/op_overhead.py --tokens 520 --out /tmp/overhead.json
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from models import MODELS  # noqa: E402

import epilora_kernels as ek  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="qwen3-8b")
    parser.add_argument("--tokens", type=int, default=520)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device, loras, rank, t = torch.device("cuda"), 32, 64, args.tokens
    result = {"tokens": t, "per_call_us": {}}
    calls = {}
    for name, (k, slices) in MODELS[args.model].items():
        weight = torch.zeros(sum(slices), k, dtype=torch.float8_e4m3fn, device=device)
        lora = ek.LoraWeights(
            tuple(torch.zeros(loras, 1, rank, k, dtype=torch.bfloat16, device=device)
                  for _ in slices),
            tuple(torch.zeros(loras, 1, s, rank, dtype=torch.bfloat16, device=device)
                  for s in slices), slices)
        batch = ek.AdapterBatch.from_token_mapping(
            torch.arange(t, dtype=torch.int32, device=device) % loras, loras)
        codes = (torch.zeros(t, k, dtype=torch.float8_e4m3fn, device=device),
                 torch.ones(t, 1, device=device))
        scale = torch.ones(1, device=device)
        calls[name] = (lambda weight=weight, lora=lora, batch=batch, codes=codes, scale=scale:
                       ek.lora_linear(None, weight, scale, lora, batch, x_quantized=codes))
        # The same call through a LoraProjection (the weight and adapters bound once), as the
        # plugin makes it.
        projection = ek.LoraProjection(weight, scale, lora)
        calls[f"{name}-bound"] = (lambda bound=projection, batch=batch, codes=codes:
                                  bound(None, batch, x_quantized=codes))
        calls[name]()  # compiled
        calls[f"{name}-bound"]()
    torch.cuda.synchronize()
    result["gpu_us"] = {}
    for name, call in calls.items():
        # Runs of 10 calls after a sync: too few to fill the launch queue, so a run's host time
        # is the calls' own even where the GPU takes longer (60-call runs at f05f79b could not
        # tell the two apart); the GPU's time of the same calls, from events, beside it.
        host, cpu, gpu = [], [], []
        for _ in range(args.calls // 10):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            begin, begin_cpu = time.perf_counter(), time.thread_time()
            for _ in range(10):
                call()
            host.append((time.perf_counter() - begin) / 10 * 1e6)
            cpu.append((time.thread_time() - begin_cpu) / 10 * 1e6)
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end) / 10 * 1e3)
        result["per_call_us"][name] = round(statistics.median(host), 1)
        result["gpu_us"][name] = round(statistics.median(gpu), 1)
        result.setdefault("thread_cpu_us", {})[name] = round(statistics.median(cpu), 1)
        print(f"{name}: {result['per_call_us'][name]} us of host time per call "
              f"({result['thread_cpu_us'][name]} us of the thread's CPU), the GPU "
              f"{result['gpu_us'][name]} us", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(100):
        calls["qkv-bound"]()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
    result["profile_qkv_bound_100_calls"] = text.getvalue()
    print(text.getvalue(), flush=True)
    result["torch_ops_qkv_bound_20_calls"] = torch_ops(calls["qkv-bound"], 20)
    args.out.write_text(json.dumps(result, indent=1))


def torch_ops(call, n: int) -> list[dict]:
    """The CPU time of the torch and CUDA runtime calls under `n` calls (torch.profiler), by self
    time: what of the host time is not Python (cProfile counts a C call's time, not what it is)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
    rows = [{"op": e.key[:80], "calls_per_call": e.count / n,
             "self_cpu_us_per_call": round(e.self_cpu_time_total / n, 1)} for e in top]
    for row in rows:
        print(f"{row['op']:80s} {row['calls_per_call']:6.1f} {row['self_cpu_us_per_call']:8.1f} us",
              flush=True)
    return rows


if __name__ == "__main__":
    main()
