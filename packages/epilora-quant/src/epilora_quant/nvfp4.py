"""NVFP4 quantization (e2m1 codes, 16-element blocks, e4m3 block scales, fp32 global scale).

Per block of 16 values along the last dim, with g the fp32 *quantization* global scale
(`nvfp4_global_scale(amax) = fl32(2688 * fl32(1 / amax))`: vLLM's `448 * 6 / amax`, a number over
a tensor, which torch computes as the reciprocal times the number; vLLM's
`input_global_scale_inv`):

    s     = fp8_e4m3_rn(clamp(g * (max|x_block| * fp32(1/6)), -448, 448))  # stored block scale
    inv   = 1 / (s * (1 / g))   (REFERENCE)   or   g * r(s)   (TRITON)        # 0 when s == 0
    code  = e2m1_rne(clamp(x * inv, -6, 6))

where r is the GPU's approximate reciprocal (Triton's `g / s`; for e4m3 values of s it equals the
rounded reciprocal). A value dequantizes to `e2m1(code) * (s / g)` (REFERENCE, exact division) or
`e2m1(code) * (s * r(g))` (TRITON). The two arithmetics are vLLM's two emulation paths:
`ref_nvfp4_quant` (the torch reference, used on CPU) and `_nvfp4_quant_dequant_kernel` (the
Triton quant-dequant used on CUDA GPUs without FP4 tensor cores, like the H200). vLLM's CUDA
`scaled_fp4_quant` (approximate reciprocals; Blackwell only) is not reproduced. e2m1 rounding is
round-half-to-even on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}; a negative value that rounds to zero
keeps its sign (code 0x8), +-0.0 inputs give code 0x0.
"""

import enum

import torch

from epilora_quant._checks import check_divisible, check_float_input, check_scale
from epilora_quant.formats import (
    E2M1_MAX,
    E2M1_MAX_RECIPROCAL,
    FP8_DTYPE,
    FP8_MAX,
    NVFP4_BLOCK_SIZE,
)
from epilora_quant.gpu_reciprocal import triton_divide_sm90
from epilora_quant.nvfp4_layout import (
    decode_e2m1,
    pack_e2m1,
    swizzle_nvfp4_scales,
    unpack_e2m1,
    unswizzle_nvfp4_scales,
)


class NvFp4Arithmetic(enum.Enum):
    """Which of vLLM's NVFP4 quantization implementations to reproduce."""

    REFERENCE = "reference"  # nvfp4_emulation_utils' torch code (ref_nvfp4_quant, ...)
    TRITON = "triton"  # nvfp4_emulation_utils' Triton kernels, as they run on an H200


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The quantization global scale 448 * 6 / amax (fp32) for a tensor whose max |x| is amax."""
    amax = amax.to(torch.float32)
    check_scale("amax", amax, numel=1)
    return (FP8_MAX * E2M1_MAX) / amax.reshape(1)


def _safe_reciprocal(t: torch.Tensor) -> torch.Tensor:
    # vLLM's get_reciprocal: 1 / (t + (t == 0) * 1e8), a reciprocal that maps 0 to 1e-8.
    return 1.0 / (t + (t == 0) * 1e8)


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of values in [-6, 6], round half to even (vLLM's `cast_to_fp4` thresholds)."""
    a = v.abs()
    magnitude = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    return magnitude | ((v < 0).to(torch.uint8) << 3)


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    swizzle: bool = True,
    arithmetic: NvFp4Arithmetic = NvFp4Arithmetic.REFERENCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `[M, K]` to NVFP4 in vLLM's storage layout (the outputs of `scaled_fp4_quant`).

    Args:
        x: `[M, K]` bf16, fp16 or fp32, K a multiple of 16, all finite.
        global_scale: one-element fp32 quantization global scale (`nvfp4_global_scale`).
        swizzle: store the block scales in the swizzled 128x4-tile layout (padded) rather than
            linearly as `[M, K/16]`.
        arithmetic: which vLLM implementation to reproduce.

    Returns:
        `(packed [M, K/2] uint8, block_scales float8_e4m3fn)`.
    """
    check_float_input("x", x)
    check_scale("global_scale", global_scale, numel=1)
    check_divisible("x.shape[-1]", x.shape[-1], NVFP4_BLOCK_SIZE)
    m, k = x.shape
    g = global_scale.reshape(1).to(x.device)
    blocks = x.reshape(m, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    block_max = blocks.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (g * (block_max * E2M1_MAX_RECIPROCAL)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    s = scale.to(torch.float32)
    if arithmetic is NvFp4Arithmetic.REFERENCE:
        inverse = _safe_reciprocal(s * _safe_reciprocal(g))
    else:
        safe = torch.where(s == 0, torch.ones_like(s), s)
        inverse = torch.where(s == 0, torch.zeros_like(s), triton_divide_sm90(g.expand_as(s), safe))
    scaled = (blocks.to(torch.float32) * inverse).clamp(-E2M1_MAX, E2M1_MAX)
    packed = pack_e2m1(_round_e2m1(scaled).reshape(m, k))
    block_scales = scale.reshape(m, k // NVFP4_BLOCK_SIZE)
    return packed, (swizzle_nvfp4_scales(block_scales) if swizzle else block_scales)


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    global_scale: torch.Tensor | None = None,
    weight_scale_2: torch.Tensor | None = None,
    swizzled: bool = True,
    arithmetic: NvFp4Arithmetic = NvFp4Arithmetic.REFERENCE,
) -> torch.Tensor:
    """Dequantize NVFP4 to `dtype`, in one of vLLM's two conventions (give exactly one scale).

    * `global_scale` (the quantization-side g), as activations are quantize-dequantized:
      REFERENCE `e2m1 * (s / g)` (`ref_nvfp4_quant_dequant`'s torch code); TRITON
      `e2m1 * (s * r(g))` (`_nvfp4_quant_dequant_kernel`, r the GPU's approximate reciprocal).
    * `weight_scale_2` (the dequantization-side scale a ModelOpt checkpoint stores, ~ 1/g), as
      weights are dequantized: `e2m1 * (s * weight_scale_2)` (`dequantize_to_dtype`); with
      TRITON (its `_dequantize_nvfp4_kernel`, used for linear scales on a GPU) code 0x8 gives
      +0.0 where the torch code gives -0.0.

    Args:
        packed: `[M, K/2]` uint8 codes.
        block_scales: e4m3 block scales, swizzled (padded) or linear `[M, K/16]`.
        dtype: output dtype.
        global_scale: one-element fp32 quantization global scale.
        weight_scale_2: one-element fp32 dequantization global scale.
        swizzled: whether `block_scales` are in the swizzled layout.
        arithmetic: which vLLM implementation to reproduce.
    """
    if (global_scale is None) == (weight_scale_2 is None):
        raise ValueError("give exactly one of global_scale and weight_scale_2")
    codes = unpack_e2m1(packed)
    m, k = codes.shape
    check_divisible("K", k, NVFP4_BLOCK_SIZE)
    if block_scales.dtype != FP8_DTYPE:
        raise TypeError(f"block_scales.dtype must be {FP8_DTYPE}, got {block_scales.dtype}")
    if swizzled:
        block_scales = unswizzle_nvfp4_scales(block_scales, m, k // NVFP4_BLOCK_SIZE)
    elif tuple(block_scales.shape) != (m, k // NVFP4_BLOCK_SIZE):
        raise ValueError(
            f"linear block_scales must have shape {(m, k // NVFP4_BLOCK_SIZE)}, "
            f"got {tuple(block_scales.shape)}"
        )
    s = block_scales.to(torch.float32)
    triton = arithmetic is NvFp4Arithmetic.TRITON
    if global_scale is not None:
        check_scale("global_scale", global_scale, numel=1)
        g = global_scale.reshape(1).to(s.device).expand_as(s)
        factor = (triton_divide_sm90(s, g) if triton else s / g).unsqueeze(-1)
    else:
        check_scale("weight_scale_2", weight_scale_2, numel=1)
        factor = (s * weight_scale_2.reshape(1).to(s.device)).unsqueeze(-1)
        if triton:  # the Triton kernel negates a zero magnitude to +0.0
            codes = torch.where(codes == 0x8, torch.zeros_like(codes), codes)
    values = decode_e2m1(codes).reshape(m, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    return (values * factor).reshape(m, k).to(dtype)
