"""GPU: an FP8 GEMV on CUDA cores (no tensor cores) against vLLM's CUTLASS and our K2 without
adapter, on FP8 codes at 1-8 tokens, per projection of the benchmarks' models.

The batch-1 gap (docs/kernels-history.md, item 61): in an engine step our K2 runs 1.5-2.3 us a
projection longer than CUTLASS, and CUTLASS itself streams the weight at 60-75% of the HBM's
bandwidth at one token. A tensor-core GEMM pads one token to an 8-16 wide MMA; a GEMV reads
each weight row once, converts FP8 in registers and sums with FMAs, which at 1-8 tokens is far
below what the CUDA cores can do. If such a kernel streams the weight closer to the bandwidth,
the LoRA up-projection would go into its epilogue as it does into K2's. This probe times the
GEMV alone in a sweep of tiles (each projection's best printed, the sweep in the JSON), with
the L2 flushed and CUDA graphs (benchmarks/layer.py's `time_graphs`).
"""

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from layer import cutlass_on_codes, l2_flush_buffer, time_graphs  # noqa: E402
from models import MODELS  # noqa: E402

import epilora_kernels as ek  # noqa: E402


@triton.jit
def _fp8_gemv_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, N, K,
                     M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr):
    # out[m, n] = x_scale[m] * w_scale * sum_k codes[m, k] * w[n, k]; w is [N, K] row-major
    # (vLLM's FP8 weight before its transposed view), K a multiple of BLOCK_K.
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, M_PAD)
    n_mask = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
    x_mask = rm[:, None] < M
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        w = tl.load(w_ptrs + k, mask=n_mask[:, None], other=0.0).to(tl.float32)
        x = tl.load(x_ptrs + k, mask=x_mask, other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    scale = tl.load(x_scale_ptr + rm, mask=rm < M, other=0.0) * tl.load(w_scale_ptr)
    out = acc * scale[:, None]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], out.to(tl.bfloat16),
             mask=x_mask & n_mask[None, :])


def fp8_gemv(codes, scales, weight, weight_scale, block_n, block_k, warps, loop_stages):
    m, k = codes.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=codes.device)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        codes, scales, weight, weight_scale, out, n, k, M=m, M_PAD=triton.next_power_of_2(m),
        BLOCK_N=block_n, BLOCK_K=block_k, LOOP_STAGES=loop_stages, num_warps=warps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--block-k", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--loop-stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = l2_flush_buffer()
    rows = []
    print(f"{'model':12s} {'proj':8s} {'tokens':>6s} {'cutlass':>8s} {'our-k2':>8s} "
          f"{'gemv':>8s} {'gemv/cut':>8s}  best tile (n, k, warps, stages)")
    for model, projections in ((m, MODELS[m]) for m in args.models):
        for name, (k, slices) in projections.items():
            n = sum(slices)
            weight = (torch.randn(n, k, generator=gen, device="cuda") * 0.05).to(
                torch.float8_e4m3fn)
            w_scale = torch.tensor([0.01], device="cuda")
            for tokens in args.tokens:
                x = torch.randn(tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
                codes = ek.quantize(x)
                fns = {"cutlass": partial(cutlass_on_codes, codes, weight, w_scale),
                       "our-k2": partial(ek.fp8_gemm, *codes, weight, w_scale)}
                tiles = [t for t in itertools.product(args.block_n, args.block_k, args.warps,
                                                      args.loop_stages) if k % t[1] == 0]
                if not tiles:
                    raise SystemExit(f"--block-k: none divides {name}'s K = {k}")
                for tile in tiles:
                    fns[tile] = partial(fp8_gemv, *codes, weight, w_scale, *tile)
                ref = fns["cutlass"]().float()
                errs = {t: ((fns[t]().float() - ref).norm() / ref.norm()).item() for t in fns}
                times = time_graphs(fns, args.reps, flush)
                right = [t for t in tiles if errs[t] < 1e-2] or tiles  # a wrong tile is no best
                best = min(right, key=times.__getitem__)
                for system, us in times.items():
                    rows.append({"model": model, "projection": name, "tokens": tokens,
                                 "k": k, "n": n,
                                 "system": system if isinstance(system, str) else "gemv",
                                 "tile": None if isinstance(system, str) else list(system),
                                 "us": round(us, 2), "rel_err_vs_cutlass": round(errs[system], 5),
                                 "n_reps": args.reps})
                print(f"{model:12s} {name:8s} {tokens:6d} {times['cutlass']:8.2f} "
                      f"{times['our-k2']:8.2f} {times[best]:8.2f} "
                      f"{times[best] / times['cutlass']:8.2f}  {best} "
                      f"err {max(errs.values()):.0e}", flush=True)
                Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
