"""Where the decode path's time goes: K1's and K2's programs timed by their own clocks, and the
decode layer with K2 warming L2 or K1 in narrower rank tiles, against CUTLASS in the same run.

Timeline: one layer of each of `--models`' shapes (default Qwen3-8B; 4 projections, one adapter)
in a CUDA graph, the L2 flushed before each replay; the kernels are built with `TRACE`, so every
program stores its SM and the global clock (`%globaltimer`, ns) at its start and end, and K2's
also after its spin on K1's count of quantized rows, after its K loop and after `gdc_wait`. Per
projection and replay, in us from the first K1 program's start (from K2's first start for
`h-given`, which has no traced K1); medians over replays:

  k1_quant_end  the last quantizing program of K1 done (the codes K2 waits for)
  k1_end        the last K1 program done (h complete)
  k2_start      the first K2 program started
  k2_spin       the median program's wait for the codes (`fused-pdl`: for all of K1)
  k2_loop_end   the last K2 program past its K loop
  k2_wait_end   the last K2 program past gdc_wait
  k2_end        the last K2 program done
  k2_wait_max   the longest gdc_wait of any K2 program
  k2_loop_median the median K2 program's K loop (from its start, or its spin's end)
  k2_epi_median  the median K2 program's time from its K loop's end to its end (the wait, the
                 epilogue with the adapter's h B^T, and the store of y)
  k2_late       K2 programs that started after K1's end (no room for them beside K1)
  k2_shared     K2 programs on an SM that also ran a K1 program; k2_shared_loop_end and
                k2_alone_loop_end: the last of those, and of the others, past its K loop
  layer_start   this projection's origin, from the layer's first traced program
  gap_before    from the previous projection's last K2 program to this one's origin (launch
                latency, and for `h-given` our untraced quantizer)

Variants: `decode` (the decode path as shipped), `decode-warm<B>` (K2 prefetches the first B
bytes of each of its weight rows into L2 before its spin; 0: none), `decode-k1r32` (K1 in
32-wide rank tiles), `serialized` (no PDL), `fused` (the fused path: K1 then K2 with their own
settings, serialized), `fused-pdl` (the same with K2 as K1's programmatic dependent, waiting for
all of K1 before its K loop: the fused path as shipped beyond 32 tokens), `h-given` (our
quantizer, then K2 with h given), `gemm` (our quantizer, then K2 without adapter in `h-given`'s
tiles: against `h-given`, what the adapter's epilogue costs; its codes by TMA where the tiles
allow, `fused.fp8_gemm`'s choice), `decode-codes` and `gemm-codes` (the same on per-token codes
made outside the graph, as the plugin's default mode receives them from vLLM's fused
quantization; against `cutlass-codes`), `decode-codes-swapped` and `gemm-codes-swapped` (those
with K2's decode tiles swapped: `LaunchConfig.swap_ab`, the tile `launch.swap_candidate`
picks), `one-launch` and `one-launch-swapped` (`decode-codes` and its swapped form in one
launch, EPILORA_DECODE_ONE_LAUNCH=1: K2's first programs, the shrink's, stand for K1 in the
columns); `--variants` picks them, `--traced` those also traced;
`--ranks`, `--tokens`, `--adapters` (tokens round robin over them) pick the cases, e.g. the
layer page's misses: `--adapters 32 --ranks 64 --tokens 128 256 --variants fused h-given
--traced fused h-given`, or the batch-1 gap of the plugin's default mode: `--ranks 64 --tokens 1
4 --variants decode-codes gemm-codes --traced decode-codes gemm-codes`. The layer timings
(untraced, median of `--reps`) add `cutlass` (vLLM quant + CUTLASS) and `cutlass-codes` (CUTLASS
alone on the codes) for the ratios.

    python3 dev/decode_timeline.py --out benchmarks/results/h200/decode_timeline.json
"""

import argparse
import dataclasses
import functools
import itertools
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from decode import adapter_case  # noqa: E402 (the benchmarks' helpers)
from layer import l2_flush_buffer, make_layer, run_layer, time_graph, write_results  # noqa: E402
from models import MODELS  # noqa: E402

# The kernels' internals: the traced launches are a diagnostic, not the public API.
from epilora_kernels import _launchers, _tiling, fused, launch  # noqa: E402
from epilora_kernels.arch import device_support  # noqa: E402
from epilora_kernels.workspace import default_workspace  # noqa: E402

RANKS = (16, 64, 128)
TOKENS = (1, 4, 16)
TRACED_TOKENS = (1, 16)  # of the default TOKENS; given --tokens, all are traced
UNTRACED_K1 = ("h-given", "gemm", "gemm-codes", "gemm-codes-swapped")  # no K1 (or our
# quantizer, untraced) before K2
CODES_VARIANTS = ("decode-codes", "gemm-codes", "decode-codes-swapped",
                  "gemm-codes-swapped", "one-launch", "one-launch-swapped")  # on codes made
# outside the graph: vs cutlass-codes
ONE_LAUNCH = ("one-launch", "one-launch-swapped")  # EPILORA_DECODE_ONE_LAUNCH=1: K2's trace
# holds the shrink's programs (stamps 0 and 1) and the GEMM's (stamps 0, 2, 3, 4)


def _swapped(cfg, batch, lora):
    # the `-swapped` variants' K2: the swapped tile of `cfg` that dev/launch_variants.py's
    # `swap-ab` takes (`launch.swap_candidate`)
    return launch.swap_candidate(cfg, lora.out_features, lora.in_features, lora.output_slices,
                                batch.num_tokens)


def _k1_config(variant: str, tokens: int, lora):
    if variant != "decode-k1r32":
        return None
    cfg = _tiling.shape_config(device_support(), "decode_shrink", tokens, lora.out_features,
                               lora.in_features, lora.max_rank, lora.output_slices)
    return dataclasses.replace(cfg, block_r=32)


def _warm(variant: str) -> int:
    if variant.startswith("decode-warm"):
        return int(variant.removeprefix("decode-warm"))
    return fused.DECODE_WARM_L2


def run_variant(variant, xs, layer, batch, hs, codes, traces=None):
    for name, (weight, scale, lora) in layer.items():
        pair = traces[name] if traces else (None, None)
        x = xs[name]
        support = device_support(x.device)
        in_use = _tiling.gemm_config(support, batch, lora, None)
        swapped = variant.endswith("-swapped")
        if variant.startswith("decode-codes"):  # the plugin's default mode: the codes alone
            fused._linear(0, None, weight, scale, lora, batch, None,
                          _swapped(in_use, batch, lora) if swapped else None, decode=True,
                          pdl=True, traces=pair, x_quantized=codes[name])
        elif variant in ONE_LAUNCH:
            with mock.patch.dict(os.environ, {"EPILORA_DECODE_ONE_LAUNCH": "1"}):
                fused._linear(0, None, weight, scale, lora, batch, None,
                              _swapped(in_use, batch, lora) if swapped else None, decode=True,
                              pdl=True, traces=pair, x_quantized=codes[name])
        elif variant.startswith("gemm-codes"):  # K2 without adapter on the same codes
            _launchers.launch_gemm_only(support, default_workspace(x.device), *codes[name],
                                        weight, scale,
                                        _swapped(in_use, batch, lora) if swapped else in_use,
                                        trace=pair[1])
        elif variant in ("fused", "fused-pdl"):  # K1 then K2, the fused path's settings
            fused._linear(0, x, weight, scale, lora, batch, None, None, traces=pair,
                          pdl=variant == "fused-pdl", wait_k1_first=True)
        elif variant == "gemm":
            _launchers.launch_gemm_only(support, default_workspace(x.device), *fused.quantize(x),
                                        weight, scale, in_use, trace=pair[1])
        elif variant == "h-given":
            _launchers.launch_k2(support, default_workspace(x.device), _launchers.FP8,
                                 *fused.quantize(x), weight, scale,
                                 torch.empty(x.shape[0], lora.out_features,
                                             dtype=torch.bfloat16, device=x.device),
                                 hs[name], lora, batch, in_use, trace=pair[1])
        else:
            fused._linear(0, x, weight, scale, lora, batch,
                          _k1_config(variant, x.shape[0], lora), None, decode=True,
                          pdl=variant != "serialized", warm_l2=_warm(variant), traces=pair)


def _stats(k1: torch.Tensor | None, k2: torch.Tensor) -> dict:
    """One projection's timeline from its trace rows (int64 [programs, 8], zero = not run)."""
    k2 = k2[k2[:, 0] != 0]
    t0 = int(k1[k1[:, 0] != 0][:, 0].min()) if k1 is not None else int(k2[:, 0].min())
    us = lambda t: (int(t) - t0) / 1000.0  # noqa: E731
    out = {"t0_ns": t0, "k2_start": us(k2[:, 0].min()), "k2_loop_end": us(k2[:, 2].max()),
           "k2_end": us(k2[:, 4].max()), "k2_programs": int(k2.shape[0])}
    if k1 is not None:
        k1 = k1[k1[:, 0] != 0]
        k1_end = int(k1[:, 1].max())
        quant = k1[k1[:, 2] != 0]  # the quantizing programs stamp slot 2 too (none on codes)
        if quant.shape[0]:
            out["k1_quant_end"] = us(quant[:, 2].max())
        out.update(k1_end=us(k1_end), k1_programs=int(k1.shape[0]),
                   k1_sms=int(k1[:, 7].unique().numel()), k2_late=int((k2[:, 0] > k1_end).sum()))
        # K2's programs on the SMs some K1 program ran on, against the others: whether K1
        # beside them is what slows the last of K2's K loops.
        shared = torch.isin(k2[:, 7], k1[:, 7].unique())
        out["k2_shared"] = int(shared.sum())
        for name, rows in (("shared", k2[shared]), ("alone", k2[~shared])):
            if rows.shape[0]:
                out[f"k2_{name}_loop_end"] = us(rows[:, 2].max())
    if bool((k2[:, 1] != 0).any()):
        out["k2_spin"] = statistics.median(((k2[:, 1] - k2[:, 0]) / 1000.0).tolist())
    loop_from = torch.where(k2[:, 1] != 0, k2[:, 1], k2[:, 0])
    out["k2_loop_median"] = statistics.median(((k2[:, 2] - loop_from) / 1000.0).tolist())
    out["k2_epi_median"] = statistics.median(((k2[:, 4] - k2[:, 2]) / 1000.0).tolist())
    if bool((k2[:, 3] != 0).any()):
        out["k2_wait_end"] = us(k2[:, 3].max())
        out["k2_wait_max"] = float((k2[:, 3] - k2[:, 2]).max()) / 1000.0
    return out


def _place_in_layer(rep: dict) -> dict:
    """Each projection's `layer_start` (us from the layer's first traced program) and
    `gap_before` (from the previous projection's last K2 program), from one replay's `_stats`
    in launch order; their clocks' origin `t0_ns` dropped."""
    first, prev_end = min(r["t0_ns"] for r in rep.values()), None
    for r in rep.values():
        start = (r.pop("t0_ns") - first) / 1000.0
        r["layer_start"] = start
        if prev_end is not None:
            r["gap_before"] = start - prev_end
        prev_end = start + r["k2_end"]
    return rep


def _trace_rows(tokens: int, adapters: int, rank: int) -> int:
    """At least as many programs as any K1 or K2 launch here has, whatever its settings (tiles
    of 16 or more, at most 3 slices, split-K at most 16, N at most 24576, at most 4 quantizing
    programs a row): a trace row each."""
    k1 = 4 * tokens + (adapters + 1) * -(-tokens // 16) * -(-rank // 16) * 3 * 16
    k2 = -(-tokens // 16) * (24576 // 16) * 16
    return max(k1, k2)


def timeline(variant, xs, layer, batch, hs, codes, reps, flush) -> dict:
    tokens = next(iter(xs.values())).shape[0]
    _, _, lora = next(iter(layer.values()))
    rows = _trace_rows(tokens, batch.max_loras, lora.max_rank)
    traces = {name: (torch.zeros(rows, 8, dtype=torch.int64, device="cuda"),
                     torch.zeros(rows, 8, dtype=torch.int64, device="cuda"))
              for name in layer}
    run = functools.partial(run_variant, variant, xs, layer, batch, hs, codes, traces)
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    per_rep = []
    for _ in range(reps):
        for pair in traces.values():
            for t in pair:
                t.zero_()
        flush.zero_()
        graph.replay()
        torch.cuda.synchronize()
        rep = {}
        for name, (k1, k2) in traces.items():
            k1, k2 = k1.cpu(), k2.cpu()
            if variant in ONE_LAUNCH:  # the shrink's programs stand for K1
                k1 = k2[(k2[:, 0] != 0) & (k2[:, 2] == 0)]
                k2 = k2[k2[:, 2] != 0]
            rep[name] = _stats(None if variant in UNTRACED_K1 else k1, k2)
        per_rep.append(_place_in_layer(rep))
    return {name: {key: statistics.median(r[name][key] for r in per_rep)
                   for key in per_rep[0][name] if all(key in r[name] for r in per_rep)}
            for name in layer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--trace-reps", type=int, default=15)
    parser.add_argument("--variants", nargs="*",
                        default=["decode", "decode-warm0", "decode-warm256", "h-given"])
    parser.add_argument("--traced", nargs="*", default=["decode", "h-given"])
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--tokens", type=int, nargs="+", help=f"default {TOKENS}")
    parser.add_argument("--adapters", type=int, default=1, help="tokens round robin over them")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["qwen3-8b"])
    parser.add_argument("--git-sha", default=None)
    args = parser.parse_args()
    for variant in args.variants:
        known = variant in ("decode", "decode-k1r32", "serialized", "fused", "fused-pdl",
                            "h-given", "gemm", *CODES_VARIANTS)
        if not (known or variant.removeprefix("decode-warm").isdigit()):
            parser.error(f"unknown variant {variant!r}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = l2_flush_buffer()
    rows = []
    traced_tokens = args.tokens or TRACED_TOKENS
    for model, rank in itertools.product(args.models, args.ranks):
        layer = make_layer(args.adapters, rank, gen, MODELS[model])
        for tokens in args.tokens or TOKENS:
            batch, xs, hs, bufs = adapter_case(tokens, rank, layer, gen, args.adapters,
                                                  MODELS[model])
            base = dict(bench="decode_timeline", model=model, base="fp8", tokens=tokens,
                        rank=rank, adapters=args.adapters)
            codes = {name: fused.quantize(x) for name, x in xs.items()}  # vLLM's, bit for bit
            against = {}
            for system in ("cutlass", "cutlass-codes"):
                against[system] = time_graph(functools.partial(
                    run_layer, system, xs, layer, batch, batch.vllm_meta_args(), bufs, codes),
                    args.reps, flush)
                rows.append({**base, "system": system, "metric": "layer_us",
                             "value": round(against[system], 2), "n": args.reps})
            for variant in args.variants:
                us = time_graph(functools.partial(run_variant, variant, xs, layer, batch, hs,
                                                  codes), args.reps, flush)
                rows.append({**base, "system": variant, "metric": "layer_us",
                             "value": round(us, 2), "n": args.reps})
                system = "cutlass-codes" if variant in CODES_VARIANTS else "cutlass"
                print(f"{model} rank={rank:3d} T={tokens:2d} {variant:16s} {us:7.1f} us "
                      f"({(us / against[system] - 1) * 100:+5.1f}% over {system} "
                      f"{against[system]:.1f})", flush=True)
                if tokens not in traced_tokens or variant not in args.traced:
                    continue
                for name, stats in timeline(variant, xs, layer, batch, hs, codes,
                                            args.trace_reps, flush).items():
                    rows.append({**base, "system": variant, "projection": name,
                                 "metric": "timeline_us", "value": stats,
                                 "n": args.trace_reps})
                    print("    " + f"{name:8s} " + " ".join(
                        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in stats.items()), flush=True)
        write_results(args, rows)


if __name__ == "__main__":
    main()
