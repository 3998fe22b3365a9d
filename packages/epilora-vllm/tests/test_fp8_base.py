"""`inspect_fp8_base` and `layers.refusal` on layers built of vLLM's own classes and
quantization keys: what they serve, and the reason they give for what they leave to vLLM (one
log line per kind of layer says it); the codes a layer hands its op."""

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


def _merged(slices, k=64):
    # vLLM's merged column class itself (the plugin serves exact classes), this rank's shard.
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear.__new__(MergedColumnParallelLinear)
    torch.nn.Module.__init__(layer)
    fake = _layer(kFp8DynamicTokenSym, n=sum(slices), k=k)
    layer.quant_method, layer.weight, layer.weight_scale = (fake.quant_method, fake.weight,
                                                            fake.weight_scale)
    layer.output_partition_sizes, layer.input_size_per_partition = list(slices), k
    return layer


def test_slices_the_kernels_cannot_tile_are_left_to_vllm():
    # CUTLASS takes any N that is a multiple of 16; a K2 tile must not straddle two slices.
    from vllm.config import VllmConfig, set_current_vllm_config

    from epilora_vllm.layers import refusal

    lora_config = SimpleNamespace(fully_sharded_loras=False, lora_dtype=torch.bfloat16,
                                  max_lora_rank=8)
    with set_current_vllm_config(VllmConfig()):
        assert refusal(_merged([48, 48]), lora_config) is None
        said = refusal(_merged([40, 40]), lora_config)
    assert said is not None and "every slice but the last must be a multiple of 16" in said


def test_codes_padded_by_vllms_kernel_reach_the_op_as_x_has_rows():
    # vLLM's torch FP8 kernels pad the codes and scales to 17 rows outside its compiled mode.
    from epilora_vllm.layers import EpiloraRowParallelLinearWithLoRA

    layer = EpiloraRowParallelLinearWithLoRA.__new__(EpiloraRowParallelLinearWithLoRA)
    seen = []

    def padded(x2):
        rows = max(17, x2.shape[0])
        return (torch.zeros(rows, x2.shape[1]).to(torch.float8_e4m3fn),
                torch.ones(rows, 1, dtype=torch.float32))

    class Forward:  # the layer's EpiloraForward, as the op calls it outside a model step
        mode = SimpleNamespace(shrink_codes=True)
        quantize_on_cpu = staticmethod(padded)

        def __call__(self, x, codes, scales, bias):
            seen.append((codes.shape[0], scales.shape))
            return torch.zeros(codes.shape[0], 48, dtype=torch.bfloat16)

    layer.__dict__.update(output_slices=(48,), epilora=Forward())
    y = layer.apply(torch.zeros(3, 64, dtype=torch.bfloat16))
    assert y.shape == (3, 48) and seen == [(3, torch.Size([3, 1]))]
