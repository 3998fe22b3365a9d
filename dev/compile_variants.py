"""How many Triton kernels the plugin's forward compiles while vLLM captures its CUDA graphs, and
how long they take to compile for sm_90 on this CPU (no GPU needed; TRITON_INTERPRET unset).

vLLM 0.26 captures a graph per size of `[1, 2, 4] + 8..248 step 8 + 256..max step 16`, max =
min(2 x max_num_seqs, 512) (`VllmConfig._set_cudagraph_sizes`), each after an eager warm-up run,
and with LoRA once more without adapters (`cudagraph_specialize_lora`): the serving benchmark's
logs show 22 captures at max_num_seqs 32 and 102 at 256. Each warm-up run of a new size can meet
kernels not compiled yet. Here, for each projection of a model's layer and each capture size,
`epilora_kernels.lora_linear` on the codes (the plugin's default mode; tokens round robin over
`--max-loras` slots, as vLLM's dummy adapters) records its launches (the recorder of
`tests/aot_launchers_sm90.py`, the shipped H200 table); two launches need one compile when
Triton's JIT would give them one key: the same constexprs and options, and for each argument
the specialization Triton makes (a pointer's or integer's 16-divisibility, an integer equal to
1), except for arguments the kernel marks `do_not_specialize`. `--compile` compiles one launch
of each key for sm_90 and reports the seconds, serially (run it on an idle machine).

Why it exists: with one adapter the plugin's engine captured graphs in 46 s against stock's
16-22 (benchmarks/results/h200/serving.json), and nothing in vLLM's log said where the time
went.

    python dev/compile_variants.py --models llama3.1-8b --max-num-seqs 32 --max-loras 1 --compile

`--check-eager MAX_TOKENS` checks the plugin's precompile sizes instead: the capture sizes and
`epilora_vllm.precompile.eager_sizes` above them meet every key that any size up to MAX_TOKENS
meets (exit status 1 and the keys missed otherwise). Qwen3-8B at 256 sequences, 32 slots, and
Llama-3.1-8B at 1 slot, to 8192 tokens: none missed.
"""

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = Path(__file__).parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "packages/epilora-kernels/tests")]

from models import MODELS  # noqa: E402

import epilora_kernels as ek  # noqa: E402

from aot_launchers_sm90 import OPTIONS, compile_launch_full, record_launches  # noqa: E402


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM 0.26's default CUDA-graph sizes (no speculative decoding)."""
    largest = min(2 * max_num_seqs, 512)
    return [s for s in [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)] if s <= largest]


def compile_key(kernel, args, kwargs) -> tuple:
    """What Triton's JIT keys a launch's compile on (see the module's docstring)."""
    values = dict(zip(kernel.arg_names, args, strict=False))
    values.update(kwargs)
    key = [kernel.fn.__name__]
    for param in kernel.params:
        value = values.get(param.name)
        if param.is_constexpr:
            key.append((param.name, str(value)))
        elif isinstance(value, TensorDescriptor):
            key.append((param.name, tuple(value.block_shape), str(value.base.dtype)))
        elif isinstance(value, torch.Tensor):
            key.append((param.name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not param.do_not_specialize:
            key.append((param.name, value == 1, value % 16 == 0))
    key.append(tuple((option, kwargs.get(option)) for option in OPTIONS))
    return tuple(key)


def launches(model: str, max_num_seqs: int, max_loras: int, rank: int,
             sizes: list[int] | None = None) -> dict:
    """{compile key: (first launch with it, the (projection, size) pairs that meet it)} over
    `sizes` (default: the capture sizes)."""
    found: dict = {}
    for name, (k, slices) in MODELS[model].items():
        weight = torch.zeros(sum(slices), k, dtype=torch.float8_e4m3fn)
        lora = ek.LoraWeights(
            tuple(torch.zeros(max_loras, 1, rank, k, dtype=torch.bfloat16) for _ in slices),
            tuple(torch.zeros(max_loras, 1, s, rank, dtype=torch.bfloat16) for s in slices),
            slices)
        for tokens in sizes or capture_sizes(max_num_seqs):
            batch = ek.AdapterBatch.from_token_mapping(
                torch.arange(tokens, dtype=torch.int32) % max_loras, max_loras)
            codes = (torch.zeros(tokens, k, dtype=torch.float8_e4m3fn), torch.ones(tokens, 1))
            call = functools.partial(ek.lora_linear, None, weight, torch.ones(1), lora, batch,
                                     x_quantized=codes)
            for launch in record_launches(call):
                entry = found.setdefault(compile_key(*launch), (launch, []))
                entry[1].append((name, tokens))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["llama3.1-8b"])
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="time each key's sm_90 compile")
    parser.add_argument("--check-eager", type=int, metavar="MAX_TOKENS",
                        help="check that the plugin's precompile sizes (the capture sizes and "
                        "epilora_vllm.precompile.eager_sizes up to MAX_TOKENS) meet every key "
                        "that some size up to MAX_TOKENS meets (minutes per model)")
    args = parser.parse_args()
    if args.check_eager:
        check_eager(args)
        return
    if args.compile:  # an empty cache: compiles, not cache reads, are timed
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-variants-")
    sizes = capture_sizes(args.max_num_seqs)
    for model in args.models:
        found = launches(model, args.max_num_seqs, args.max_loras, args.rank)
        kernels = sorted({key[0] for key in found})
        counts = ", ".join(f"{sum(key[0] == k for key in found)} {k}" for k in kernels)
        print(f"{model}: {len(sizes)} capture sizes (max_num_seqs {args.max_num_seqs}), "
              f"{args.max_loras} slots, rank {args.rank}: {len(found)} compiles ({counts})")
        if args.compile:
            begin = time.perf_counter()
            for launch, _ in found.values():
                compile_launch_full(*launch)
            print(f"  compiled for sm_90 in {time.perf_counter() - begin:.1f} s on this CPU")


def check_eager(args) -> None:
    from epilora_vllm.precompile import eager_sizes

    graphs = capture_sizes(args.max_num_seqs)
    chosen = [*graphs, *eager_sizes(graphs[-1], args.check_eager)]
    rest = sorted(set(range(1, args.check_eager + 1)) - set(chosen))
    failed = False
    for model in args.models:
        met = launches(model, args.max_num_seqs, args.max_loras, args.rank, chosen)
        missed = {key: where for key, (_, where) in launches(
            model, args.max_num_seqs, args.max_loras, args.rank, rest).items() if key not in met}
        print(f"{model}: {len(chosen)} precompile sizes meet {len(met)} keys; sizes to "
              f"{args.check_eager} outside them meet {len(missed)} more")
        for key, where in missed.items():
            failed = True
            print(f"  missed {key[0]} at {where[:4]}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
