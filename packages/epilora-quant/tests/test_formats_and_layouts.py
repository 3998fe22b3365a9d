"""Exhaustive checks of the code tables and layouts (no vLLM needed)."""

import struct

import pytest
import torch

from epilora_quant import decode_e2m1, dequantize_fp8, encode_e2m1, pack_e2m1, unpack_e2m1
from epilora_quant.formats import E2M1_GRID, FP8_MAX, FP8_MIN, FP8_MIN_SCALING_FACTOR
from epilora_quant.nvfp4_layout import swizzle_nvfp4_scales, unswizzle_nvfp4_scales
from epilora_testing import assert_bitwise_equal


def test_fp8_constants_are_torch_and_vllm_values():
    # vLLM 0.26.0, model_executor/layers/quantization/input_quant_fp8.py:
    #   _FP8_MIN, _FP8_MAX = get_fp8_min_max()   # torch.finfo(float8_e4m3fn) (not ROCm's fnuz)
    #   _FP8_MIN_SCALING_FACTOR = 1.0 / (_FP8_MAX * 512.0)
    finfo = torch.finfo(torch.float8_e4m3fn)
    assert (FP8_MIN, FP8_MAX) == (finfo.min, finfo.max) == (-448.0, 448.0)
    # 448 * 512 = 7 * 2^15, so the floor is 2^-15 / 7 = 1.001001...b * 2^-18. As a Python float
    # (what vLLM passes to clamp): exponent 1023 - 18 = 0x3ED, mantissa 0x2492492492492 (52 bits
    # of the repeating 001, the next bits 01001... round down).
    assert struct.pack(">d", FP8_MIN_SCALING_FACTOR).hex() == "3ed2492492492492"
    # As float32 (the scale tensors' dtype): exponent 127 - 18 = 109 = 0x6D, mantissa 23 bits
    # 00100100100100100100100, the next bits 1001... round up to ...101 = 0x124925.
    scale = torch.tensor(FP8_MIN_SCALING_FACTOR, dtype=torch.float32)
    assert int(scale.view(torch.int32)) == (0x6D << 23) | 0x124925 == 0x36924925


def test_every_e2m1_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    assert values[:8].tolist() == list(E2M1_GRID)
    assert values[8:].tolist() == [-v for v in E2M1_GRID]
    assert_bitwise_equal(encode_e2m1(values), codes, name="codes")  # -0.0 encodes to 0x8


def test_every_byte_unpacks_and_packs_back():
    packed = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    codes = unpack_e2m1(packed)
    assert_bitwise_equal(codes[:, 0::2], packed & 0xF, name="low nibbles = even elements")
    assert_bitwise_equal(codes[:, 1::2], packed >> 4, name="high nibbles = odd elements")
    assert_bitwise_equal(pack_e2m1(codes), packed, name="repacked")


def test_every_fp8_code_dequantizes_to_its_value():
    codes = torch.arange(256, dtype=torch.uint8)
    finite = torch.isfinite(codes.view(torch.float8_e4m3fn).float())
    codes = codes[finite].reshape(1, -1).view(torch.float8_e4m3fn)
    got = dequantize_fp8(codes, torch.tensor([1.0]))
    assert_bitwise_equal(got, codes.float(), name="dequantized")


def test_block_scales_with_a_partial_edge_dequantize_by_their_own_block():
    # 200 rows in 128-row blocks: a whole block and a partial one, scales [2, 2]. Read as whole
    # 100-row blocks they would scale rows 100-127 by the second block's scale.
    from epilora_quant import quantize_fp8_weight_per_block

    w = torch.ones(200, 256)
    w[128:] = 100.0
    codes, scales = quantize_fp8_weight_per_block(w)
    assert scales.shape == (2, 2)
    got = dequantize_fp8(codes, scales, block=(128, 128))
    # Each block's one code times its own scale: one value a block, near w's.
    assert_bitwise_equal(got[:128], torch.full((128, 256), float(got[0, 0])), name="block 0")
    assert_bitwise_equal(got[128:], torch.full((72, 256), float(got[128, 0])), name="block 1")
    assert abs(float(got[0, 0]) - 1.0) < 1e-6 and abs(float(got[128, 0]) - 100.0) < 1e-4
    with pytest.raises(ValueError, match="pass block="):
        dequantize_fp8(codes, scales)  # both readings fit: refused, not guessed
    with pytest.raises(ValueError, match=r"is not \(2, 4\)"):
        dequantize_fp8(codes, scales, block=(128, 64))


def test_swizzle_matches_the_documented_byte_offset():
    # offset(row, col) = ((row // 128) * col_tiles + col // 4) * 512 + (row % 32) * 16
    #                    + ((row // 32) % 4) * 4 + col % 4
    rows, cols = 200, 9
    codes = torch.arange(rows * cols, dtype=torch.int32) % 126 + 1
    scales = codes.to(torch.uint8).view(torch.float8_e4m3fn).reshape(rows, cols)
    flat = swizzle_nvfp4_scales(scales).view(torch.uint8).flatten()
    col_tiles = -(-cols // 4)
    for r in range(rows):
        for c in range(cols):
            offset = ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4
            assert int(flat[offset + c % 4]) == int(scales[r, c].view(torch.uint8))
    assert_bitwise_equal(unswizzle_nvfp4_scales(swizzle_nvfp4_scales(scales), rows, cols), scales)
