"""Bad input gets a clear error that names the value, never garbage."""

import pytest
import torch

from epilora_quant import (
    dequantize_fp8,
    dequantize_nvfp4,
    encode_e2m1,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
    quantize_fp8_weight_per_tensor,
    quantize_nvfp4,
    requantize_fp8_to_max_scale,
    unswizzle_nvfp4_scales,
)

X = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
ONE = torch.tensor([1.0])


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: quantize_fp8_per_token(X.to(torch.int32)), TypeError, "dtype"),
        (lambda: quantize_fp8_per_token(X.to(torch.float8_e4m3fn)), TypeError, "dtype"),
        (lambda: quantize_fp8_per_token(X[0]), ValueError, "2-D"),
        (lambda: quantize_fp8_per_token(X.tolist()), TypeError, "torch.Tensor"),
        (lambda: quantize_fp8_per_token(torch.where(X > 1, float("nan"), X)), ValueError,
         "non-finite"),
        (lambda: quantize_fp8_per_token(X, scale_ub=torch.tensor([float("inf")])), ValueError,
         "non-finite"),
        (lambda: quantize_fp8_per_token(X, scale_ub=torch.tensor([1.0, 2.0])), ValueError,
         "1 element"),
        (lambda: quantize_fp8_per_tensor(X, torch.tensor([0.0])), ValueError, "> 0"),
        (lambda: quantize_fp8_per_tensor(X, torch.tensor([1.0], dtype=torch.float64)), TypeError,
         "float32"),
        (lambda: quantize_fp8_weight_per_tensor(torch.zeros(2, 16)), ValueError, "all zeros"),
        (lambda: quantize_fp8_weight_per_tensor(torch.full((2, 16), 1e-38)), ValueError,
         "overflows"),
        (lambda: quantize_fp8_per_token_group(X, 128), ValueError, "divisible"),
        (lambda: quantize_nvfp4(X[:, :24], ONE), ValueError, "divisible by the block size 16"),
        (lambda: quantize_nvfp4(X, torch.tensor([float("nan")])), ValueError, "non-finite"),
        (lambda: dequantize_fp8(X, ONE), TypeError, "float8_e4m3fn"),
        (lambda: dequantize_fp8(X.to(torch.float8_e4m3fn), torch.ones(3, 1)), ValueError,
         "does not tile"),
        (lambda: requantize_fp8_to_max_scale(X.to(torch.float8_e4m3fn), torch.ones(2), [2, 3]),
         ValueError, "sum to"),
        (lambda: unswizzle_nvfp4_scales(torch.zeros(128, 4, dtype=torch.float8_e4m3fn), 129, 2),
         ValueError, "must have shape"),
        (lambda: encode_e2m1(torch.tensor([0.7])), ValueError, "e2m1 grid"),
        (lambda: dequantize_nvfp4(torch.zeros(1, 8, dtype=torch.uint8),
                                  torch.zeros(1, 1, dtype=torch.float8_e4m3fn), swizzled=False),
         ValueError, "exactly one"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_non_finite_error_names_the_first_index():
    x = X.clone()
    x[2, 5] = float("inf")
    with pytest.raises(ValueError, match=r"index \(2, 5\)"):
        quantize_fp8_per_token(x)
