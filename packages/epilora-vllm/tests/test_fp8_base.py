"""`inspect_fp8_base` on layers built of vLLM's own quantization keys: what it serves, and the
reason it gives for what it leaves to vLLM (one log line per kind of layer says it)."""

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    kFp8Dynamic128Sym,
    kFp8DynamicTensorSym,
    kFp8DynamicTokenSym,
    kFp8StaticTensorSym,
)

from epilora_vllm.fp8_base import Fp8Base, inspect_fp8_base

CutlassKernel = type("CutlassFP8ScaledMMLinearKernel", (), {})  # vLLM's kernel's name


def _layer(activation_key, n=32, k=64):
    kernel = CutlassKernel()
    kernel.config = SimpleNamespace(activation_quant_key=activation_key)
    kernel.layer_param_names = ("weight", "weight_scale")
    method = type("Fp8LinearMethod", (), {})()
    method.fp8_linear = kernel
    weight = torch.zeros(n, k).to(torch.float8_e4m3fn).t()  # vLLM's column-major view
    return SimpleNamespace(quant_method=method, weight=weight,
                           weight_scale=torch.ones(1, dtype=torch.float32),
                           output_partition_sizes=[n], input_size_per_partition=k)


def test_per_token_dynamic_activations_are_served():
    base = inspect_fp8_base(_layer(kFp8DynamicTokenSym))
    assert isinstance(base, Fp8Base) and (base.out_features, base.in_features) == (32, 64)


@pytest.mark.parametrize("key, reason", [
    (kFp8DynamicTensorSym, "dynamic per-tensor activation scales (Fp8LinearMethod)"),
    (kFp8StaticTensorSym, "static activation scales"),
    (kFp8Dynamic128Sym, "block-quantized"),
])
def test_other_activation_scales_are_left_to_vllm_with_the_reason(key, reason):
    said = inspect_fp8_base(_layer(key))
    assert isinstance(said, str) and reason in said, said
