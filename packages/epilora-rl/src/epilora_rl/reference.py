"""Torch references of the training linear's kernels (`epilora_rl.kernels`), same signatures.

The arithmetic is the matched engine's (epilora-kernels' W8A16 path): FP8 weight codes widened
exactly, activations in their own dtype, sums in fp32, one rounding to the output dtype at the
end. With float64 operands everything stays float64 and nothing is rounded, so
`torch.autograd.gradcheck` can check the backward's formulas through these functions.
"""

import torch


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def w8a16_lora_forward(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """`[T, N]` in x's dtype: `weight_scale * (x @ W^T) + round(x @ A^T) @ B^T`, rounded once.

    x `[T, K]`; weight `[N, K]` float8_e4m3fn codes; weight_scale fp32, one value or one per
    output channel; lora_a `[r, K]`, lora_b `[N, r]` in x's dtype, B with alpha / r folded in
    (as vLLM folds it when it loads an adapter). `round`: h to x's dtype, as the engine's K2
    reads the shrink's output (nothing for float64)."""
    acc = _acc(x)
    base = (x.to(acc) @ weight.to(acc).T) * _scale_row(weight_scale, acc)
    h = (x.to(acc) @ lora_a.to(acc).T).to(x.dtype)
    return (base + h.to(acc) @ lora_b.to(acc).T).to(x.dtype)


def w8a16_lora_grad_input(grad_out: torch.Tensor, weight: torch.Tensor,
                          weight_scale: torch.Tensor, grad_h: torch.Tensor,
                          lora_a: torch.Tensor) -> torch.Tensor:
    """`[T, K]` in grad_out's dtype: `(grad_out * weight_scale) @ W + grad_h @ A`, rounded once:
    the input's gradient through the frozen FP8 weight (never widened into a copy) and the
    adapter's down-projection. grad_h `[T, r]` (fp32, or float64): grad_out @ B."""
    acc = _acc(grad_out)
    base = (grad_out.to(acc) * _scale_row(weight_scale, acc)) @ weight.to(acc)
    return (base + grad_h.to(acc) @ lora_a.to(acc)).to(grad_out.dtype)


def _scale_row(weight_scale: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    # One scale, or one per output channel as a row that broadcasts over tokens.
    return weight_scale.to(acc).reshape(1, -1)
