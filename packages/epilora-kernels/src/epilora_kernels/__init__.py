"""epilora-kernels: Triton kernels for multi-adapter LoRA on FP8 bases.

One call for an engine, `lora_linear(x, weight, weight_scale, lora, batch)`: a projection's
`x W^T` with an FP8 weight plus every token's LoRA adapter, on the path it picks (`decode`,
`fused`, `hybrid`, or `w8a16` when asked). The paths are here for callers that choose
(`decode_lora_fp8_linear`, ...), with their kernels (`quantize_and_shrink` = K1,
`lora_fp8_gemm` = K2, ...) and torch twins in `epilora_kernels.reference` (the same tensor
arguments, no launch ones).
`LoraProjection(weight, weight_scale, lora)` binds a projection's weight and adapters once, for
an engine's calls (`projection(x, batch)`: the same result, with a fraction of the host time).
`L2Prefetch(tensor, max_bytes)` (tensor: the next projection's weight), given to a decode-path
call or a projection, has its GEMM pull that weight into L2 (at layer level on the H200: no gain).
`supports(path, ...)` says whether a case can be served and why not; `Workspace` holds the
counters the kernels synchronize with (own one per stream, sized before CUDA-graph capture);
`with compile_only(): ...` compiles what the calls inside would launch, running nothing (an
engine's warm-up before it captures graphs).
`epilora_kernels.ops` registers the paths as torch custom ops when imported.

This package imports neither vLLM nor epilora-vllm. Importing it imports neither Triton nor
the kernels: each public name is loaded from its module on first use (`_PUBLIC`).
"""

from typing import TYPE_CHECKING

# Each public name and the module that defines it, imported on first access (PEP 562).
_PUBLIC = {
    "epilora_kernels._launchers": ("compile_only",),
    "epilora_kernels.arch": ("DeviceSupport", "UnsupportedError", "device_support"),
    "epilora_kernels.batch": ("AdapterBatch", "LoraWeights"),
    "epilora_kernels.dispatch": ("PATHS", "Support", "choose_path", "hybrid_lora_fp8_linear",
                                 "lora_linear", "supports", "supports_shape",
                                 "vendor_fp8_gemm"),
    "epilora_kernels.fused": ("decode_lora_fp8_linear", "fp8_gemm", "fp8_gemm_from_bf16",
                              "fused_lora_fp8_linear", "fused_lora_w8a16_linear",
                              "lora_expand", "lora_fp8_gemm", "lora_shrink", "lora_w8a16_gemm",
                              "quantize", "quantize_and_shrink", "w8a16_gemm"),
    "epilora_kernels.launch": ("LaunchConfig",),
    "epilora_kernels.prefetch": ("L2Prefetch",),
    "epilora_kernels.projection": ("LoraProjection",),
    "epilora_kernels.workspace": ("Workspace", "WorkspaceTooSmall", "default_workspace",
                                  "set_default_workspace"),
}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = [
    "AdapterBatch",
    "DeviceSupport",
    "L2Prefetch",
    "LaunchConfig",
    "LoraProjection",
    "LoraWeights",
    "PATHS",
    "Support",
    "UnsupportedError",
    "Workspace",
    "WorkspaceTooSmall",
    "choose_path",
    "compile_only",
    "decode_lora_fp8_linear",
    "default_workspace",
    "device_support",
    "fp8_gemm",
    "fp8_gemm_from_bf16",
    "fused_lora_fp8_linear",
    "fused_lora_w8a16_linear",
    "hybrid_lora_fp8_linear",
    "lora_expand",
    "lora_fp8_gemm",
    "lora_linear",
    "lora_shrink",
    "lora_w8a16_gemm",
    "quantize",
    "quantize_and_shrink",
    "set_default_workspace",
    "supports",
    "supports_shape",
    "vendor_fp8_gemm",
    "w8a16_gemm",
]

if TYPE_CHECKING:
    from epilora_kernels._launchers import compile_only
    from epilora_kernels.arch import DeviceSupport, UnsupportedError, device_support
    from epilora_kernels.batch import AdapterBatch, LoraWeights
    from epilora_kernels.dispatch import (
        PATHS,
        Support,
        choose_path,
        hybrid_lora_fp8_linear,
        lora_linear,
        supports,
        supports_shape,
        vendor_fp8_gemm,
    )
    from epilora_kernels.fused import (
        decode_lora_fp8_linear,
        fp8_gemm,
        fp8_gemm_from_bf16,
        fused_lora_fp8_linear,
        fused_lora_w8a16_linear,
        lora_expand,
        lora_fp8_gemm,
        lora_shrink,
        lora_w8a16_gemm,
        quantize,
        quantize_and_shrink,
        w8a16_gemm,
    )
    from epilora_kernels.launch import LaunchConfig
    from epilora_kernels.prefetch import L2Prefetch
    from epilora_kernels.projection import LoraProjection
    from epilora_kernels.workspace import (
        Workspace,
        WorkspaceTooSmall,
        default_workspace,
        set_default_workspace,
    )


def __getattr__(name: str):
    if name == "__version__":  # the version lives in pyproject.toml only
        from importlib.metadata import version

        return version("epilora-kernels")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'epilora_kernels' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
