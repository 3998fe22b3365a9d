"""epilora-quant's FP8 quantizers equal vLLM's own Python implementations, bit for bit (CPU).

The oracles are vLLM 0.26.0's `QuantFP8.forward_native` (per token, per tensor, per group),
and `per_block_cast_to_fp8` (online block-FP8 weights), run on the CPU: so the mode under test
is `Fp8Arithmetic.TORCH_CPU`. The GPU modes (INDUCTOR, TORCH_CUDA, CUDA_KERNEL) are checked
against vLLM on the H200 (tests/gpu/).
"""

import pytest
import torch
from hypothesis import given

from epilora_quant import (
    Fp8Arithmetic,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
    quantize_fp8_weight_per_block,
    requantize_fp8_to_max_scale,
)
from epilora_testing import assert_bitwise_equal
from epilora_testing import vllm_oracles as vllm
from epilora_testing.corpora import special_activations
from epilora_testing.strategies import FLOAT_DTYPES, activations, positive_fp32_scales

pytestmark = pytest.mark.vllm
CPU = Fp8Arithmetic.TORCH_CPU


def assert_same_quant(got, want, x):
    assert_bitwise_equal(got[0], want[0], name="codes", inputs=x)
    assert_bitwise_equal(got[1], want[1], name="scale")


@given(x=activations())
def test_per_token_equals_forward_native(x):
    assert_same_quant(
        quantize_fp8_per_token(x, arithmetic=CPU), vllm.quant_fp8_native(x, "token"), x
    )


@given(x=activations(), ub=positive_fp32_scales(-12, 12))
def test_per_token_with_scale_ub_equals_forward_native(x, ub):
    scale_ub = torch.tensor([ub], dtype=torch.float32)
    got = quantize_fp8_per_token(x, scale_ub=scale_ub, arithmetic=CPU)
    assert_same_quant(got, vllm.quant_fp8_native(x, "token", scale_ub=scale_ub), x)


@given(x=activations())
def test_per_tensor_dynamic_equals_forward_native(x):
    assert_same_quant(
        quantize_fp8_per_tensor(x, arithmetic=CPU), vllm.quant_fp8_native(x, "tensor"), x
    )


@given(x=activations(), s=positive_fp32_scales())
def test_per_tensor_static_equals_forward_native(x, s):
    scale = torch.tensor([s], dtype=torch.float32)
    got = quantize_fp8_per_tensor(x, scale, arithmetic=CPU)
    assert_same_quant(got, vllm.quant_fp8_native(x, "tensor", scale=scale), x)


@given(x=activations(col_multiple=128, max_col_blocks=3))
def test_per_token_group_equals_forward_native(x):
    got = quantize_fp8_per_token_group(x, 128, arithmetic=CPU)
    assert_same_quant(got, vllm.quant_fp8_native(x, "128"), x)


@given(w=activations(max_rows=300, col_multiple=16, max_col_blocks=20))
def test_weight_per_block_equals_per_block_cast_to_fp8(w):
    assert_same_quant(
        quantize_fp8_weight_per_block(w, arithmetic=CPU), vllm.per_block_cast_to_fp8(w), w
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(special_activations(torch.float32)))
def test_special_values_equal_forward_native(case, dtype):
    x = special_activations(dtype, rows=5, cols=256)[case]
    assert_same_quant(
        quantize_fp8_per_token(x, arithmetic=CPU), vllm.quant_fp8_native(x, "token"), x
    )
    assert_same_quant(
        quantize_fp8_per_tensor(x, arithmetic=CPU), vllm.quant_fp8_native(x, "tensor"), x
    )
    assert_same_quant(
        quantize_fp8_per_token_group(x, arithmetic=CPU), vllm.quant_fp8_native(x, "128"), x
    )
    assert_same_quant(
        quantize_fp8_weight_per_block(x, arithmetic=CPU), vllm.per_block_cast_to_fp8(x), x
    )


@pytest.mark.parametrize(
    ("a", "b"),
    [(CPU, Fp8Arithmetic.CUDA_KERNEL), (Fp8Arithmetic.TORCH_CUDA, Fp8Arithmetic.INDUCTOR)],
    ids=["torch-cpu~cuda-kernel", "torch-cuda~inductor"],
)
@given(x=activations())
def test_modes_with_the_same_scale_differ_by_at_most_one_code(a, b, x):
    # Same scale arithmetic; x * (1/s) rounded twice, x / s or an approximate 1/s: the codes are
    # at most one e4m3 step apart (same sign unless one of them is zero).
    codes_a, scale_a = quantize_fp8_per_token(x, arithmetic=a)
    codes_b, scale_b = quantize_fp8_per_token(x, arithmetic=b)
    assert_bitwise_equal(scale_a, scale_b, name="scale")
    ia = codes_a.view(torch.uint8).to(torch.int16)
    ib = codes_b.view(torch.uint8).to(torch.int16)
    same_sign = (ia & 0x80) == (ib & 0x80)
    zero = ((ia & 0x7F) == 0) | ((ib & 0x7F) == 0)
    assert bool((same_sign | zero).all())
    assert int(((ia & 0x7F) - (ib & 0x7F)).abs().max()) <= 1


# Every finite e4m3 code but the NaNs, as rows (0x7F and 0xFF are NaN).
_CODES = torch.arange(256, dtype=torch.uint8)
_CODES = _CODES[(_CODES & 0x7F) != 0x7F].view(torch.float8_e4m3fn).reshape(-1, 1)


def _requantize_as_cuda(codes, shard_scales, widths):
    # vLLM's requantize_with_max_scale as CUDA computes it (the GPU test checks the package
    # against vLLM there): `codes.to(fp16) * scale` with a 0-dim fp32 scale on the GPU reads
    # the scale as fp16, in float64 here (exact), rounded to fp16 once; then static per-tensor
    # at the largest scale.
    out, start, top = codes.clone(), 0, shard_scales.max()
    for scale, width in zip(shard_scales, widths, strict=True):
        part = codes[start:start + width].to(torch.float64)
        dequantized = (part * float(scale.to(torch.float16))).to(torch.float16)
        out[start:start + width], _ = quantize_fp8_per_tensor(
            dequantized, top.reshape(1), arithmetic=Fp8Arithmetic.CUDA_KERNEL)
        start += width
    return out, top


@pytest.mark.parametrize("scales", [
    (0x3B1C34F1, 0x3B22FD85),  # code 0x0c of shard 0 became 0x0b with the scale kept fp32
    (0x387FFFFF, 0x3F800000),  # a scale that is an fp16 subnormal
], ids=["near", "subnormal"])
def test_requantization_to_max_scale_gives_cudas_bits_on_the_cpu(scales):
    shard_scales = torch.tensor(scales, dtype=torch.int32).view(torch.float32)
    codes = torch.cat([_CODES, _CODES])
    widths = [len(_CODES), len(_CODES)]
    got = requantize_fp8_to_max_scale(codes, shard_scales, widths)
    assert_same_quant(got, _requantize_as_cuda(codes, shard_scales, widths), codes)


# Scales whose dequantized codes stay finite in fp16 (448 * 2^7 < 65504), down to fp16's
# subnormals and zero.
@given(a=positive_fp32_scales(-26, 7), b=positive_fp32_scales(-26, 7))
def test_requantization_to_max_scale_gives_cudas_bits_for_any_scales(a, b):
    shard_scales = torch.tensor([a, b], dtype=torch.float32)
    codes = torch.cat([_CODES, _CODES])
    widths = [len(_CODES), len(_CODES)]
    got = requantize_fp8_to_max_scale(codes, shard_scales, widths)
    assert_same_quant(got, _requantize_as_cuda(codes, shard_scales, widths), codes)
