"""Shared inputs for the kernel tests (CPU interpreter and GPU): weights, adapters, batches."""

import torch

from epilora_kernels.batch import AdapterBatch, LoraWeights

MAPPINGS = {
    "no_adapter": lambda t, n_slots: [-1] * t,
    "one_adapter": lambda t, n_slots: [1 % n_slots] * t,
    "mixed_with_base": lambda t, n_slots: [(i % (n_slots + 1)) - 1 for i in range(t)],
    "one_token_each": lambda t, n_slots: [i % n_slots for i in range(t)],
    "reversed_runs": lambda t, n_slots: [(n_slots - 1 - i // 3) % n_slots for i in range(t)],
}


def make_problem(seed, t, k, output_slices, rank, max_loras, mapping, device="cpu",
                 rank_used=None):
    """x, an FP8 weight with its scale, adapters (only `rank_used` rows of each slot nonzero),
    and the batch metadata for `mapping`."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(output_slices)
    x = (torch.randn(t, k, generator=gen) * 2).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * 0.05
    w_scale = (w.abs().amax() / 448.0).reshape(1).float()
    weight = (w / w_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    rank_used = rank if rank_used is None else rank_used
    lora_a, lora_b = [], []
    for width in output_slices:
        a = torch.zeros(max_loras, 1, rank, k)
        b = torch.zeros(max_loras, 1, width, rank)
        a[:, :, :rank_used] = torch.randn(max_loras, 1, rank_used, k, generator=gen) * 0.05
        b[:, :, :, :rank_used] = torch.randn(max_loras, 1, width, rank_used, generator=gen) * 0.05
        lora_a.append(a.to(torch.bfloat16).to(device))
        lora_b.append(b.to(torch.bfloat16).to(device))
    lora = LoraWeights(tuple(lora_a), tuple(lora_b), tuple(output_slices))
    batch = AdapterBatch.from_token_mapping(
        torch.tensor(MAPPINGS[mapping](t, max_loras), dtype=torch.int32, device=device), max_loras)
    return x.to(device), weight.to(device), w_scale.to(device), lora, batch


def fp64_reference(x, weight, w_scale, codes, scales, lora, batch, *, w8a16=False):
    """The exact math in float64: (dequantized GEMM) + x A^T B^T per token's adapter."""
    if w8a16:
        base = x.double() @ (weight.double() * w_scale.double()).T
    else:
        base = (codes.double() * scales.double()) @ (weight.double() * w_scale.double()).T
    mapping = batch.token_lora_mapping.long()
    out = base.clone()
    begin = 0
    for s, width in enumerate(lora.output_slices):
        for tok in range(x.shape[0]):
            slot = int(mapping[tok])
            if slot >= 0:
                h = x[tok].double() @ lora.lora_a[s][slot, 0].double().T
                out[tok, begin:begin + width] += h @ lora.lora_b[s][slot, 0].double().T
        begin += width
    return out


def relative_error(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))
