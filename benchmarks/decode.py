"""Decode benchmark: one Qwen3-8B layer at 1-32 tokens, the decode path (PDL) against the rest.

Systems (one CUDA graph per system and case, the case's graphs replayed in turns, L2 flushed
before each replay, median of replays):
`cutlass` (vLLM quant + CUTLASS, no adapter), `vllm-default` (+ Punica shrink/expand),
`vllm-dual-stream` (vLLM's VLLM_LORA_ENABLE_DUAL_STREAM: the adapter on a second stream into a
zeroed buffer, joined and added), `epilora-serialized` (our K1, quantize + shrink, then K2, no
PDL), `epilora-decode` (the same with K2 as K1's programmatic dependent: it waits for K1's
quantized rows before its K loop, for h before its epilogue). Overlap
controls (the paper's table 11), our quantizer then K2 with PDL and h already computed, after:
`control-empty` (an empty kernel), `control-cublas-shrink` (a cuBLAS x A^T), and with nothing
between: `epilora-h-given` (the lower bound). Components for the exposure model:
`component-shrink` (our shrinks alone, without quantizing), `component-gemm` (our quantizer +
K2 without adapters);
`model-decode` is derived from them, t(h given) + max(0, t_shrink - t_gemm), for comparison
with `epilora-decode`.

    python3 benchmarks/decode.py --out benchmarks/results/h200/decode.json

On a machine whose Triton cache is empty, compiling the page's kernels one at a time took longer
than timing them (a cold page ran past 230 s, a warm one 30-40 s, on the H200 in the device
calls of 2026-11-30): `--jobs N` first runs every (rank, tokens) case once in N processes at a
time (`--compile-only`, untimed), which fill Triton's disk cache (layer.compile_in_parallel).
"""

import argparse
import functools

import torch
import triton
import triton.language as tl
from layer import (
    PROJECTIONS,
    adapter_inputs,
    make_layer,
    parse_benchmark_args,
    prepare_run,
    run_layer,
    run_untimed,
    time_graphs,
    write_results,
)

import epilora_kernels as ek

TOKENS = (1, 4, 8, 16, 32)
RANKS = (16, 64, 128)
SYSTEMS = ("cutlass", "vllm-default", "vllm-dual-stream", "epilora-serialized", "epilora-decode",
           "control-empty", "control-cublas-shrink", "epilora-h-given", "component-shrink",
           "component-gemm")


def _row(system: str, tokens: int, rank: int, us: float, reps: int, derived: bool = False):
    row = {"bench": "decode", "model": "qwen3-8b", "base": "fp8", "system": system,
           "tokens": tokens, "rank": rank, "adapters": 0 if system == "cutlass" else 1,
           "metric": "layer_us", "value": round(us, 2), "n": reps}
    if derived:
        row["derived_from"] = "epilora-h-given + max(0, component-shrink - component-gemm)"
    return row


@triton.jit
def _empty_kernel():
    # A primary grid that does nothing but let its programmatic dependent launch.
    tl.extra.cuda.gdc_launch_dependents()


def run_decode(system: str, xs, layer, batch, hs) -> None:
    for name, (weight, scale, lora) in layer.items():
        x = xs[name]
        if system in ("epilora-h-given", "control-empty", "control-cublas-shrink"):
            codes, scales = ek.quantize(x)
            if system == "control-empty":
                _empty_kernel[(1,)]()
            elif system == "control-cublas-shrink":
                torch.matmul(x, lora.lora_a[0][0, 0].T)  # cuBLAS, triggers no dependents
            ek.lora_fp8_gemm(codes, scales, weight, scale, hs[name], lora, batch,
                                pdl=system != "epilora-h-given")
        elif system == "component-shrink":
            ek.lora_shrink(x, lora, batch)
        elif system == "component-gemm":
            ek.fp8_gemm_from_bf16(x, weight, scale)
        else:
            ek.decode_lora_fp8_linear(x, weight, scale, lora, batch,
                                         pdl=system == "epilora-decode")


def run_dual_stream(xs, layer, batch, meta, bufs, outs, aux: torch.cuda.Stream) -> None:
    """vLLM's dual-stream LoRA: base GEMM on the current stream, the adapter on `aux`."""
    from vllm import _custom_ops as ops
    from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

    main = torch.cuda.current_stream()
    for name, (weight, scale, lora) in layer.items():
        x = xs[name]
        aux.wait_stream(main)
        codes, x_scale = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)
        y = ops.cutlass_scaled_mm(codes, weight.t(), x_scale, scale, torch.bfloat16)
        with torch.cuda.stream(aux):
            outs[name].zero_()
            lora_shrink(x, list(lora.lora_a), bufs[name], *meta, 1.0)
            lora_expand(bufs[name], list(lora.lora_b), outs[name], *meta, offset_start=0,
                        add_inputs=True)
        main.wait_stream(aux)
        y.add_(outs[name])


def adapter_case(tokens: int, rank: int, layer: dict, gen: torch.Generator, adapters: int = 1,
                 projections: dict = PROJECTIONS):
    """`layer.adapter_inputs` (here: all tokens on slot 0) and the activations' h (our shrink):
    the batch, activations, h and zeroed buffers for vLLM's shrink."""
    batch, xs, bufs = adapter_inputs(tokens, rank, adapters, gen, projections)
    hs = {name: ek.lora_shrink(xs[name], lora, batch) for name, (_, _, lora) in layer.items()}
    return batch, xs, hs, bufs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the result file (required unless --compile-only)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--git-sha", default=None)
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = parse_benchmark_args(parser)
    flush = prepare_run(args, __file__, [["--ranks", str(rank), "--tokens", str(tokens)]
                                         for rank in args.ranks for tokens in args.tokens])
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for rank in args.ranks:
        layer = make_layer(1, rank, gen)
        for tokens in args.tokens:
            batch, xs, hs, bufs = adapter_case(tokens, rank, layer, gen)
            meta = batch.vllm_meta_args()
            codes = {name: ek.quantize(x) for name, x in xs.items()}  # run_layer's argument
            outs = {name: torch.zeros(tokens, sum(sl), dtype=torch.bfloat16, device="cuda")
                    for name, (_, sl) in PROJECTIONS.items()}
            aux = torch.cuda.Stream()
            runs = {}
            for system in SYSTEMS:
                if system in ("cutlass", "vllm-default"):
                    runs[system] = functools.partial(run_layer, system, xs, layer, batch, meta,
                                                     bufs, codes)
                elif system == "vllm-dual-stream":
                    runs[system] = functools.partial(run_dual_stream, xs, layer, batch, meta,
                                                     bufs, outs, aux)
                else:
                    runs[system] = functools.partial(run_decode, system, xs, layer, batch, hs)
            if args.compile_only:
                run_untimed(runs)
                continue
            measured = time_graphs(runs, args.reps, flush)  # in turns: drift hits all alike
            for system, us in measured.items():
                rows.append(_row(system, tokens, rank, us, args.reps))
                print(f"{system:22s} rank={rank:3d} tokens={tokens:3d} {us:8.1f} us", flush=True)
            model = measured["epilora-h-given"] + max(
                0.0, measured["component-shrink"] - measured["component-gemm"])
            rows.append(_row("model-decode", tokens, rank, model, args.reps, derived=True))
            write_results(args, rows)  # after every case: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
