"""Layer benchmark: one decoder layer's four FP8 projections, with LoRA adapters, per model.

Systems, side by side in one run on one GPU (names as in DESIGN.md section 6):

* `cutlass`: vLLM's per-token activation quant (CUDA kernel) + `cutlass_scaled_mm`, no adapter;
* `epilora-gemm`: our quantizer + our FP8 GEMM (K2 without adapter), against `cutlass`;
* `vllm-default`: the same + vLLM's Punica `lora_shrink` / `lora_expand` at their defaults;
* `epilora`: `epilora_kernels.lora_linear`, the dispatcher, with the shipped launch table (vLLM's
  quant + CUTLASS as the base GEMM of its hybrid path, as the plugin passes them, though the
  dispatcher takes the decode or fused path);
* `epilora-heuristic`: the dispatcher with every launch setting from the heuristic
  (EPILORA_LAUNCH_TABLES=0: no table);
* `epilora-fused`: our K1 (quant + shrink) + K2 (FP8 GEMM with the up-projection in its epilogue);
* `epilora-decode`: the decode path (K1, then K2 as its PDL dependent, overlapping the shrink);
* `epilora-hybrid`: vLLM's quant + CUTLASS, then our shrink and expand.
* `cutlass-codes`, `epilora-codes`: the layer as an engine whose compiler fused the per-token
  quantization into the kernel before each projection runs it (vLLM's, without LoRA and with
  the plugin's default `EPILORA_VLLM_QUANTIZE=codes`): the codes are made outside the timed
  graph, then CUTLASS on them, or `lora_linear` given the codes alone (x=None; the shrink reads
  the codes).

Models (`--models`, benchmarks/models.py): qwen3-8b (the default), llama3.1-8b, qwen2.5-7b.
Each system's whole layer (qkv, o, gate_up, down) is captured in one CUDA graph; the graphs of
a case (model, token count and setup) are replayed in turns, `--reps` rounds, so that drift
reaches every system alike; before every replay a 512 MiB buffer is written to flush the L2;
the replay is timed with CUDA events; each system's median is reported (`layer_us`).
Weights are random FP8 with per-tensor scales; adapters random bf16; the tokens round robin
over the adapters.

    python3 benchmarks/layer.py --out benchmarks/results/h200/layer.json [--quick]
    python3 benchmarks/layer.py --models qwen3-8b llama3.1-8b qwen2.5-7b \
        --systems cutlass vllm-default epilora epilora-heuristic \
        --setups 1x16 1x64 1x128 8x16 32x64 --tokens 1 4 8 16 32 64 256 512 2048 4096 \
        --out benchmarks/results/h200/layer_models.json

`--jobs N` first runs every case once, untimed, in N processes at a time (`--compile-only`),
which fill Triton's on-disk cache: on a machine whose cache is empty the run otherwise compiles
its kernels one at a time (`compile_in_parallel`, shared with decode.py).
"""

import argparse
import concurrent.futures
import datetime
import functools
import hashlib
import os
import statistics
import subprocess
import sys
from importlib import resources
from pathlib import Path

import torch
from models import MODELS, PROJECTIONS

import epilora_kernels as ek
from epilora_kernels.batch import AdapterBatch, LoraWeights
from epilora_testing.results import results_text

TOKENS = (1, 4, 8, 16, 32, 64, 128, 256)
SETUPS = ((1, 16), (1, 64), (1, 128), (32, 64))  # (adapters, rank)
SYSTEMS = ("cutlass", "epilora-gemm", "vllm-default", "epilora-fused", "epilora-decode",
           "epilora-hybrid")
ALL_SYSTEMS = (*SYSTEMS, "epilora", "epilora-heuristic", "cutlass-codes", "epilora-codes")
NO_ADAPTER = ("cutlass", "epilora-gemm", "cutlass-codes")  # rows of adapters 0


def make_layer(num_adapters: int, rank: int, gen: torch.Generator,
               projections: dict = PROJECTIONS):
    layer = {}
    for name, (k, slices) in projections.items():
        n = sum(slices)
        w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
        scale = (w.abs().amax() / 448.0).reshape(1).float()
        weight = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        a = tuple((torch.randn(num_adapters, 1, rank, k, generator=gen, device="cuda") * 0.02)
                  .to(torch.bfloat16) for _ in slices)
        b = tuple((torch.randn(num_adapters, 1, width, rank, generator=gen, device="cuda") * 0.02)
                  .to(torch.bfloat16) for width in slices)
        layer[name] = (weight, scale, LoraWeights(a, b, slices))
    return layer


def adapter_inputs(tokens: int, rank: int, adapters: int, gen: torch.Generator,
                   projections: dict = PROJECTIONS):
    """The tokens round robin over `adapters` slots: the batch, the activations per projection
    and zeroed buffers for vLLM's shrink."""
    mapping = torch.arange(tokens, device="cuda", dtype=torch.int32) % adapters
    batch = AdapterBatch.from_token_mapping(mapping, adapters)
    xs = {name: torch.randn(tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
          for name, (k, _) in projections.items()}
    bufs = {name: torch.zeros(len(s), tokens, rank, device="cuda")
            for name, (_, s) in projections.items()}
    return batch, xs, bufs


def vllm_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's per-token quant + CUTLASS (the `cutlass` system), as a base GEMM for the hybrid
    path."""
    from vllm import _custom_ops as ops

    return cutlass_on_codes(ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True),
                            weight, scale)


def cutlass_on_codes(codes: tuple[torch.Tensor, torch.Tensor], weight: torch.Tensor,
                     scale: torch.Tensor) -> torch.Tensor:
    """vLLM's CUTLASS FP8 GEMM on per-token codes and their scales (`cutlass-codes`)."""
    from vllm import _custom_ops as ops

    return ops.cutlass_scaled_mm(codes[0], weight.t(), codes[1], scale, torch.bfloat16)


def run_layer(system: str, xs: dict, layer: dict, batch: AdapterBatch, meta: tuple, bufs: dict,
              codes: dict):
    from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

    for name, (weight, scale, lora) in layer.items():
        x = xs[name]
        if system == "cutlass-codes":  # the quantization fused elsewhere: CUTLASS alone
            cutlass_on_codes(codes[name], weight, scale)
            continue
        if system == "epilora-codes":  # the plugin's codes mode: the codes alone
            ek.lora_linear(None, weight, scale, lora, batch, x_quantized=codes[name])
            continue
        if system in ("epilora", "epilora-heuristic"):
            # The dispatcher as the plugin calls it (vLLM's quant + CUTLASS for a hybrid path).
            if system == "epilora-heuristic":  # the same with no launch table
                os.environ["EPILORA_LAUNCH_TABLES"] = "0"
            try:
                ek.lora_linear(x, weight, scale, lora, batch, base_gemm=vllm_fp8_gemm)
            finally:
                os.environ.pop("EPILORA_LAUNCH_TABLES", None)
            continue
        if system == "epilora-fused":
            ek.fused_lora_fp8_linear(x, weight, scale, lora, batch)
            continue
        if system == "epilora-decode":
            ek.decode_lora_fp8_linear(x, weight, scale, lora, batch)
            continue
        if system == "epilora-gemm":  # our FP8 GEMM alone (quantizing in-kernel), no adapter
            ek.fp8_gemm_from_bf16(x, weight, scale)
            continue
        y = vllm_fp8_gemm(x, weight, scale)
        if system == "vllm-default":
            lora_shrink(x, list(lora.lora_a), bufs[name], *meta, 1.0)
            lora_expand(bufs[name], list(lora.lora_b), y, *meta, offset_start=0, add_inputs=True)
        elif system == "epilora-hybrid":
            ek.lora_expand(y, ek.lora_shrink(x, lora, batch), lora, batch)


def time_graphs(fns: dict, reps: int, flush: torch.Tensor) -> dict:
    """Median us of each of `fns` (name -> callable), each captured in a CUDA graph and the
    graphs replayed in turns, the L2 flushed before every replay: drift over the run (clocks,
    temperature) reaches every system alike instead of whichever ran last, so their ratios
    (e.g. the decode page's +5% target against CUTLASS) do not move with it."""
    graphs = {}
    for name, fn in fns.items():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, graph in graphs.items():
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000.0)
    return {name: statistics.median(t) for name, t in times.items()}


def time_graph(fn, reps: int, flush: torch.Tensor) -> float:
    """Median us of `fn` in a CUDA graph, the L2 flushed before each replay."""
    return time_graphs({"": fn}, reps, flush)[""]


COMPILE_TIMEOUT_S = 240  # one --compile-only process: a hung one must not hold the timed run


def compile_in_parallel(script: str, cases: list[list[str]], jobs: int) -> None:
    """`script --compile-only CASE` for every case's arguments, `jobs` processes at a time, so
    that the timed run finds its kernels in Triton's disk cache. A failure is printed, not
    raised: the timed run then compiles what is missing itself."""

    def compile_case(case):
        try:
            result = subprocess.run([sys.executable, script, "--compile-only", *case],
                                    capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return case, f"timed out after {COMPILE_TIMEOUT_S} s"
        return case, "compiled" if result.returncode == 0 else (
            f"failed (exit {result.returncode}): {result.stderr[-2000:]}")

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for done, (case, status) in enumerate(pool.map(compile_case, cases), 1):
            print(f"[{done}/{len(cases)}] {' '.join(case)}: {status}", flush=True)


def l2_flush_buffer() -> torch.Tensor:
    """What every timed replay writes first (512 MiB: many times the H200's L2)."""
    return torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")


def prepare_run(args: argparse.Namespace, script: str,
                cases: list[list[str]]) -> torch.Tensor | None:
    """After `parse_benchmark_args`: with --jobs, every case compiled in parallel first
    (`compile_in_parallel`); the L2 flush buffer of a timed run (None with --compile-only)."""
    if args.compile_only:
        return None
    if args.jobs > 1:
        compile_in_parallel(script, cases, args.jobs)
    return l2_flush_buffer()


def parse_benchmark_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, with --jobs and --compile-only as layer.py and decode.py take them
    (--out then optional)."""
    parser.add_argument("--jobs", type=int, default=1,
                        help="first run every case once, untimed, in this many processes")
    parser.add_argument("--compile-only", action="store_true",
                        help="run every system of the cases once, untimed, and write nothing")
    args = parser.parse_args()
    if not args.compile_only and not args.out:
        parser.error("--out is required unless --compile-only")
    return args


def run_untimed(runs: dict) -> None:
    """Each of a case's systems once (--compile-only: what compiles, compiles)."""
    for run in runs.values():
        run()
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the result file (required unless --compile-only)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="tokens 1, 16, 64, 256 only")
    parser.add_argument("--tokens", type=int, nargs="+", help="these token counts only")
    parser.add_argument("--setups", nargs="+", default=[f"{a}x{r}" for a, r in SETUPS],
                        help="ADAPTERSxRANK, e.g. 32x64 (the no-adapter systems run in each "
                             "setup's cases too)")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["qwen3-8b"])
    parser.add_argument("--systems", nargs="+", choices=ALL_SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--git-sha", default=None)
    args = parse_benchmark_args(parser)
    setups = [tuple(int(v) for v in s.split("x")) for s in args.setups]
    tokens_list = args.tokens or ((1, 16, 64, 256) if args.quick else TOKENS)
    flush = prepare_run(args, __file__, [
        ["--models", model, "--setups", setup, "--tokens", str(tokens), "--systems",
         *args.systems] for model in args.models for setup in args.setups
        for tokens in tokens_list])
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model in args.models:
        projections = MODELS[model]
        for num_adapters, rank in setups:
            layer = make_layer(num_adapters, rank, gen, projections)
            for tokens in tokens_list:
                batch, xs, bufs = adapter_inputs(tokens, rank, num_adapters, gen, projections)
                meta = batch.vllm_meta_args()
                codes = {name: ek.quantize(x) for name, x in xs.items()}  # vLLM's, bit for bit
                # The no-adapter GEMMs too in every case, though they do not depend on the
                # adapters: each case's systems replay in turns, so each cell's ratio to its
                # baseline sees the same drift (clocks, temperature), not an earlier case's.
                runs = {system: functools.partial(run_layer, system, xs, layer, batch, meta,
                                                  bufs, codes)
                        for system in args.systems}
                if args.compile_only:
                    run_untimed(runs)
                    continue
                for system, us in time_graphs(runs, args.reps, flush).items():
                    no_adapter = system in NO_ADAPTER
                    rows.append({"bench": "layer", "model": model, "base": "fp8",
                                 "system": system, "tokens": tokens, "rank": rank,
                                 "setup": f"{num_adapters}x{rank}",  # whose case it ran in
                                 "adapters": 0 if no_adapter else num_adapters,
                                 "metric": "layer_us", "value": round(us, 2), "n": args.reps})
                    print(f"{model:12s} {system:17s} adapters={num_adapters:2d} "
                          f"rank={rank:3d} tokens={tokens:4d} {us:8.1f} us", flush=True)
                write_results(args, rows)  # after every case: a run cut short keeps its rows
            del layer
            torch.cuda.empty_cache()


def _command() -> str:
    """This run's command line, without its output path and commit (machine-specific)."""
    words, skip = [], False
    for word in sys.argv[1:]:
        if skip:
            skip = False
        elif word in ("--out", "--out-table", "--git-sha"):
            skip = True
            words += [word, "..."] if word != "--git-sha" else []
        else:
            words.append(word)
    script = Path(sys.argv[0]).resolve()  # benchmarks/ or dev/ (decode_timeline.py)
    return " ".join(["python3", f"{script.parent.name}/{script.name}", *words])


def write_results(args, rows) -> None:
    import triton
    import vllm

    sha = args.git_sha or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    from epilora_kernels.arch import device_support
    from epilora_kernels.launch import table_device, table_name

    # the shipped table the launchers read: the device's own, else its architecture's
    shipped = table_device(torch.cuda.get_device_name(), device_support().arch)
    table = shipped and resources.files("epilora_kernels").joinpath("configs",
                                                                    table_name(shipped))
    from epilora_kernels.tuner import cache_path

    cache = cache_path(torch.cuda.get_device_name())
    meta = {"git_sha": sha or "unknown",
            "launch_table": hashlib.sha256(table.read_bytes()).hexdigest()[:16]
            if table else None,
            "launch_cache": hashlib.sha256(cache.read_bytes()).hexdigest()[:16]
            if cache.is_file() else None,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "vllm": vllm.__version__,
            "command": _command()}
    with open(args.out, "w") as f:
        f.write(results_text(meta, rows))


if __name__ == "__main__":
    main()
