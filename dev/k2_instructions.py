"""Write the sm_90 instruction stream of K2 as each fused launcher compiles it (one slot and four
slots; and in 64-row tiles at rank 128, the rank-step epilogues), and of K1 and K2 as the decode
path launches them on the model's shapes (no GPU needed, TRITON_INTERPRET unset), normalized so
that two checkouts compare equal when they emit the same instructions: debug lines, register
declarations and numbers, labels and DWARF data are dropped.

    python dev/k2_instructions.py OUT.json
    git worktree add /tmp/old REV && PYTHONPATH=/tmp/old/packages/epilora-kernels/src \
        python dev/k2_instructions.py OLD.json   # REV's kernels, this checkout's compiler harness

The merge of two layer runs (993031f and 752257b, tools/merge_layer_results.py) rested on it:
both emit the same one-slot K2. The decode entries showed K1 at da578d8 equal to 993031f's
(the unrolled quantizer of 1861f49-0eec973 was not), and K2 differing only by a few reordered
instructions and dropped additions of zero to h.
"""

import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def normalize(ptx: str) -> list[str]:
    out = []
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()
        if not line or line.startswith((".loc", ".reg", ".file", ".b8", ".b32", ".b64",
                                        ".section", "$L__")):
            continue
        out.append(re.sub(r"%(r|rd|p|f|rs|hh|h)\d+", r"%\1", line))
    return out


def main(out_path: str) -> None:
    sys.path.insert(0, str(ROOT / "packages/epilora-kernels/tests"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from layer import PROJECTIONS  # the benchmarks' Qwen3-8B shapes

    import epilora_kernels as ek

    from aot_launchers_sm90 import compile_launch, record_launches
    from kernel_cases import make_problem

    out = {}
    for name, slots, mapping in (("one-slot", 1, "one_adapter"),
                                 ("four-slots", 4, "mixed_with_base")):
        x, weight, w_scale, lora, batch = make_problem(0, 5, 256, (64, 32, 32), 16, slots,
                                                       mapping)
        for label, launch in (
                ("fused", ek.fused_lora_fp8_linear), ("decode", ek.decode_lora_fp8_linear),
                ("w8a16", ek.fused_lora_w8a16_linear)):
            calls = record_launches(functools.partial(launch, x, weight, w_scale, lora, batch))
            out[f"{name}-{label}"] = normalize(compile_launch(*calls[-1]))
    # K2's prefill epilogues at rank 128 in 64-row tiles, where B does not fit in registers:
    # rank steps with one slot and with several (_tiling.epilogue_rank_chunk).
    prefill = ek.LaunchConfig(block_m=64, block_n=64, block_k=64, block_r=128)
    for name, slots, mapping in (("one-slot", 1, "one_adapter"),
                                 ("four-slots", 4, "mixed_with_base")):
        x, weight, w_scale, lora, batch = make_problem(0, 70, 256, (128, 128), 128, slots,
                                                       mapping)
        calls = record_launches(functools.partial(
            ek.fused_lora_fp8_linear, x, weight, w_scale, lora, batch, k2_config=prefill))
        out[f"{name}-prefill-r128-steps"] = normalize(compile_launch(*calls[-1]))
    # Both kernels of the decode path on the model's shapes with one adapter, as the decode
    # benchmark launches them (the shipped table's settings do not depend on the machine here:
    # the launchers pick the heuristic without a GPU, so these are the heuristic's launches).
    for proj in ("qkv", "gate_up", "down"):
        k, slices = PROJECTIONS[proj]
        for tokens in (1, 16):
            for rank in (16, 64, 128):
                x, weight, w_scale, lora, batch = make_problem(0, tokens, k, slices, rank, 1,
                                                               "one_adapter")
                calls = record_launches(functools.partial(
                    ek.decode_lora_fp8_linear, x, weight, w_scale, lora, batch))
                for i, call in enumerate(calls, start=1):
                    out[f"decode-{proj}-T{tokens}-r{rank}-K{i}"] = normalize(compile_launch(*call))
    Path(out_path).write_text(json.dumps(out, indent=0))


if __name__ == "__main__":
    main(sys.argv[1])
