"""Tune epilora-kernels' launch settings on this GPU and write its launch table.

For each Qwen3-8B projection shape (qkv, o, gate_up, down) and token bucket, times every
candidate `LaunchConfig` of K1 (`quantize_and_shrink`) and K2 (`lora_fp8_gemm`) on CUDA-graph
replays with the L2 flushed (median of `--reps`), checks each candidate's result against the
heuristic's (K1 codes bitwise; outputs by relative error), and keeps the fastest. Writes the
table (`epilora_kernels/configs/<device>.json` format, schema-checked) and every timing.

    python3 benchmarks/tune.py --out-table $OUT/NVIDIA_H200.json --out $OUT/tune.json
"""

import argparse
import functools
import itertools
import json

import torch
from layer import PROJECTIONS, make_layer, time_graph, write_results

from epilora_kernels import fused
from epilora_kernels.batch import AdapterBatch
from epilora_kernels.launch import LaunchConfig, heuristic_config, shape_key, validate_table

TOKENS = (1, 4, 8, 16, 32, 64, 128, 256)
RANK = 64


def k2_candidates(tokens: int, slices: tuple[int, ...]):
    block_m = 16 if tokens <= 16 else (32 if tokens <= 32 else 64)
    for block_n, block_k, stages, warps in itertools.product((32, 64, 128), (128, 256), (3, 4),
                                                             (4, 8)):
        if any(width % block_n for width in slices[:-1]):
            continue
        yield LaunchConfig(block_m=block_m, block_n=block_n, block_k=block_k, block_r=RANK,
                           num_stages=stages, num_warps=warps)


def k1_candidates(tokens: int):
    block_m = 16 if tokens <= 16 else (32 if tokens <= 32 else 64)
    for split_k, block_k in itertools.product((1, 2, 4, 8, 16), (64, 128, 256)):
        yield LaunchConfig(block_m=block_m, block_k=block_k, block_r=RANK, split_k=split_k,
                           num_stages=2, num_warps=4)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-table", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--git-sha", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    layer = make_layer(4, RANK, gen)
    table: dict = {"_meta": {"device": torch.cuda.get_device_name(), "rank": RANK,
                             "tool": "benchmarks/tune.py"},
                   "quantize_shrink": {}, "lora_gemm": {}}
    rows = []
    for tokens in TOKENS:
        mapping = torch.arange(tokens, device="cuda", dtype=torch.int32) % 4
        batch = AdapterBatch.from_token_mapping(mapping, 4)
        for name, (weight, scale, lora) in layer.items():
            k, slices = PROJECTIONS[name]
            n = sum(slices)
            x = torch.randn(tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
            base1 = heuristic_config("quantize_shrink", tokens, n, k, RANK, slices)
            codes, scales, h = fused.quantize_and_shrink(x, lora, batch, config=base1)
            base2 = heuristic_config("lora_gemm", tokens, n, k, RANK, slices)
            want = fused.lora_fp8_gemm(codes, scales, weight, scale, h, lora, batch, config=base2)
            for op, candidates in (("quantize_shrink", k1_candidates(tokens)),
                                   ("lora_gemm", k2_candidates(tokens, slices))):
                best = None
                for cfg in candidates:
                    if op == "quantize_shrink":
                        c2, s2, h2 = fused.quantize_and_shrink(x, lora, batch, config=cfg)
                        ok = bool(torch.equal(c2.view(torch.uint8), codes.view(torch.uint8))) \
                            and rel(h2.sum(0), h.sum(0)) < 1e-5
                        run = functools.partial(fused.quantize_and_shrink, x, lora, batch,
                                                config=cfg)
                    else:
                        y = fused.lora_fp8_gemm(codes, scales, weight, scale, h, lora, batch,
                                                config=cfg)
                        ok = rel(y, want) < 1e-2
                        run = functools.partial(fused.lora_fp8_gemm, codes, scales, weight,
                                                scale, h, lora, batch, config=cfg)
                    us = time_graph(run, args.reps, flush) if ok else float("inf")
                    rows.append({"bench": "tune", "op": op, "projection": name, "tokens": tokens,
                                 "config": cfg.__dict__, "ok": ok, "metric": "kernel_us",
                                 "value": round(us, 2) if ok else None, "n": args.reps})
                    if ok and (best is None or us < best[0]):
                        best = (us, cfg)
                print(f"{op:16s} {name:8s} tokens={tokens:3d} best {best[0]:8.1f} us "
                      f"{best[1]}", flush=True)
                table[op].setdefault(shape_key(n, k), {})[str(tokens)] = best[1].__dict__
        validate_table(table)
        with open(args.out_table, "w") as f:
            json.dump(table, f, indent=1)
        write_results(args, rows)


if __name__ == "__main__":
    main()
