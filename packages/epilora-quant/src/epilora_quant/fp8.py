"""FP8 (e4m3fn) activation quantization, bit for bit as vLLM 0.26.0 does it.

vLLM has two implementations of the same quantizer and they do not always agree:

* `Fp8Arithmetic.NATIVE` is `QuantFP8.forward_native`: the scale is computed, inverted with
  `torch.reciprocal`, and the input is multiplied by that reciprocal. vLLM runs this on the CPU
  and, traced by torch.compile into the model's Inductor graph, on the GPU by default
  (`custom_ops` is "none" under compilation), so it is what a served FP8 model computes.
* `Fp8Arithmetic.CUDA` is vLLM's CUDA kernels (`scaled_fp8_quant`), run under `enforce_eager`
  and by the online weight quantizers: the per-token kernel *divides* by the scale, and the
  dynamic per-tensor kernel computes its scale without the 1/(448*512) floor.

x / s and x * (1/s) are both correctly rounded fp32 operations but differ in the last bit for some
inputs, and one bit before the fp8 cast can move a code. docs/formats/fp8.md gives the arithmetic
and counterexamples measured on an H200.

All functions take a 2-D `[tokens, features]` float tensor and return `(codes, scale)` with codes
in `torch.float8_e4m3fn` and scales in float32 with vLLM's shapes: `[M, 1]` per token, `[1]` per
tensor (dynamic) or the given scale (static), `[M, K // group]` per group.
"""

import enum

import torch

from epilora_quant._checks import check_divisible, check_float_input, check_scale
from epilora_quant.formats import FP8_DTYPE, FP8_MAX, FP8_MIN, FP8_MIN_SCALING_FACTOR


class Fp8Arithmetic(enum.Enum):
    """Which of vLLM's FP8 quantization implementations to reproduce."""

    NATIVE = "native"  # QuantFP8.forward_native: x * reciprocal(scale); CPU and compiled GPU
    CUDA = "cuda"  # vLLM's CUDA kernels: per token x / scale; per tensor no scale floor


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    # Clamp first: torch's cast does not saturate (465.0 would become NaN), vLLM's clamp does.
    return scaled.clamp(FP8_MIN, FP8_MAX).to(FP8_DTYPE)


def _row_absmax(x: torch.Tensor) -> torch.Tensor:
    # max |x| in the input dtype is exact; widening to fp32 afterwards is exact too.
    return x.abs().amax(dim=-1, keepdim=True).to(torch.float32)


def quantize_fp8_per_token(
    x: torch.Tensor,
    *,
    scale_ub: torch.Tensor | None = None,
    arithmetic: Fp8Arithmetic = Fp8Arithmetic.NATIVE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 quantization (one scale per row), as vLLM's FP8 linear layers do.

    scale = max(min(max|x_row|, scale_ub) / 448, 1/(448*512)); codes = fp8_rn(clamp(x / scale))
    with the division done as `arithmetic` says.

    Args:
        x: `[M, K]` bf16, fp16 or fp32 activations, all finite.
        scale_ub: optional one-element fp32 upper bound on the row absmax (vLLM's `scale_ub`).
        arithmetic: which vLLM implementation to reproduce.

    Returns:
        `(codes [M, K] float8_e4m3fn, scale [M, 1] float32)`.
    """
    check_float_input("x", x)
    if scale_ub is not None:
        check_scale("scale_ub", scale_ub, numel=1)
    x_max = _row_absmax(x)
    if scale_ub is not None:
        x_max = x_max.clamp(max=scale_ub.reshape(()).to(x_max.device))
    scale = (x_max / FP8_MAX).clamp(min=FP8_MIN_SCALING_FACTOR)
    if arithmetic is Fp8Arithmetic.NATIVE:
        scaled = x.to(torch.float32) * scale.reciprocal()
    else:  # the per-token CUDA kernel divides ("so we can match FBGemm")
        scaled = x.to(torch.float32) / scale
    return _to_fp8(scaled), scale


def quantize_fp8_per_tensor(
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    arithmetic: Fp8Arithmetic = Fp8Arithmetic.NATIVE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 quantization: dynamic when `scale` is None, static otherwise.

    Dynamic NATIVE: scale = max(max|x| / 448, 1/(448*512)). Dynamic CUDA: scale = max|x| / 448,
    with no floor (so a tensor whose max |x| is zero or below ~1.3e-36, where 1/scale overflows,
    cannot be quantized: we raise instead of returning the codes the kernel derives from NaN).
    Both then multiply by the reciprocal of the scale; a
    static scale is used as given.

    Args:
        x: `[M, K]` bf16, fp16 or fp32 tensor, all finite.
        scale: optional one-element fp32 scale (static quantization), finite and > 0.
        arithmetic: which vLLM implementation to reproduce (dynamic case only).

    Returns:
        `(codes [M, K] float8_e4m3fn, scale)`; a dynamic scale has shape `[1]`.
    """
    check_float_input("x", x)
    if scale is None:
        x_max = x.abs().amax().reshape(1).to(torch.float32)
        scale = x_max / FP8_MAX
        if arithmetic is Fp8Arithmetic.NATIVE:
            scale = scale.clamp(min=FP8_MIN_SCALING_FACTOR)
        elif not bool(torch.isfinite(scale.reciprocal()).all()):
            # Without the floor, 1/scale overflows for max|x| < ~1.3e-36 (all zeros included);
            # the kernel then turns zeros into NaN and clamps that to 448: garbage, refused.
            raise ValueError(
                f"x is all zeros or nearly (max |x| = {x_max.item()!r}): vLLM's dynamic "
                "per-tensor CUDA kernel has no scale floor and its 1/scale overflows"
            )
    else:
        check_scale("scale", scale, numel=1)
    scaled = x.to(torch.float32) * scale.to(torch.float32).reciprocal()
    return _to_fp8(scaled), scale


def quantize_fp8_per_token_group(
    x: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization per `1 x group_size` group, as `QuantFP8._quantize_group_native`.

    This is the activation side of block-FP8 models on the CPU (vLLM's CUDA group kernel floors
    the scale with eps=1e-10 instead, and is not reproduced here). K must be a multiple of
    group_size.

    Returns:
        `(codes [M, K] float8_e4m3fn, scale [M, K // group_size] float32)`.
    """
    check_float_input("x", x)
    check_divisible("x.shape[-1]", x.shape[-1], group_size)
    m, k = x.shape
    grouped = x.reshape(m, k // group_size, group_size)
    absmax = grouped.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (absmax / FP8_MAX).clamp(min=FP8_MIN_SCALING_FACTOR)
    codes = _to_fp8(grouped / scale)  # the group path divides, unlike per-token NATIVE
    return codes.reshape(m, k), scale.squeeze(-1)


def dequantize_fp8(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """codes * scale in fp32, cast to `dtype`; scale broadcasts per tensor, row or group/block.

    `scale` may be `[]`/`[1]` (per tensor), `[M, 1]` (per row), or `[M/bm, K/bk]` (blocks of an
    integer shape, which covers 1 x 128 groups and 128 x 128 weight blocks).
    """
    if codes.dtype != FP8_DTYPE:
        raise TypeError(f"codes.dtype must be {FP8_DTYPE}, got {codes.dtype}")
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D, got shape {tuple(codes.shape)}")
    check_scale("scale", scale)
    m, k = codes.shape
    s = scale.to(torch.float32)
    if s.numel() == 1:
        s = s.reshape(1, 1)
    elif s.ndim == 2 and s.shape != (m, 1):
        rows, cols = s.shape
        if m % rows or k % cols:
            raise ValueError(f"scale shape {tuple(s.shape)} does not tile codes {(m, k)}")
        s = s.repeat_interleave(m // rows, dim=0).repeat_interleave(k // cols, dim=1)
    elif s.shape != (m, 1):
        raise ValueError(f"scale shape {tuple(s.shape)} does not broadcast to codes {(m, k)}")
    return (codes.to(torch.float32) * s).to(dtype)
