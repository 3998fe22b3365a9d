"""epilora-quant's NVFP4 quantizer, layouts and dequantizers equal vLLM's, bit for bit (CPU).

Oracles: `ref_nvfp4_quant` (values and block scales), `break_fp4_bytes` (code packing),
`convert_swizzled_to_linear` (scale layout), `dequantize_to_dtype` and `ref_nvfp4_quant_dequant`
(both dequantization conventions; their CPU paths are vLLM's torch code).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from epilora_quant import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from epilora_quant.nvfp4_layout import unswizzle_nvfp4_scales
from epilora_testing import assert_bitwise_equal
from epilora_testing import vllm_oracles as vllm
from epilora_testing.corpora import special_activations
from epilora_testing.strategies import FLOAT_DTYPES, activations, positive_fp32_scales

pytestmark = pytest.mark.vllm


@st.composite
def nvfp4_inputs(draw, max_rows=150):
    """x and a global scale: from x's amax (the usual recipe) or drawn freely."""
    x = draw(activations(max_rows=max_rows))
    if draw(st.booleans()):
        amax = x.abs().amax().float().clamp(min=2.0**-100)
        g = nvfp4_global_scale(amax)
    else:
        g = torch.tensor([draw(positive_fp32_scales(-30, 30))], dtype=torch.float32)
    return x, g


def check_against_reference(x, g):
    packed, scales = quantize_nvfp4(x, g, swizzle=False)
    want_values, want_scales = vllm.ref_nvfp4_quant(x, g)
    assert_bitwise_equal(vllm.break_fp4_bytes(packed), want_values, name="e2m1 values", inputs=x)
    assert_bitwise_equal(scales.float(), want_scales, name="block scales")


@given(inputs=nvfp4_inputs())
def test_quantize_equals_ref_nvfp4_quant(inputs):
    check_against_reference(*inputs)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(special_activations(torch.float32)))
def test_special_values_equal_ref_nvfp4_quant(case, dtype):
    x = special_activations(dtype, rows=3, cols=64)[case]
    for g in (nvfp4_global_scale(x.abs().amax().float().clamp(min=2.0**-100)),
              torch.tensor([1.0]), torch.tensor([3.0e5])):
        check_against_reference(x, g)


@given(inputs=nvfp4_inputs())
def test_swizzled_scales_unswizzle_with_vllm(inputs):
    x, g = inputs
    _, linear = quantize_nvfp4(x, g, swizzle=False)
    _, swizzled = quantize_nvfp4(x, g, swizzle=True)
    m, k = x.shape
    # vLLM's un-swizzle keeps the padded scale columns (it slices columns by k, not k / 16).
    unswizzled = vllm.convert_swizzled_to_linear(swizzled, m, k)[:, : k // 16]
    assert_bitwise_equal(unswizzled, linear, name="scales")
    assert_bitwise_equal(unswizzle_nvfp4_scales(swizzled, m, k // 16), linear, name="scales")
    # The padding is zero (the FP4 GEMM reads it), seen through vLLM's un-swizzle.
    rows_p, cols_p = swizzled.shape
    full = vllm.convert_swizzled_to_linear(swizzled, rows_p, cols_p * 16).view(torch.uint8)
    assert not bool(full[m:].any()) and not bool(full[:, k // 16 :].any())


@given(inputs=nvfp4_inputs(), swizzled=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_dequantize_weight_convention_equals_dequantize_to_dtype(inputs, swizzled, dtype):
    x, g = inputs
    # vLLM's swizzled dequantization only works when K / 16 is a multiple of 4 (it keeps the
    # padded scale columns, see above), which real NVFP4 weights satisfy.
    swizzled = swizzled and x.shape[1] % 64 == 0
    packed, scales = quantize_nvfp4(x, g, swizzle=swizzled)
    scale_2 = (1.0 / g).to(torch.float32)
    got = dequantize_nvfp4(packed, scales, dtype, weight_scale_2=scale_2, swizzled=swizzled)
    want = vllm.dequantize_to_dtype(packed, scales, scale_2, dtype, swizzled=swizzled)
    assert_bitwise_equal(got, want, name="dequantized")


@given(inputs=nvfp4_inputs())
def test_dequantize_activation_convention_equals_ref_quant_dequant(inputs):
    x, g = inputs
    packed, scales = quantize_nvfp4(x, g)
    got = dequantize_nvfp4(packed, scales, x.dtype, global_scale=g)
    assert_bitwise_equal(got, vllm.ref_nvfp4_quant_dequant(x, g), name="quant-dequant", inputs=x)
