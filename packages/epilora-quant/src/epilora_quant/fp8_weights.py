"""FP8 weight quantization, bit for bit as vLLM 0.26.0 does it when it loads a model.

Online (a bf16 checkpoint served with `quantization=...`; `online/fp8.py`):

* `"fp8"` / `"fp8_per_tensor"`: one scale over the whole, already fused weight (all of QKV, all of
  gate_up): vLLM's dynamic per-tensor CUDA kernel, scale = max|W| / 448 without a floor.
* `"fp8_per_channel"`: one scale per output row: the per-token CUDA kernel on W (it divides).
* `"fp8_per_block"`: 128 x 128 blocks, `per_block_cast_to_fp8`: amax floored at 1e-4,
  scale = amax / 448, codes = fp8(W * (1 / scale)) with no clamp.

Serialized FP8 checkpoints (`Fp8LinearMethod`, `process_fp8_weight_*_strategy`): per-channel and
block weights are kept exactly as stored (on CUDA; ROCm's fnuz conversion is out of scope), and
per-tensor weights of a fused layer stored as shards with one scale each are requantized to the
largest shard scale (`requantize_with_max_scale`), which this module reproduces.

Weights are returned as vLLM computes them, `[N, K]` row-major; vLLM then keeps `codes.t()`
(a column-major `[K, N]` view) for CUTLASS, which changes no byte.
"""

import torch

from epilora_quant._checks import check_float_input, check_scale
from epilora_quant.formats import FP8_DTYPE, FP8_WEIGHT_BLOCK
from epilora_quant.fp8 import (
    Fp8Arithmetic,
    divide_by_fp8_max,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
)

# per_block_cast_to_fp8 floors each block's absmax here (not the scale, as the activation paths do).
BLOCK_AMAX_FLOOR = 1e-4


def quantize_fp8_weight_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online `quantization="fp8"`: codes `[N, K]` and one scale `[1]` for the fused weight."""
    return quantize_fp8_per_tensor(w, arithmetic=Fp8Arithmetic.CUDA_KERNEL)


def quantize_fp8_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online `quantization="fp8_per_channel"`: codes `[N, K]`, scales `[N, 1]`."""
    return quantize_fp8_per_token(w, arithmetic=Fp8Arithmetic.CUDA_KERNEL)


def quantize_fp8_weight_per_block(
    w: torch.Tensor,
    block: tuple[int, int] = FP8_WEIGHT_BLOCK,
    *,
    arithmetic: Fp8Arithmetic = Fp8Arithmetic.TORCH_CUDA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online `quantization="fp8_per_block"` (`per_block_cast_to_fp8`, ue8m0 off).

    vLLM runs this torch code where the weights are: on the GPU (`TORCH_CUDA`, the default, where
    amax / 448 is a multiplication by fl32(1/448)) or, on vLLM-CPU, the CPU (`TORCH_CPU`).

    Partial edge blocks are zero-padded, as vLLM does, so N and K need not be multiples of the
    block. Returns codes `[N, K]` and scales `[ceil(N / bn), ceil(K / bk)]` (vLLM's
    `weight_scale_inv`, which despite its name multiplies on dequantization).
    """
    if arithmetic not in (Fp8Arithmetic.TORCH_CPU, Fp8Arithmetic.TORCH_CUDA):
        raise ValueError(f"per-block weight quantization has no {arithmetic} mode")
    check_float_input("w", w)
    bn, bk = block
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be positive, got {block}")
    n, k = w.shape
    n_pad, k_pad = -(-n // bn) * bn, -(-k // bk) * bk
    padded = torch.zeros((n_pad, k_pad), dtype=w.dtype, device=w.device)
    padded[:n, :k] = w
    blocks = padded.view(n_pad // bn, bn, k_pad // bk, bk)
    amax = blocks.abs().to(torch.float32).amax(dim=(1, 3), keepdim=True).clamp(BLOCK_AMAX_FLOOR)
    scale = divide_by_fp8_max(amax, arithmetic)
    # No clamp before the cast: |W| * (1/scale) <= 448 * (1 + 2^-22), which rounds to 448.
    codes = (blocks * (1.0 / scale)).to(FP8_DTYPE)
    return codes.view(n_pad, k_pad)[:n, :k].contiguous(), scale.view(n_pad // bn, k_pad // bk)


def requantize_fp8_to_max_scale(
    codes: torch.Tensor, shard_scales: torch.Tensor, logical_widths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-tensor FP8 checkpoint's fused layer: requantize every shard to the largest scale.

    vLLM (`requantize_with_max_scale`) dequantizes each shard to fp16 (codes widened to fp16,
    times the shard's fp32 scale, rounded to fp16) and quantizes it again with vLLM's static
    per-tensor kernel at `max(shard_scales)`. Zero-width shards are skipped. Only checkpoints
    that store one scale per shard take this path (vLLM skips it when the fused weight came
    with a single scale).

    Args:
        codes: `[N, K]` float8_e4m3fn, the shards stacked along N in `logical_widths` order.
        shard_scales: `[len(logical_widths)]` fp32 scales, finite and > 0.
        logical_widths: output rows of each shard (e.g. q, k, v), summing to N.

    Returns:
        `(codes [N, K] float8_e4m3fn, scale [] float32)`; the input is not modified.
    """
    if codes.dtype != FP8_DTYPE or codes.ndim != 2:
        raise TypeError(f"codes must be 2-D {FP8_DTYPE}, got {codes.dtype} {tuple(codes.shape)}")
    check_scale("shard_scales", shard_scales, numel=len(logical_widths))
    if any(w < 0 for w in logical_widths) or sum(logical_widths) != codes.shape[0]:
        raise ValueError(
            f"logical_widths {logical_widths} must be >= 0 and sum to codes.shape[0]="
            f"{codes.shape[0]}"
        )
    max_scale = shard_scales.max()
    out = codes.clone()
    start = 0
    for idx, width in enumerate(logical_widths):
        if width == 0:
            continue
        end = start + width
        # vLLM's `fp16 codes * 0-dim fp32 scale` on CUDA: the scale is read as fp16 (the
        # iterator's common dtype; only a CPU scalar keeps its fp32 value, which torch's CPU
        # kernel would use), the product of the two fp16 values rounded to fp16 once. Written
        # out so that every device gives CUDA's bits (the product is exact in fp32).
        scale16 = shard_scales[idx].to(torch.float16).to(torch.float32)
        dequantized = (codes[start:end].to(torch.float32) * scale16).to(torch.float16)
        out[start:end], _ = quantize_fp8_per_tensor(
            dequantized, max_scale.reshape(1), arithmetic=Fp8Arithmetic.CUDA_KERNEL
        )
        start = end
    return out, max_scale
