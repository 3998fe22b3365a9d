"""epilora-quant's FP8 quantizers equal vLLM's own Python implementations, bit for bit (CPU).

The oracles are vLLM 0.26.0's `QuantFP8.forward_native` (per token, per tensor, per group),
and `per_block_cast_to_fp8` (online block-FP8 weights). The CUDA arithmetic and the weight
paths that only exist as CUDA ops are checked against vLLM on the H200 (tests/gpu/).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from epilora_quant import (
    Fp8Arithmetic,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
    quantize_fp8_weight_per_block,
)
from epilora_testing import assert_bitwise_equal
from epilora_testing import vllm_oracles as vllm
from epilora_testing.corpora import special_activations
from epilora_testing.strategies import FLOAT_DTYPES, activations, positive_fp32_scales

pytestmark = pytest.mark.vllm


def assert_same_quant(got, want, x):
    assert_bitwise_equal(got[0], want[0], name="codes", inputs=x)
    assert_bitwise_equal(got[1], want[1], name="scale")


@given(x=activations())
def test_per_token_equals_forward_native(x):
    assert_same_quant(quantize_fp8_per_token(x), vllm.quant_fp8_native(x, "token"), x)


@given(x=activations(), ub=positive_fp32_scales(-12, 12))
def test_per_token_with_scale_ub_equals_forward_native(x, ub):
    scale_ub = torch.tensor([ub], dtype=torch.float32)
    got = quantize_fp8_per_token(x, scale_ub=scale_ub)
    assert_same_quant(got, vllm.quant_fp8_native(x, "token", scale_ub=scale_ub), x)


@given(x=activations())
def test_per_tensor_dynamic_equals_forward_native(x):
    assert_same_quant(quantize_fp8_per_tensor(x), vllm.quant_fp8_native(x, "tensor"), x)


@given(x=activations(), s=positive_fp32_scales())
def test_per_tensor_static_equals_forward_native(x, s):
    scale = torch.tensor([s], dtype=torch.float32)
    got = quantize_fp8_per_tensor(x, scale)
    assert_same_quant(got, vllm.quant_fp8_native(x, "tensor", scale=scale), x)


@given(x=activations(col_multiple=128, max_col_blocks=3))
def test_per_token_group_equals_forward_native(x):
    got = quantize_fp8_per_token_group(x, 128)
    assert_same_quant(got, vllm.quant_fp8_native(x, "128"), x)


@given(w=activations(max_rows=300, col_multiple=16, max_col_blocks=20))
def test_weight_per_block_equals_per_block_cast_to_fp8(w):
    assert_same_quant(quantize_fp8_weight_per_block(w), vllm.per_block_cast_to_fp8(w), w)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(special_activations(torch.float32)))
def test_special_values_equal_forward_native(case, dtype):
    x = special_activations(dtype, rows=5, cols=256)[case]
    assert_same_quant(quantize_fp8_per_token(x), vllm.quant_fp8_native(x, "token"), x)
    assert_same_quant(quantize_fp8_per_tensor(x), vllm.quant_fp8_native(x, "tensor"), x)
    assert_same_quant(quantize_fp8_per_token_group(x), vllm.quant_fp8_native(x, "128"), x)
    assert_same_quant(quantize_fp8_weight_per_block(x), vllm.per_block_cast_to_fp8(x), x)


@given(x=activations(), data=st.data())
def test_native_and_cuda_arithmetic_differ_by_at_most_one_code(x, data):
    # Same scales; the codes of x * (1/s) and x / s are at most one e4m3 step apart.
    native_codes, native_scale = quantize_fp8_per_token(x)
    cuda_codes, cuda_scale = quantize_fp8_per_token(x, arithmetic=Fp8Arithmetic.CUDA)
    assert_bitwise_equal(native_scale, cuda_scale, name="scale")
    a = native_codes.view(torch.uint8).to(torch.int16)
    b = cuda_codes.view(torch.uint8).to(torch.int16)
    same_sign = (a & 0x80) == (b & 0x80)
    zero = ((a & 0x7F) == 0) | ((b & 0x7F) == 0)
    assert bool((same_sign | zero).all())
    assert int(((a & 0x7F) - (b & 0x7F)).abs().max()) <= 1
