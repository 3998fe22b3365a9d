"""Tune epilora-kernels' launch settings on this GPU, write its launch table, and time our FP8
GEMM alone against vLLM's CUTLASS.

For each Qwen3-8B projection shape (qkv, o, gate_up, down) and token count, times every
candidate `LaunchConfig` of K2 without adapters (`fp8_gemm`: the GEMM's main loop, which is
what the settings change) and of K1 timed with the kernel after it: quantize + shrink then K2
for the fused path (op `quantize_shrink`) and for the decode path (op `decode_shrink`: K2
overlaps K1; up to 32 tokens), the shrink then the expand after vLLM's GEMM for the hybrid
path (op `shrink`); at rank 64 (`--rank`: another rank, its entries written under
`"NxK@r<rank tile>"` keys, which the launchers prefer at that rank tile) with the tokens spread
over `--adapters` adapters (4), on
CUDA-graph replays with the L2 flushed (median of `--reps`). It checks each candidate's result
(K2 against CUTLASS, K1's codes bitwise against our quantizer, h against torch's fp32) and
keeps the fastest; `--ops k1` tunes K1 only, with the installed K2 settings (`--ops decode`:
the decode path's K1 alone); `--ops k2-lora`
tunes K2 only, each candidate timed in the fused path with its epilogue (K1 with the installed
settings; checked against torch's fused path), for ranks whose epilogue changes which tiles win
(written under the rank's key, rank 64 included). In the same run,
per projection: `cutlass-mm` (vLLM's `cutlass_scaled_mm` on the same codes), `vllm-quant`
(vLLM's per-token quantizer) and `epilora-quant` (our quantizer alone). Writes the table
(`epilora_kernels/configs/<device>.json` format, schema-checked; entries of the installed table
for token counts not tuned here are kept) and every timing.

    python3 benchmarks/tune.py --out-table $OUT/NVIDIA_H200.json --out $OUT/tune.json
    python3 benchmarks/tune.py --ops k1 --adapters 1 --tokens 64 128 256 --out-table ... --out ...
    python3 benchmarks/tune.py --ops k1 --adapters 1 --rank 128 --tokens 64 128 256 ...
    python3 benchmarks/tune.py --ops k2-lora --adapters 1 --rank 128 --tokens 256 ...
    python3 benchmarks/tune.py --ops decode --adapters 1 --rank 128 --tokens 1 4 8 16 ...

The whole sweep takes longer than one device call's 10 minutes: split it by `--tokens`, and
copy each call's table into `epilora_kernels/configs/` before the next (entries for counts not
tuned are kept).
"""

import argparse
import functools
import json

import torch
import triton
from layer import PROJECTIONS, l2_flush_buffer, make_layer, time_graph, write_results

import epilora_kernels as ek
from epilora_kernels import reference
from epilora_kernels.batch import AdapterBatch
from epilora_kernels.launch import (
    DECODE_SHRINK_MAX_TOKENS,
    LaunchConfig,
    rank_block,
    shape_key,
    write_table,
)

# No 32: its plain tiles lost to the heuristic's swapped ones, which this sweep does not
# offer (the table's 32-token bucket was retired; the library's tuner, tune_decode, tunes
# 32 tokens with them). --tokens 32 still can.
TOKENS = (1, 4, 8, 16, 64, 128, 256)
RANK = 64  # the table's plain entries; --rank tunes others under rank keys
H_TOLERANCE = 1e-4  # relative; the epilogue rounds h to bf16 (4e-3) anyway
# Candidate tiles, pruned by the first sweep (benchmarks/results/h200/tune_v1.json: 128-wide N
# and 128-deep K tiles never won at 1-32 tokens; split-K never won there either, but stays in);
# 16-wide N and 1024-deep K are new (more programs, more bytes in flight per program: our K2
# trails CUTLASS on the 4096-wide outputs, tune_v2.json), untried on a GPU so far.
DECODE_TILES = ((16, 512), (32, 256), (32, 512), (32, 1024), (64, 256), (64, 512))  # (BN, BK)
PREFILL_TILES = ((64, 32, 256, 4), (64, 64, 128, 4), (64, 64, 256, 4), (64, 128, 128, 4),
                 (128, 128, 64, 8), (128, 128, 128, 8), (128, 256, 64, 8))  # (BM, BN, BK, warps)


def entry_rank(rank: int, k2_with_epilogue: bool = False) -> int | None:
    """The rank under whose key a tuned entry goes: none (the plain key) at RANK, except for K2
    timed with its epilogue, whose plain keys would also serve the GEMM without adapters."""
    return rank if k2_with_epilogue or rank != RANK else None


def _block_m(tokens: int) -> int:
    return 16 if tokens <= 16 else 32


def k2_candidates(tokens: int, slices: tuple[int, ...], rank: int = RANK):
    block_r = rank_block(rank)
    if tokens <= 32:
        grid = [LaunchConfig(block_m=_block_m(tokens), block_n=bn, block_k=bk, block_r=block_r,
                             split_k=split, num_stages=stages, num_warps=4)
                for bn, bk in DECODE_TILES for split in (1, 2) for stages in (3, 5)]
    else:
        grid = [LaunchConfig(block_m=bm, block_n=bn, block_k=bk, block_r=block_r, split_k=split,
                             num_stages=stages, num_warps=warps)
                for bm, bn, bk, warps in PREFILL_TILES for stages in (3, 4)
                for split in ((1, 2) if bm == 64 and tokens <= 64 else (1,))]
    return [c for c in grid if not any(width % c.block_n for width in slices[:-1])]


def k1_candidates(tokens: int, rank: int = RANK, k: int = 4096, depths: tuple[int, ...] = (2,)):
    # K1's K loop is latency-bound: the sweeps so far (tune.json at 1-32 tokens,
    # tune_k1_64_256.json beyond) favoured the most splits offered everywhere, so deeper splits,
    # deeper K steps and more stages are in. With 8 warps K1's quantizing programs read a row of
    # up to 16384 features once (_tiling.quant_block): untried on a GPU. Beyond 32 tokens rank
    # tiles wider than 32 are offered too (untried: at rank 128 a 32-wide tile makes four
    # programs re-read each x tile, decode_timeline_prefill_r128.json).
    # At rank 128 the decode path's K1 also gets 64-wide rank tiles and two-way splits (fewer
    # programs beside K2; in tune_decode_r128_wide.json 64-wide tiles won on qkv and o at 16).
    # Up to 32 tokens a long K (down's 12288) also gets 32 splits: there K1's 16-32 programs
    # ran for most of K2's loop beside it (decode_timeline_16c8e9b.json); untried on a GPU.
    # Up to 32 tokens `depths` are the K loop's pipeline depths offered (2 everywhere so far; a
    # deeper one keeps more of A in flight, so K1 ends sooner beside K2, at the cost of
    # shared memory K2 could use: tune_layer.py --k1-stages).
    whole = rank_block(rank)
    if tokens <= 32:
        block_m = 16 if tokens <= 16 else 32
        return [LaunchConfig(block_m=block_m, block_k=block_k, block_r=block_r,
                             split_k=split_k, num_stages=depth, num_warps=4)
                for depth in depths
                for split_k in ((2, 4, 8, 16) if whole >= 128 else (4, 8, 16))
                for block_k in (128, 256)
                for block_r in sorted({32, min(64, whole), whole})] + [
            LaunchConfig(block_m=block_m, block_k=256, block_r=whole, split_k=split_k,
                         num_stages=depth, num_warps=8) for depth in depths for split_k in (8, 16)
        ] + [
            LaunchConfig(block_m=block_m, block_k=256, block_r=block_r, split_k=32,
                         num_stages=depth, num_warps=4)
            for depth in depths for block_r in sorted({32, whole}) if k >= 8192]
    return [LaunchConfig(block_m=16, block_k=block_k, block_r=32, split_k=split_k,
                         num_stages=stages, num_warps=4)
            for split_k in (8, 16) for block_k in (128, 256) for stages in (2, 3, 4)] + [
        LaunchConfig(block_m=64, block_k=128, block_r=32, split_k=8, num_stages=stages,
                     num_warps=4) for stages in (2, 4)] + [
        LaunchConfig(block_m=16, block_k=128, block_r=32, split_k=8, num_stages=2,
                     num_warps=8)] + [
        LaunchConfig(block_m=block_m, block_k=128, block_r=block_r, split_k=8, num_stages=2,
                     num_warps=4)
        for block_m in (16, 32) for block_r in (64, 128) if block_r <= whole] + [
        # 64-row tiles over 64 or 128 rank columns: each row tile re-reads all of A, each rank
        # tile all of x, so 16-row, 32-wide tiles at 256 tokens and rank 128 read A 16 times
        # and x 4 times (from L2). Untried on a GPU; 64 x 128 tiles 128 deep spill with 4 warps
        # (benchmarks/results/cpu/sm90_occupancy_k1_candidates_r128.json).
        LaunchConfig(block_m=64, block_k=block_k, block_r=block_r, split_k=split_k,
                     num_stages=stages, num_warps=warps)
        for block_r in (64, 128) if block_r <= whole for split_k in (2, 4, 8)
        for block_k, stages, warps in ((64, 3, 4), (128, 2, 4), (128, 2, 8))
        if (block_r, block_k, warps) != (128, 128, 4)]


def decode_prefill_k1_candidates(rank: int = RANK, k: int = 4096):
    # The decode path's K1 beyond 32 tokens: K2 can start only once every K1 program has
    # been launched (PDL), so K1's shrink gets few programs (32-64 rows, wide rank tiles) that
    # leave the SMs to K2 after the quantizing ones, and runs beside K2's K loop instead of
    # before it (the fused path's K1 at 256 tokens and rank 128: 1000-2300 programs, 8 us a
    # projection before K2, decode_timeline_prefill_r128.json). K2's first wave waits for all
    # of K1 before its epilogue, so K1 must end early: at 256 tokens and rank 128 every tile
    # was fastest with the most splits offered, 8 (tune_layer_k1_r128_prefill.json), so up to
    # 16, and 32 for a long K. No 64 x 128 tile 128 deep with 4 warps: it spills
    # (sm90_occupancy_k1_candidates_r128.json).
    whole = rank_block(rank)
    tiles = {(64, whole, 64, 3, 4), (64, whole, 128, 2, 8), (64, min(64, whole), 128, 2, 4),
             (32, whole, 128, 2, 4)}
    splits = (2, 4, 8, 16, 32) if k >= 8192 else (2, 4, 8, 16)
    return [LaunchConfig(block_m=bm, block_k=bk, block_r=br, split_k=split, num_stages=stages,
                         num_warps=warps)
            for bm, br, bk, stages, warps in sorted(tiles) for split in splits]


# K1's ops, each timed with the kernel it feeds (K2, or the hybrid path's expand after vLLM's
# CUTLASS): K1's split count trades its own speed against its reduction, which K2 overlaps
# (the decode path) or waits for.
K1_OPS = ("quantize_shrink", "shrink", "decode_shrink")
TUNED_OPS = {"all": ("lora_gemm", *K1_OPS), "k1": K1_OPS, "decode": ("decode_shrink",),
             "k2-lora": ("lora_gemm",)}


def _k1_pair(op, x, weight, scale, lora, batch, k1_cfg, k2_cfg, base_out):
    if op == "shrink":  # the hybrid path after vLLM's GEMM (`base_out`, added to in place)
        def pair():
            h = ek.lora_shrink(x, lora, batch, config=k1_cfg)
            return ek.lora_expand(base_out, h, lora, batch, config=k2_cfg)
        return pair
    linear = (ek.decode_lora_fp8_linear if op == "decode_shrink"
              else ek.fused_lora_fp8_linear)
    return functools.partial(linear, x, weight, scale, lora, batch, k1_config=k1_cfg,
                             k2_config=k2_cfg)


def installed_table() -> dict:
    """The launch table the package ships for this GPU (empty if none), to update."""
    from importlib import resources

    from epilora_kernels.launch import table_name

    path = resources.files("epilora_kernels").joinpath(
        "configs", table_name(torch.cuda.get_device_name()))
    return json.loads(path.read_text()) if path.is_file() else {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def timing_row(case: dict, metric: str, us: float, cfg, reps: int, extra: dict) -> dict:
    """One timing as the result files hold it (`us` inf: the candidate did not run)."""
    return {**case, "config": cfg.__dict__ if cfg else None, "metric": metric,
            "value": None if us == float("inf") else round(us, 2), "n": reps, **extra}


def timed(run, reps, flush, check=lambda: True) -> tuple[bool, float]:
    """(check passed, median us); a candidate that fails to launch (e.g. out of shared
    memory for its tiles) or to check is not one here: (False, inf)."""
    try:
        if not check():
            return False, float("inf")
        return True, time_graph(run, reps, flush)
    except triton.runtime.errors.OutOfResources as exc:
        print(f"    skipped: {str(exc)[:120]}", flush=True)
        return False, float("inf")


def main() -> None:
    from vllm import _custom_ops as ops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-table", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--ops", choices=tuple(TUNED_OPS), default="all",
                        help="k1: tune K1's ops only, each with the installed K2 settings; "
                             "decode: the decode path's K1 only (1-32 tokens); "
                             "k2-lora: K2 only, timed with its epilogue (the fused path with "
                             "the installed K1 settings) instead of without adapters")
    parser.add_argument("--adapters", type=int, default=4,
                        help="adapters the tokens are spread over (round robin)")
    parser.add_argument("--slots", type=int, default=None,
                        help="adapter slots (max_loras; default: the adapters, at least 4). "
                             "K2's epilogue and K1's programs depend on it: decode.py runs 1 "
                             "(the sweeps until 16c8e9b ran 4)")
    parser.add_argument("--rank", type=int, default=RANK,
                        help=f"the adapters' rank; other than {RANK}, entries go under rank keys")
    parser.add_argument("--git-sha", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = l2_flush_buffer()
    slots = args.slots or max(4, args.adapters)
    layer = make_layer(slots, args.rank, gen)
    table = installed_table()
    # Where each entry came from: the table's earlier provenance (`sources`) and the runs since,
    # in order, a later run's ops and finished token counts replacing an earlier one's (a run
    # cut short lists only what it finished).
    old = table.get("_meta", {})
    run = {"git_sha": args.git_sha, "mode": args.ops, "ops": list(TUNED_OPS[args.ops]),
           "adapters": args.adapters, "slots": slots, "rank": args.rank, "tokens": []}
    table["_meta"] = {"device": torch.cuda.get_device_name(), "rank": RANK,
                      "tool": "benchmarks/tune.py",
                      **({"sources": old["sources"]} if "sources" in old else {}),
                      "runs": [*old.get("runs", []), run]}
    for op in (*K1_OPS, "lora_gemm"):
        table.setdefault(op, {})
    rows = []

    def row(op, name, tokens, us, cfg=None, **extra):
        rows.append(timing_row({"bench": "tune", "op": op, "projection": name,
                                "tokens": tokens}, "kernel_us", us, cfg, args.reps, extra))

    for tokens in args.tokens:
        mapping = torch.arange(tokens, device="cuda", dtype=torch.int32) % args.adapters
        batch = AdapterBatch.from_token_mapping(mapping, slots)
        for name, (weight, scale, lora) in layer.items():
            k, slices = PROJECTIONS[name]
            n = sum(slices)
            x = torch.randn(tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
            codes, scales = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)
            cutlass = timed(functools.partial(ops.cutlass_scaled_mm, codes, weight.t(), scales,
                                              scale, torch.bfloat16), args.reps, flush)[1]
            row("cutlass-mm", name, tokens, cutlass)
            quant = timed(functools.partial(ops.scaled_fp8_quant, x, None,
                                            use_per_token_if_dynamic=True), args.reps, flush)[1]
            row("vllm-quant", name, tokens, quant)
            want = ops.cutlass_scaled_mm(codes, weight.t(), scales, scale, torch.bfloat16)
            best2 = (float("inf"), None)  # (None: the installed table's or heuristic's K2)
            if args.ops == "k2-lora":  # against torch's fused path (fp32 matmuls)
                want = reference.fused_lora_fp8_linear(x, weight, scale, lora, batch)
            tuned = TUNED_OPS[args.ops]
            for cfg in k2_candidates(tokens, slices, args.rank) if "lora_gemm" in tuned else ():
                gemm = (functools.partial(ek.fused_lora_fp8_linear, x, weight, scale, lora,
                                          batch, k2_config=cfg) if args.ops == "k2-lora" else
                        functools.partial(ek.fp8_gemm, codes, scales, weight, scale,
                                          config=cfg))
                ok, us = timed(gemm, args.reps, flush,
                               lambda gemm=gemm, want=want: rel(gemm(), want) < 1e-2)
                row("lora_gemm", name, tokens, us, cfg, ok=ok,
                    **({"timed": "with K1 and the epilogue"} if args.ops == "k2-lora" else {}))
                best2 = min(best2, (us, cfg), key=lambda b: b[0])
            our_quant = timed(functools.partial(ek.quantize, x), args.reps, flush)[1]
            row("epilora-quant", name, tokens, our_quant)
            # K1's checks: codes bit for bit our quantizer's (tested against vLLM's), h against
            # torch's fp32 within accumulation error over K (the first sweeps compared
            # candidates with each other at 1e-5, which split-K orderings at K = 12288 exceed
            # on tensor cores: every split candidate of the down projection was rejected).
            want_codes, _ = ek.quantize(x)
            want_h = reference.lora_shrink(x, lora, batch)  # fp32 matmuls (no TF32)
            best1 = {}
            # (decode_shrink, the decode path's, only up to DECODE_SHRINK_MAX_TOKENS)
            for op in (op for op in K1_OPS if op in tuned
                       and (tokens <= DECODE_SHRINK_MAX_TOKENS or op != "decode_shrink")):
                best1[op] = (float("inf"), None)
                for cfg in k1_candidates(tokens, args.rank, k):
                    pair = _k1_pair(op, x, weight, scale, lora, batch, cfg, best2[1],
                                    want.clone())

                    k1 = functools.partial(ek.quantize_and_shrink, x, lora, batch,
                                           config=cfg)

                    def same(k1=k1, want_codes=want_codes, want_h=want_h):
                        codes, _, h = k1()
                        return bool(torch.equal(codes.view(torch.uint8),
                                                want_codes.view(torch.uint8))) and \
                            rel(h, want_h) < H_TOLERANCE

                    ok, us = timed(pair, args.reps, flush, same)
                    row(op, name, tokens, us, cfg, ok=ok, timed="with K2")
                    best1[op] = min(best1[op], (us, cfg), key=lambda b: b[0])
            print(f"{name:8s} T={tokens:3d} cutlass-mm {cutlass:7.1f}  ours {best2[0]:7.1f} "
                  f"({best2[0] / cutlass:4.2f}x)  quant: vllm {quant:5.1f} ours {our_quant:5.1f}  "
                  + "  ".join(f"{op} {us:6.1f}" for op, (us, _) in best1.items())
                  + f"  K2 {best2[1]}", flush=True)
            for op, (_, cfg) in (("lora_gemm", best2), *best1.items()):
                if cfg is not None:  # not tuned (--ops k1) or no candidate passed its check
                    key = shape_key(n, k, entry_rank(args.rank, op == "lora_gemm"
                                                     and args.ops == "k2-lora"))
                    table[op].setdefault(key, {})[str(tokens)] = cfg.__dict__
        run["tokens"].append(tokens)
        write_table(table, args.out_table)
        write_results(args, rows)


if __name__ == "__main__":
    main()
