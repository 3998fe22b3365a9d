"""The Python host time of one eager fused-path call, without a GPU: `lora_linear` on CPU
tensors with the kernels replaced by stand-ins whose compiled kernel launches nothing, so the
call takes the GPU's launch path (`_fast_launch`) and everything before it (checks, plan,
allocations, argument templates) runs as on a GPU host. A model's projection shapes
(benchmarks/models.py; Qwen3-8B's qkv by default), 32 rank-64 slots, 520 tokens round robin,
the caller's codes (vLLM's quantization, the plugin's default): the per-call time (min and
median of 7 runs) and the Python function calls per call (cProfile), which dev/op_overhead.py's
profile on the GPU host counts the same way.

    python dev/host_emulation.py --projection qkv --profile tottime
"""

import argparse
import cProfile
import inspect
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors pass the device checks; no kernel runs

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from models import MODELS  # noqa: E402

import epilora_kernels as ek  # noqa: E402
from epilora_kernels import _fast_launch, _launchers  # noqa: E402


class _Compiled:
    packed_metadata = None
    function = 0

    def run(self, *args) -> None:
        pass


class _Kernel:
    """A kernel's signature (what the templates read) and a Triton launch that compiles a
    `_Compiled` and runs nothing."""

    def __init__(self, kernel) -> None:
        self.fn, self.__name__ = kernel.fn, kernel.fn.__name__
        self.params = [SimpleNamespace(name=p.name, default=p.default)  # (before f227d5d)
                       for p in inspect.signature(kernel.fn).parameters.values()]

    def __getitem__(self, grid):
        return lambda **arguments: _Compiled()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="qwen3-8b")
    parser.add_argument("--projection", default="qkv")
    parser.add_argument("--tokens", type=int, default=520)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--profile", choices=("tottime", "cumulative"), help="print cProfile's")
    parser.add_argument("--new-counts", action="store_true",
                        help="each call a token count not seen before (--tokens and up), as "
                             "online serving's eager steps (prompts plus running decodes)")
    parser.add_argument("--bound", action="store_true",
                        help="call a LoraProjection (the weight and adapters bound once), as "
                             "the plugin does, rather than lora_linear")
    args = parser.parse_args()
    _launchers._quantize_shrink_kernel = _Kernel(_launchers._quantize_shrink_kernel)
    _launchers._lora_gemm_kernel = _Kernel(_launchers._lora_gemm_kernel)
    _fast_launch.driver = SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 0))
    # The GPU's branch of the launch (the interpreter's goes by name through Triton); before
    # the templates (f227d5d) every launch went by name through `_fast_launch.launch`.
    if hasattr(_launchers, "_start_template"):  # (its support argument since this commit)
        _launchers._start_template = lambda *args: args[-3].launch(*args[-2:])
    else:
        _launchers._start = lambda kernel, grid, **arguments: _fast_launch.launch(
            kernel, grid, arguments)
    k, slices = MODELS[args.model][args.projection]
    t, loras, rank = args.tokens, 32, 64
    weight = torch.zeros(sum(slices), k, dtype=torch.float8_e4m3fn)
    lora = ek.LoraWeights(
        tuple(torch.zeros(loras, 1, rank, k, dtype=torch.bfloat16) for _ in slices),
        tuple(torch.zeros(loras, 1, s, rank, dtype=torch.bfloat16) for s in slices), slices)
    most = t + (8 * args.calls + 1100 if args.new_counts else 0)
    full = ek.AdapterBatch.from_token_mapping(torch.arange(most, dtype=torch.int32) % loras,
                                              loras)
    full_codes = (torch.zeros(most, k, dtype=torch.float8_e4m3fn), torch.ones(most, 1))
    scale = torch.ones(1)
    counts = iter(range(t, most))
    projection = ek.LoraProjection(weight, scale, lora) if args.bound else None

    def call():
        n = next(counts) if args.new_counts else t
        batch = ek.AdapterBatch(full.token_lora_mapping[:n], full.sorted_token_indices[:n],
                                full.lora_ids, full.num_tokens_per_lora, full.lora_token_start)
        codes = (full_codes[0][:n], full_codes[1][:n])
        if projection is not None:
            projection(None, batch, x_quantized=codes, path="fused")
        else:
            ek.lora_linear(None, weight, scale, lora, batch, x_quantized=codes, path="fused")

    for _ in range(50):
        call()
    runs = []
    for _ in range(7):
        begin = time.perf_counter()
        for _ in range(args.calls):
            call()
        runs.append((time.perf_counter() - begin) / args.calls * 1e6)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(1000):
        call()
    profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"{args.model} {args.projection}, {t} tokens: {min(runs):.1f} us a call (min of 7), "
          f"{statistics.median(runs):.1f} (median); {stats.total_calls / 1000:.0f} Python "
          "calls a call")
    if args.profile:
        stats.sort_stats(args.profile).print_stats(30)


if __name__ == "__main__":
    main()
