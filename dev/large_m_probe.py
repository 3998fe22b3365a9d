"""GPU: where the fused path's time goes at prefill sizes, kernel by kernel, per projection.

For one model's four projections at prefill token counts, one rank-64 adapter (`--adapters`,
`--rank`: several slots, the tokens round robin over them): vLLM's per-token
quant and CUTLASS apart; our quantizer alone; K1 (quantize + shrink) in its launchers' settings
and in other tiles; the shrink alone (`lora_shrink`, on x and on the codes, in the same tiles);
K2 without the adapter (`fp8_gemm`) and with it (`lora_fp8_gemm`, its
epilogue adding h B^T); the expand alone (`lora_expand`, the hybrid path's second kernel); the
fused and decode paths whole. Each kernel alone in a CUDA graph, L2 flushed,
median. Every token count runs in a process of its own under a time limit, and each kernel is
named before it first runs, so a kernel that hangs costs one case and says which it was.
(At f4e3310 this probe timed K2's tiles and the hybrid path's kernels instead; its findings are
in docs/kernels.md, "Prefill".)

    source tools/device/setup.sh
    python3 dev/large_m_probe.py --out $OUT/large_m_probe.json
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from layer import adapter_inputs, l2_flush_buffer, make_layer, time_graphs  # noqa: E402
from models import MODELS  # noqa: E402

import epilora_kernels as ek  # noqa: E402
from epilora_kernels.launch import LaunchConfig  # noqa: E402

# K1's tiles: (block_m, block_r, block_k, split_k, warps, stages)
# The shrink's reads of x and A from L2 fall with wider row and rank tiles (x is read once per
# slice and rank tile, A once per row tile: 64 x 32 tiles read Qwen3-8B's x six times for qkv at
# 2048 tokens), and with every slice in one program (`slices_together`: x once per rank
# tile), their programs and blocks per SM too; the later ones trade them otherwise.
# (block_m, block_r, block_k, split_k, warps, stages[, slices_together])
K1_TILES = [(16, 32, 128, 8, 4, 2), (16, 64, 128, 8, 4, 2), (32, 64, 128, 8, 4, 3),
            (64, 64, 128, 4, 4, 3), (64, 64, 128, 8, 4, 3), (64, 64, 256, 2, 4, 3),
            (128, 64, 128, 4, 8, 3), (64, 32, 128, 4, 4, 3),
            (128, 64, 128, 8, 8, 3), (128, 64, 64, 8, 8, 4), (64, 64, 64, 8, 4, 4),
            (64, 32, 128, 4, 4, 3, True), (64, 32, 64, 4, 4, 4, True),
            (128, 32, 64, 4, 8, 3, True), (128, 64, 64, 8, 8, 3, True),
            # the same tile split 4 and 16 ways: where K is split, the last of a tile's programs
            # reads every split's fp32 partial back alone (`_sum_splits`: split x its tile,
            # `partial_kb` in the rows): 768 KB at 128 x 64 x 3 slices split 8, against 96 KB
            # for qkv's 64 x 32 x 3 slices split 4. Does that serial sum make wide tiles slow?
            (128, 64, 64, 4, 8, 3, True), (128, 64, 64, 16, 8, 3, True)]


def partial_kb(tile: tuple, slices: int) -> float:
    """KB of fp32 partials the last program of a split tile reads back, its own included
    (`_fused_kernels._sum_splits`; 0 unsplit)."""
    bm, br, _, split, _, _, *together = tile
    planes = split if split > 1 else 0
    return planes * bm * br * (slices if together and together[0] else 1) * 4 / 1024


def tile_name(tile: tuple) -> str:
    bm, br, bk, split, warps, stages, *together = tile
    return f"{bm}r{br}k{bk}s{split}w{warps}p{stages}" + ("-together" if together else "")


def kernels(x, weight, scale, lora, batch):
    from vllm import _custom_ops as ops

    codes, x_scale = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)
    _, _, h = ek.quantize_and_shrink(x, lora, batch)
    y = ops.cutlass_scaled_mm(codes, weight.t(), x_scale, scale, torch.bfloat16)
    a_cat = torch.cat([a[0, 0] for a in lora.lora_a]).contiguous()
    fns = {
        "vllm-quant": lambda: ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True),
        "cutlass-mm": lambda: ops.cutlass_scaled_mm(codes, weight.t(), x_scale, scale,
                                                    torch.bfloat16),
        "ek-quant": lambda: ek.quantize(x),
        "ek-k1": lambda: ek.quantize_and_shrink(x, lora, batch),
        "ek-gemm": lambda: ek.fp8_gemm(codes, x_scale, weight, scale),
        "ek-k2-lora": lambda: ek.lora_fp8_gemm(codes, x_scale, weight, scale, h, lora, batch),
        "ek-fused": lambda: ek.fused_lora_fp8_linear(x, weight, scale, lora, batch),
        "ek-decode": lambda: ek.lora_linear(x, weight, scale, lora, batch, path="decode"),
        "ek-expand": lambda: ek.lora_expand(y, h, lora, batch),
        # the shrink apart from the quantizer (the hybrid path's kernel: K1 without codes), on
        # x and on the codes: is K1's time over the quantizer the shrink's own, or their fusion's?
        "ek-shrink": lambda: ek.lora_shrink(x, lora, batch),
        "ek-shrink-codes": lambda: ek.lora_shrink(codes, lora, batch, x_scales=x_scale),
        # a floor for the shrink's tiles: with one adapter it is one bf16 GEMM, x against the
        # slot's A of every slice, here cuBLAS's (with several, slot 0's: a product of the
        # same shape, not the same answer)
        "torch-shrink": lambda: torch.mm(x, a_cat.t()),
    }
    for bm, br, bk, split, warps, stages, *together in K1_TILES:
        cfg = LaunchConfig(block_m=bm, block_r=br, block_k=bk, split_k=split, num_warps=warps,
                           num_stages=stages, slices_together=bool(together))
        tile = tile_name((bm, br, bk, split, warps, stages, *together))
        fns[f"ek-k1-{tile}"] = (
            lambda cfg=cfg: ek.quantize_and_shrink(x, lora, batch, config=cfg))
        fns[f"ek-shrink-{tile}"] = lambda cfg=cfg: ek.lora_shrink(x, lora, batch, config=cfg)
    # each shrink's h against the launchers' K1's, but the codes' against their own twin's (h
    # of the FP8 codes is ~3% off h of x)
    from epilora_kernels import reference

    on_codes = reference.lora_shrink(codes, lora, batch, x_scales=x_scale)
    return fns, {"ek-shrink-codes": on_codes.float(), None: h.float().clone()}


def run_case(model: str, tokens: int, reps: int, only: list[str] | None = None,
             adapters: int = 1, rank: int = 64) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    projections = MODELS[model]
    layer = make_layer(adapters, rank, gen, projections)
    batch, xs, _ = adapter_inputs(tokens, rank, adapters, gen, projections)
    flush = l2_flush_buffer()
    rows = []
    for name, (weight, scale, lora) in layer.items():
        fns, references = kernels(xs[name], weight, scale, lora, batch)
        if only:
            unknown = set(only) - set(fns)
            if unknown:
                raise SystemExit(f"--kernels: no kernel named {sorted(unknown)}; "
                                 f"the names are {sorted(fns)}")
            fns = {key: fn for key, fn in fns.items() if key in only}
        good = {}
        for key, fn in fns.items():
            print(f"# {model} {name} {tokens} {key}: first run", flush=True)
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"# {key} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if key.startswith(("ek-k1-", "ek-shrink")):  # h against the launchers' settings'
                got = out[2] if key.startswith("ek-k1-") else out
                want = references.get(key, references[None])
                err = ((got.float() - want).norm() / want.norm()).item()
                if err > 1e-2:
                    print(f"# {key} WRONG: relative error {err:.3g}", flush=True)
                    continue
            good[key] = fn
        reduced = {f"{prefix}-{tile_name(t)}": partial_kb(t, len(lora.output_slices))
                   for t in K1_TILES for prefix in ("ek-k1", "ek-shrink")}
        for key, us in time_graphs(good, reps, flush).items():
            rows.append({"model": model, "projection": name, "tokens": tokens, "kernel": key,
                         "adapters": adapters, "rank": rank, "us": round(us, 2)}
                        | ({"partial_kb": reduced[key]} if key in reduced else {}))
            print(f"{model:12s} {name:8s} {tokens:5d} {key:28s} {us:8.1f}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="qwen3-8b", choices=tuple(MODELS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--adapters", type=int, default=1,
                        help="adapter slots, the tokens round robin over them (default 1)")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--case-timeout", type=float, default=120.0)
    parser.add_argument("--kernels", nargs="+", metavar="NAME",
                        help="only these kernels (names as printed, e.g. ek-k1 vllm-quant "
                             "ek-k1-64r32k128s4w4p3-together; default: all): each compiles "
                             "in turn, about 3 s an sm_90 kernel")
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)  # one case, in-process
    args = parser.parse_args()
    if args.case is not None:
        Path(args.out).write_text(json.dumps(
            run_case(args.model, args.case, args.reps, args.kernels, args.adapters, args.rank)))
        return
    rows = []
    for tokens in args.tokens:
        part = Path(f"{args.out}.{tokens}")
        try:
            subprocess.run([sys.executable, __file__, "--out", str(part), "--model", args.model,
                            "--reps", str(args.reps), "--case", str(tokens),
                            "--adapters", str(args.adapters), "--rank", str(args.rank),
                            *(["--kernels", *args.kernels] if args.kernels else [])],
                           timeout=args.case_timeout, check=False)
        except subprocess.TimeoutExpired:
            print(f"# {tokens} tokens: past {args.case_timeout} s, stopped", flush=True)
        if part.is_file():
            rows += json.loads(part.read_text())
            part.unlink()
        Path(args.out).write_text(json.dumps(rows))
    print(summary(rows))


def summary(rows: list[dict]) -> str:
    """Per projection and token count: the launchers' K1 (`ek-k1`), the fastest of its tilings
    and their ratio; then, per kernel (every tiling, the quantizer, the shrink alone, ...), its
    time summed over the projections against the launchers' K1's."""
    lines = ["projection tokens  ek-k1 us  fastest tiling                        us   ratio"]
    cells = sorted({(r["projection"], r["tokens"]) for r in rows})
    totals: dict[tuple[int, str], float] = {}
    for projection, tokens in cells:
        times = {r["kernel"]: r["us"] for r in rows
                 if (r["projection"], r["tokens"]) == (projection, tokens)}
        tilings = {k: v for k, v in times.items() if k.startswith("ek-k1-")}
        for name, us in times.items():  # every kernel's, e.g. ek-quant + ek-shrink against K1
            totals[(tokens, name)] = totals.get((tokens, name), 0.0) + us
        if "ek-k1" not in times or not tilings:
            continue
        best = min(tilings, key=tilings.get)
        lines.append(f"{projection:10s} {tokens:6d} {times['ek-k1']:9.1f}  {best:36s} "
                     f"{tilings[best]:6.1f}  {tilings[best] / times['ek-k1']:5.2f}")
    lines.append("tokens  kernel                                summed us  against ek-k1")
    for tokens in sorted({t for t, _ in totals}):
        base = totals.get((tokens, "ek-k1"))
        for (t, name), us in sorted(totals.items(), key=lambda item: item[1]):
            if t == tokens and name != "ek-k1" and base:
                lines.append(f"{tokens:6d}  {name:36s} {us:10.1f}  {us / base:5.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
