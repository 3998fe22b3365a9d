"""Registers, shared memory, spills and occupancy of K1 and K2 as the launchers run them on one
Qwen3-8B layer, compiled for sm_90 on a CPU (no GPU needed; TRITON_INTERPRET unset).

For each projection, token count and adapter rank, the decode path and the fused path record
their launches with the shipped launch table (`epilora_kernels/configs/NVIDIA_H200.json`; one
adapter, or `--adapters N ...` round robin, rows for each count), compile them as Triton's
launcher would (16-aligned arguments marked), and ask Triton's bundled ptxas for registers and
spill stores. Occupancy is the H200's limit per SM (65536 registers allocated per warp in units
of 256, 228 KB of shared memory with 1 KB reserved per block, 32 blocks, 2048 threads); `waves`
= programs / (blocks per SM x 132).

    python dev/sm90_occupancy.py --out benchmarks/results/cpu/sm90_occupancy.json \
        --tokens 1 4 8 16 32 64 128 256 512 2048 --adapters 1 8 [--heuristic] [--in-flight]

`--candidates k2` compiles instead every K2 candidate `benchmarks/tune.py` offers (the fused
path's K2, with its epilogue at the rank), `--candidates k1` every K1 candidate (the fused
path's K1), `--candidates k1-probe` the K1 tilings `dev/large_m_probe.py` times (the fused
path's K1 at prefill sizes, `slices_together` among them), `--candidates swap` every swapped
K2 the library's tuner offers (`launch.swap_candidates`, in the decode path), to see before a
GPU sweep which tiles fit how many blocks per SM and which spill, e.g. `--candidates k2
--tokens 256 --ranks 128 --projections gate_up` or `--candidates swap --tokens 1 32 --ranks 64`.

Why it exists: the decode timeline showed gate_up's K2 main loop slower at rank 128 than at
rank 64 with h given (decode_timeline.json); here K2 there holds more registers at rank 128
(the first segment's slice of B is loaded before the K loop), fewer blocks fit an SM and its
programs need more waves.
"""

import argparse
import functools
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

from epilora_testing.results import results_text

ROOT = Path(__file__).parents[1]
SMS = 132


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) from Triton's bundled ptxas."""
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    return (int(re.search(r"Used (\d+) registers", report).group(1)),
            int(re.search(r"(\d+) bytes spill stores", report).group(1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--projections", nargs="+", help="these only (default: all four)")
    parser.add_argument("--adapters", type=int, nargs="+", default=[1],
                        help="the tokens round robin over this many slots, as layer.py's "
                             "setups (several: K2's several-slot epilogue); each count's rows")
    parser.add_argument("--candidates", choices=("k1", "k2", "swap", "k1-probe"),
                        help="every K1 or K2 candidate of benchmarks/tune.py, in the fused "
                             "path; swap: every swapped K2 of the library's tuner "
                             "(launch.swap_candidates), in the decode path; k1-probe: "
                             "dev/large_m_probe.py's K1 tilings, in the fused path")
    parser.add_argument("--heuristic", action="store_true",
                        help="the heuristic's settings (no table), as EPILORA_LAUNCH_TABLES=0")
    parser.add_argument("--in-flight", action="store_true",
                        help="K2's loop over adapter segments in flight (_tiling.in_flight)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "packages/epilora-kernels/tests"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from layer import PROJECTIONS  # the benchmarks' Qwen3-8B shapes
    from tune import k1_candidates, k2_candidates

    import epilora_kernels as ek
    from epilora_kernels import _tiling, launch
    from epilora_kernels._tiling import blocks_per_sm
    from epilora_kernels.batch import AdapterBatch, LoraWeights
    from epilora_kernels.launch import LaunchConfig, select_config

    from aot_launchers_sm90 import compile_launch_full, record_launches

    sys.path.insert(0, str(ROOT / "dev"))
    from large_m_probe import K1_TILES as K1_PROBE_TILES

    # what the launchers pick on the H200 (with --heuristic: without a table)
    config = functools.partial(select_config, None if args.heuristic else "NVIDIA H200")

    rows = []
    for name, (k, slices) in PROJECTIONS.items():
        if args.projections and name not in args.projections:
            continue
        n = sum(slices)
        weight = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        for rank, slots in itertools.product(args.ranks, args.adapters):
            lora = LoraWeights(
                tuple(torch.empty(slots, 1, rank, k, dtype=torch.bfloat16) for _ in slices),
                tuple(torch.empty(slots, 1, width, rank, dtype=torch.bfloat16)
                      for width in slices),
                slices)
            for tokens in args.tokens:
                x = torch.empty(tokens, k, dtype=torch.bfloat16)
                batch = AdapterBatch.from_token_mapping(
                    torch.arange(tokens, dtype=torch.int32) % slots, slots)
                one_slot = _tiling.one_slot(batch)  # both kernels' lookups, as fused._linear's
                k1 = config("quantize_shrink", tokens, n, k, rank, slices, one_slot=one_slot)
                k2 = config("lora_gemm", tokens, n, k, rank, slices, one_slot=one_slot)
                if args.in_flight:
                    k2 = _tiling.in_flight(k2)
                # (path, K1, K2, the kernels reported): the launchers' choices, the decode
                # path's at every count (beyond 32 tokens its K1 has settings of its own where a
                # decode_shrink bucket covers the batch: launch.select_config), or candidates.
                launches = [("fused", k1, k2, ("K1", "K2")),
                            ("decode", config("decode_shrink", tokens, n, k, rank, slices,
                                              one_slot=one_slot), k2, ("K1", "K2"))]
                if args.candidates == "k2":
                    launches = [("fused", k1, cfg, ("K2",))
                                for cfg in k2_candidates(tokens, slices, rank)]
                elif args.candidates == "k1":
                    launches = [("fused", cfg, k2, ("K1",))
                                for cfg in k1_candidates(tokens, rank, k)]
                elif args.candidates == "k1-probe":  # dev/large_m_probe.py's K1 tilings
                    launches = [("fused", LaunchConfig(
                        block_m=bm, block_r=br, block_k=bk, split_k=split, num_warps=warps,
                        num_stages=stages, slices_together=bool(together)), k2, ("K1",))
                        for bm, br, bk, split, warps, stages, *together in K1_PROBE_TILES]
                elif args.candidates == "swap":
                    launches = [("decode", None, cfg, ("K2",))
                                for cfg in launch.swap_candidates(k2, n, k, slices, tokens)]
                for path, k1_cfg, k2_cfg, reported in launches:
                    linear = (ek.decode_lora_fp8_linear if path == "decode" else
                              ek.fused_lora_fp8_linear)
                    grids = []
                    calls = record_launches(functools.partial(
                        linear, x, weight, torch.ones(1), lora, batch, k1_config=k1_cfg,
                        k2_config=k2_cfg), grids)
                    # (EPILORA_DELTA_KERNEL: the delta kernel between K1 and K2, reported
                    # beside them)
                    names = ("K1", "K2") if len(calls) == 2 else ("K1", "delta", "K2")
                    for kernel_name, call, grid in zip(names, calls, grids, strict=True):
                        if kernel_name not in reported and not (
                                kernel_name == "delta" and "K2" in reported):
                            continue
                        compiled = compile_launch_full(*call)
                        regs, spills = ptxas_usage(compiled.asm["ptx"])
                        warps = call[2]["num_warps"]
                        per_sm = blocks_per_sm(regs, compiled.metadata.shared, warps)
                        programs = grid[0] * (grid[1] if len(grid) > 1 else 1) * (
                            grid[2] if len(grid) > 2 else 1)
                        row = {"projection": name, "rank": rank, "adapters": slots,
                               "tokens": tokens, "path": path,
                               "kernel": kernel_name, "registers": regs, "spill_bytes": spills,
                               "shared_bytes": compiled.metadata.shared, "warps": warps,
                               "blocks_per_sm": per_sm, "programs": programs,
                               "waves": round(programs / (per_sm * SMS), 2)}
                        if args.candidates:
                            row["config"] = (k1_cfg if kernel_name == "K1" else k2_cfg).__dict__
                        rows.append(row)
                        print(" ".join(f"{key}={value}" for key, value in row.items()),
                              flush=True)
    Path(args.out).write_text(results_text({"tool": "dev/sm90_occupancy.py",
                                            "target": "sm_90a (H200: 132 SMs)"}, rows))


if __name__ == "__main__":
    main()
