"""K1's shared memory compiled for sm_90 without a GPU, against the tuner's model of it (run
as a script, TRITON_INTERPRET unset: see test_compile_sm90.py). The decode path's K1, on bf16
x and on the caller's codes, in 16-, 32- and 64-row tiles of 2-4 stages, one slice a program
or all three, and the tiles that failed to load in the H100 tuner run of e968ccc (256 deep,
rank tiles of 64, beyond the 232,448 bytes: 262,144 to 524,288), one in 8 warps: (the
compile's bytes, `tuner.k1_shared_bytes`) per tile, as JSON (Triton reports the bytes of a
tile beyond the limit; only loading it fails)."""

import functools
import itertools
import json

import torch

import epilora_kernels as ek
from epilora_kernels import tuner
from epilora_kernels.launch import LaunchConfig

from aot_launchers_sm90 import compile_launch_full, record_launches
from kernel_cases import make_problem

TILES = [*itertools.product((16, 64), (2, 4), (False, True)), (32, 3, False), (32, 3, True)]
# (rows, K tile depth, rank tile, stages, slices together, warps) beyond the small tiles above
DEEP_TILES = [(64, 256, 64, 4, False, 4), (64, 256, 64, 4, True, 4), (64, 256, 64, 2, True, 4),
              (16, 256, 64, 4, True, 4), (64, 256, 64, 3, False, 8)]


def main() -> None:
    x, weight, w_scale, lora, batch = make_problem(0, 8, 1024, (256, 128, 128), 64, 1,
                                                   "one_adapter")
    codes = (x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], 1))
    k2 = LaunchConfig(block_m=16, block_n=32, block_k=256, block_r=64, num_stages=3)
    tiles = [(rows, 128, 32, stages, together, 4) for rows, stages, together in TILES]
    out = {}
    for (rows, depth, rank_tile, stages, together, warps), on_codes in itertools.product(
            tiles + DEEP_TILES, (False, True)):
        k1 = LaunchConfig(block_m=rows, block_k=depth, block_r=rank_tile, split_k=2,
                          num_warps=warps, num_stages=stages, slices_together=together)
        call = record_launches(functools.partial(
            ek.decode_lora_fp8_linear, None if on_codes else x, weight, w_scale, lora, batch,
            k1_config=k1, k2_config=k2, x_quantized=codes if on_codes else None))[0]
        compiled = compile_launch_full(*call)
        name = (f"{rows}x{depth}x{rank_tile} {stages} stages {warps} warps"
                f"{' together' if together else ''}{' codes' if on_codes else ''}")
        out[name] = (compiled.metadata.shared, tuner.k1_shared_bytes(k1, 3, on_codes))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
