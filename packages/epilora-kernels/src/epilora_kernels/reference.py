"""Torch references of every kernel, with the kernels' signatures (the kernels' test oracles).

Arithmetic (the contract the kernels keep):

* activations are quantized by epilora-quant (`Fp8Arithmetic.INDUCTOR` on a GPU: vLLM's
  compiled path, bit for bit; the Triton interpreter divides exactly, `TORCH_CPU`);
* the shrink `h = x A^T` takes bf16 operands and accumulates in fp32; split-K partials are summed
  in a fixed order (partial 0 first), so results are deterministic;
* the FP8 GEMM accumulates in fp32 and scales as vLLM's CUTLASS epilogue,
  `x_scale * (w_scale * acc)`, with one weight scale or one per output channel; the W8A16 GEMM
  widens the FP8 weight to bf16 (exact) and multiplies bf16 activations; a projection's bias is
  added to that fp32 result, before any rounding (CUTLASS's epilogue adds it there);
* the up-projection rounds h to bf16 and multiplies by bf16 B in fp32; the FP8 paths and the
  expand round that delta to bf16 and add it to the GEMM's result rounded to bf16, rounding
  the sum, `bf16(bf16(base) + bf16(delta))`, as vLLM's expand adds into its GEMM's bf16 output
  (its `do_expand_kernel`, add_inputs; so that served answers are stock's up to the base's
  own sums); the W8A16 path adds the fp32 delta to the fp32 GEMM result before one rounding
  (the trainer's arithmetic, epilora_rl.reference).
"""

import torch

from epilora_kernels.batch import AdapterBatch, LoraWeights
from epilora_quant import Fp8Arithmetic, quantize_fp8_per_token


def _w_scale(weight_scale: torch.Tensor) -> torch.Tensor:
    """The weight scale as a row to broadcast over `[T, N]`: one value or one per channel."""
    return weight_scale.float().reshape(1, -1)


def _plus_bias(base: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The fp32 GEMM result with the projection's bias (if any) added, in fp32."""
    return base if bias is None else base + bias.float()


def _slot_rows(batch: AdapterBatch) -> list[tuple[int, torch.Tensor]]:
    """(slot, token indices) for every active slot (tokens without adapter left out)."""
    out = []
    ids = batch.lora_ids.tolist()
    start = batch.lora_token_start.tolist()
    for z, slot in enumerate(ids):
        if slot < 0 or start[z + 1] == start[z]:
            continue
        out.append((slot, batch.sorted_token_indices[start[z] : start[z + 1]].long()))
    return out


def lora_shrink(x: torch.Tensor, lora: LoraWeights, batch: AdapterBatch, *,
                x_scales: torch.Tensor | None = None) -> torch.Tensor:
    """h = x A_slot^T per token and slice: `[1, S, T, R]` fp32 (one split-K partial). With
    `x_scales` ([T, 1] fp32), x is per-token FP8 codes: h = x_scales * (codes A_slot^T)."""
    t = x.shape[0]
    h = torch.zeros(1, len(lora.output_slices), t, lora.max_rank, dtype=torch.float32,
                    device=x.device)
    for slot, rows in _slot_rows(batch):
        for s, a in enumerate(lora.lora_a):
            acc = x[rows].float() @ a[slot, 0].float().T
            h[0, s, rows] = acc if x_scales is None else acc * x_scales[rows].float()
    return h


def quantize_and_shrink(
    x: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    arithmetic: Fp8Arithmetic = Fp8Arithmetic.INDUCTOR,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K1: `(codes [T, K] fp8, scales [T, 1] fp32, h [1, S, T, R] fp32)`."""
    codes, scales = quantize_fp8_per_token(x, arithmetic=arithmetic)
    return codes, scales, lora_shrink(x, lora, batch)


def _lora_delta(h: torch.Tensor, lora: LoraWeights, batch: AdapterBatch, t: int) -> torch.Tensor:
    """fp32 `[T, N]`: bf16(sum of partials) @ B_slot^T per slice; zero for tokens without one."""
    total = h.sum(dim=0)  # partial 0 first: torch sums dim 0 in order for these sizes
    delta = torch.zeros(t, lora.out_features, dtype=torch.float32, device=h.device)
    offsets = [0]
    for width in lora.output_slices:
        offsets.append(offsets[-1] + width)
    for slot, rows in _slot_rows(batch):
        for s, b in enumerate(lora.lora_b):
            hs = total[s, rows].to(torch.bfloat16).float()
            delta[rows, offsets[s] : offsets[s + 1]] = hs @ b[slot, 0].float().T
    return delta


def _add_as_vllms_expand(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(base) + bf16(delta)): vLLM's expand adding its bf16 delta to a bf16 output."""
    return (base.to(torch.bfloat16).float() + delta.to(torch.bfloat16).float()).to(torch.bfloat16)


def lora_fp8_gemm(
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    h: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """K2: bf16 `[T, N]` = x_scale * (w_scale * codes @ weight^T) (+ bias) + bf16(h) @ B^T,
    each term rounded to bf16, then their sum (`_add_as_vllms_expand`)."""
    acc = codes.float() @ weight.float().T
    base = _plus_bias(scales.float() * (_w_scale(weight_scale) * acc), bias)
    return _add_as_vllms_expand(base, _lora_delta(h, lora, batch, codes.shape[0]))


def lora_w8a16_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    h: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """K2, W8A16: bf16 `[T, N]` = w_scale * (x @ bf16(weight)^T) (+ bias) + bf16(h) @ B^T,
    rounded once."""
    acc = x.float() @ weight.to(torch.bfloat16).float().T
    base = _plus_bias(_w_scale(weight_scale) * acc, bias)
    return (base + _lora_delta(h, lora, batch, x.shape[0])).to(torch.bfloat16)


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora: LoraWeights, batch: AdapterBatch):
    """Hybrid path: y (a vendor GEMM's bf16 output) += bf16(bf16(h) @ B^T), in place; returns
    y."""
    y.copy_(_add_as_vllms_expand(y, _lora_delta(h, lora, batch, y.shape[0])))
    return y


def fused_lora_fp8_linear(
    x: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    arithmetic: Fp8Arithmetic = Fp8Arithmetic.INDUCTOR,
    x_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused path: K1 then K2 (with `x_quantized`, the caller's codes and scales: the shrink
    alone, of x, or of the codes where x is None, then K2 on them)."""
    if x_quantized is not None:
        codes, scales = x_quantized
        h = (lora_shrink(codes, lora, batch, x_scales=scales) if x is None
             else lora_shrink(x, lora, batch))
        return lora_fp8_gemm(codes, scales, weight, weight_scale, h, lora, batch, bias=bias)
    if x is None:
        raise ValueError("x is None: give x_quantized, the codes the shrink and the GEMM read")
    codes, scales, h = quantize_and_shrink(x, lora, batch, arithmetic=arithmetic)
    return lora_fp8_gemm(codes, scales, weight, weight_scale, h, lora, batch, bias=bias)


def fused_lora_w8a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The matched engine's path: shrink, then the W8A16 GEMM with the up-projection."""
    return lora_w8a16_gemm(x, weight, weight_scale, lora_shrink(x, lora, batch), lora, batch,
                           bias=bias)


def decode_lora_fp8_linear(
    x: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    lora: LoraWeights,
    batch: AdapterBatch,
    *,
    arithmetic: Fp8Arithmetic = Fp8Arithmetic.INDUCTOR,
    x_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode path computes what the fused path computes."""
    return fused_lora_fp8_linear(x, weight, weight_scale, lora, batch, arithmetic=arithmetic,
                                 x_quantized=x_quantized, bias=bias)


def quantize(
    x: torch.Tensor, *, arithmetic: Fp8Arithmetic = Fp8Arithmetic.INDUCTOR
) -> tuple[torch.Tensor, torch.Tensor]:
    """K1's quantization alone: per-token FP8 `(codes, scales)`."""
    return quantize_fp8_per_token(x, arithmetic=arithmetic)


def fp8_gemm(
    codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    *, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """K2 without adapters: bf16 `[T, N]` = x_scale * (w_scale * codes @ weight^T) (+ bias)."""
    acc = codes.float() @ weight.float().T
    return _plus_bias(scales.float() * (_w_scale(weight_scale) * acc), bias).to(torch.bfloat16)


def w8a16_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A16 K2 without adapters: bf16 `[T, N]` = w_scale * (x @ bf16(weight)^T) (+ bias),
    rounded once."""
    acc = x.float() @ weight.to(torch.bfloat16).float().T
    return _plus_bias(_w_scale(weight_scale) * acc, bias).to(torch.bfloat16)


def fp8_gemm_from_bf16(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    arithmetic: Fp8Arithmetic = Fp8Arithmetic.INDUCTOR,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fp8_gemm` after quantizing x as K1 does."""
    codes, scales = quantize_fp8_per_token(x, arithmetic=arithmetic)
    return fp8_gemm(codes, scales, weight, weight_scale, bias=bias)
