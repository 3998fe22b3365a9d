"""Where an engine's prefill step goes: the online benchmark's engine (Qwen3-8B shapes, dummy FP8
weights, 32 rank-64 tenants, max_num_seqs 256, 8192 batched tokens) in this process, every
adapter loaded, then prompts of 512 tokens (a CUDA-graph size) and 520 (eager) for 1, 2 and 4
tenants at once, one output token: the median wall time of each, and a torch.profiler trace of
one eager step (its CUDA kernels by time, and the CPU time of the plugin's op).

Why it exists: at d796919 the plugin's online p99 TTFT was 2-11x stock's while its throughput
was higher; with every Triton compile gone from serving (9361f2a) the median TTFT was still
~2-3x stock's.

    python dev/prefill_probe.py --system epilora --out /tmp/probe.json

With `--sample FILE`, eager 520-token steps run again for `--sample-seconds` while a thread
samples the main thread's Python stack every ~0.5 ms, written to FILE as collapsed stacks (a
line per stack and its count, py-spy's raw format): where the host time of the step goes, line
by line (`dev/collapse_stacks.py FILE` sums them). A sample is taken when the main thread lets
go of the GIL (the switch interval is lowered to 0.2 ms meanwhile), so a long call in C that
holds it counts at the next Python line.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving import RANK, TENANT_FILES, TENANTS, prepare_model, system_env  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", choices=("epilora", "vllm-default"), default="epilora")
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 520],
                        help="prompt lengths, measured in this order (at f787555 the steps "
                             "of 2 and 4 prompts of 512, measured first, took ~50 ms more "
                             "than those of 520: the order or the token counts)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sample", type=Path, help="collapsed stacks of eager steps, here")
    parser.add_argument("--sample-seconds", type=float, default=8.0)
    parser.add_argument("--op-timing", type=int, default=0, metavar="STEPS",
                        help="also run this many eager steps of 521 tokens and up timing the "
                             "plugin's op and the kernels' call inside it: wall time against "
                             "the calling thread's CPU time (a gap: the thread waits, e.g. for "
                             "the GIL), and the process's threads")
    args = parser.parse_args()
    os.environ.update(system_env(args.system))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine here: the profiler sees it
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    model_dir, adapters = prepare_model(args.model, Path("/tmp/epilora-serving"), TENANT_FILES)
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", quantization="fp8", skip_tokenizer_init=True,
              enable_lora=True, max_loras=TENANTS, max_lora_rank=RANK, max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
              enable_prefix_caching=False, seed=0)
    start_s = time.perf_counter() - t0
    tenants = [LoRARequest(f"tenant-{t}", t + 1, str(adapters[t % len(adapters)]))
               for t in range(TENANTS)]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def run(length: int, n: int, first: int) -> float:
        prompts = [TokensPrompt(prompt_token_ids=[(first * 7919 + i * 31 + j) % 150000 + 10
                                                  for j in range(length)]) for i in range(n)]
        begin = time.perf_counter()
        llm.generate(prompts, params, lora_request=[tenants[(first + i) % TENANTS]
                                                    for i in range(n)], use_tqdm=False)
        return (time.perf_counter() - begin) * 1e3

    run(16, TENANTS, 0)  # every adapter into its slot
    times, rep = {}, 1
    for length in args.lengths:
        for n in (1, 2, 4):
            samples = []
            for _ in range(args.reps):
                samples.append(run(length, n, rep))
                rep += 1
            times[f"{length}x{n}"] = round(statistics.median(samples), 2)
            print(f"{args.system} prompt {length} x {n}: {times[f'{length}x{n}']} ms "
                  f"(median of {args.reps})", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = run(520, 1, rep)
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_time_total > 0 and e.cpu_time_total == 0
                      or e.key.startswith(("void", "_", "triton", "sm90", "cutlass"))),
                     key=lambda e: -e.device_time_total)
    device_total = sum(e.self_device_time_total for e in events) / 1e3
    ops = {e.key: {"count": e.count, "cpu_total_ms": round(e.cpu_time_total / 1e3, 2)}
           for e in events if "epilora" in e.key or "lora" in e.key.lower()}
    top = [{"kernel": e.key[:90], "count": e.count,
            "ms": round(e.device_time_total / 1e3, 3)} for e in kernels[:15]]
    cpu_top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
    result = {"system": args.system, "start_s": round(start_s, 1), "median_ms": times,
              "profiled_520x1": {"wall_ms": round(wall, 2), "device_ms": round(device_total, 2),
                                 "lora_ops": ops, "top_kernels": top,
                                 "top_cpu_self": [{"op": e.key[:90], "count": e.count,
                                                   "self_cpu_ms":
                                                       round(e.self_cpu_time_total / 1e3, 2)}
                                                  for e in cpu_top]}}
    if args.op_timing:
        # A new token count each step, as online serving's eager steps (prompts and decodes)
        result["op_timing"] = time_ops(lambda i: run(521 + i, 1, rep), args.op_timing)
    if args.sample:
        result["sampled_steps"] = sample_stacks(lambda: run(520, 1, rep), args.sample,
                                                args.sample_seconds)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)
    print(f"{args.system}: wall {wall:.1f} ms, device {device_total:.1f} ms", flush=True)


def time_ops(step, steps: int) -> dict:
    """Run `step(i)` for i < `steps` with the plugin's op (`EpiloraForward.__call__`) and the
    kernels' call inside it (`LoraProjection.__call__`, which forward.py calls) timed:
    per call, wall and thread CPU microseconds (medians), and the steps' wall time."""
    import threading

    import epilora_kernels
    from epilora_vllm import forward

    timed = {"op": ([], []), "kernels": ([], [])}

    def timing(name, fn):
        walls, cpus = timed[name]

        def wrapper(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                cpus.append((time.thread_time() - cpu) * 1e6)
                walls.append((time.perf_counter() - wall) * 1e6)
        return wrapper

    projection = epilora_kernels.LoraProjection
    op, kernels = forward.EpiloraForward.__call__, projection.__call__
    forward.EpiloraForward.__call__ = timing("op", op)
    projection.__call__ = timing("kernels", kernels)
    step_ms = []
    try:
        for i in range(steps):
            begin = time.perf_counter()
            step(i)
            step_ms.append((time.perf_counter() - begin) * 1e3)
    finally:
        forward.EpiloraForward.__call__, projection.__call__ = op, kernels
    result = {"steps": steps, "step_ms_median": round(statistics.median(step_ms), 2),
              "threads": sorted(t.name for t in threading.enumerate())}
    for name, (walls, cpus) in timed.items():
        result[name] = {"calls_per_step": len(walls) / steps,
                        "wall_us_median": round(statistics.median(walls), 1) if walls else None,
                        "cpu_us_median": round(statistics.median(cpus), 1) if cpus else None,
                        "wall_ms_per_step": round(sum(walls) / steps / 1e3, 2)}
    print(f"op timing: {json.dumps(result)}", flush=True)
    return result


def sample_stacks(step, out: Path, seconds: float) -> int:
    """Run `step` over and over for `seconds` while a thread samples the main thread's stack;
    the collapsed stacks go to `out`. Returns the steps run."""
    import collections
    import gc
    import threading

    main = threading.main_thread().ident
    counts: collections.Counter = collections.Counter()
    done = threading.Event()

    def sampler() -> None:
        while not done.is_set():
            frame, stack = sys._current_frames().get(main), []
            while frame is not None:
                code = frame.f_code
                stack.append(f"{code.co_name} ({code.co_filename}:{frame.f_lineno})")
                frame = frame.f_back
            counts[";".join(reversed(stack))] += 1
            time.sleep(0.0005)

    collected = {"runs": 0, "s": 0.0, "begin": 0.0}

    def gc_timer(phase: str, info: dict) -> None:  # the garbage collector's share of the steps
        if phase == "start":
            collected["begin"] = time.perf_counter()
        else:
            collected["runs"] += 1
            collected["s"] += time.perf_counter() - collected["begin"]

    gc.callbacks.append(gc_timer)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    steps, end = 0, time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            step()
            steps += 1
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
        gc.callbacks.remove(gc_timer)
    print(f"garbage collections during the steps: {collected['runs']}, "
          f"{collected['s'] * 1e3:.1f} ms of {seconds * 1e3:.0f} ms", flush=True)
    out.write_text("".join(f"{stack} {n}\n" for stack, n in counts.items()))
    print(f"sampled {sum(counts.values())} stacks over {steps} steps -> {out}", flush=True)
    return steps


if __name__ == "__main__":
    main()
