"""epilora-quant: vLLM 0.26.0's FP8 and NVFP4 quantization, reproduced bit for bit in pure torch.

This package is the numerics contract of EpiLoRA: every kernel in epilora-kernels is tested
bitwise against it, and it is tested bitwise against vLLM's own functions (CPU) and CUDA ops (H200).
It imports neither Triton nor vLLM and does nothing at import.
"""

from epilora_quant.fp8 import (
    Fp8Arithmetic,
    dequantize_fp8,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
)
from epilora_quant.fp8_weights import (
    quantize_fp8_weight_per_block,
    quantize_fp8_weight_per_channel,
    quantize_fp8_weight_per_tensor,
    requantize_fp8_to_max_scale,
)
from epilora_quant.nvfp4 import (
    NvFp4Arithmetic,
    dequantize_nvfp4,
    nvfp4_global_scale,
    quantize_nvfp4,
)
from epilora_quant.nvfp4_layout import (
    decode_e2m1,
    encode_e2m1,
    pack_e2m1,
    swizzle_nvfp4_scales,
    unpack_e2m1,
    unswizzle_nvfp4_scales,
)

# Bumped whenever any function's output bits change; kernels pin the version they were tested with.
FORMAT_SPEC_VERSION = 1

__all__ = [
    "FORMAT_SPEC_VERSION",
    "Fp8Arithmetic",
    "NvFp4Arithmetic",
    "decode_e2m1",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "encode_e2m1",
    "nvfp4_global_scale",
    "pack_e2m1",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token",
    "quantize_fp8_per_token_group",
    "quantize_fp8_weight_per_block",
    "quantize_fp8_weight_per_channel",
    "quantize_fp8_weight_per_tensor",
    "quantize_nvfp4",
    "requantize_fp8_to_max_scale",
    "swizzle_nvfp4_scales",
    "unpack_e2m1",
    "unswizzle_nvfp4_scales",
]


def __getattr__(name: str):
    if name == "__version__":  # the version lives in pyproject.toml only
        from importlib.metadata import version

        return version("epilora-quant")
    raise AttributeError(f"module 'epilora_quant' has no attribute {name!r}")
