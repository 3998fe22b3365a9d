"""Shared inputs for the kernel tests (CPU interpreter and GPU): weights, adapters, batches;
and `run_sm90_script`, the ahead-of-time sm_90 scripts' runner."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
                 rank_used=None, per_channel=False):
    """x, an FP8 weight with its scale (one, or with `per_channel` one per output row `[N]`,
    from rows of different magnitudes), adapters (only `rank_used` rows of each slot nonzero),
    and the batch metadata for `mapping`."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(output_slices)
    x = (torch.randn(t, k, generator=gen) * 2).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * 0.05
    if per_channel:
        w = w * torch.logspace(-2, 2, n, base=2.0)[torch.randperm(n, generator=gen), None]
        w_scale = (w.abs().amax(dim=1) / 448.0).float()
    else:
        w_scale = (w.abs().amax() / 448.0).reshape(1).float()
    weight = (w / w_scale.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
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
    w = weight.double() * w_scale.double().reshape(-1, 1)  # per tensor or per output row
    if w8a16:
        base = x.double() @ w.T
    else:
        base = (codes.double() * scales.double()) @ w.T
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


def exact_codes(seed, t, k, device="cpu"):
    """Integer codes in [-2, 2] and power-of-two scales, `(codes, scales, x)`: x = codes *
    scales is exact in bf16, so a shrink of the codes and one of x form the same fp32 sums."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-2, 3, (t, k), generator=gen).float().to(torch.float8_e4m3fn)
    scales = 2.0 ** torch.randint(-4, 3, (t, 1), generator=gen).float()
    x = (codes.float() * scales).to(torch.bfloat16)
    return codes.to(device), scales.to(device), x.to(device)


def make_integer_problem(seed, t, k, output_slices, rank, max_loras, mapping, device="cpu"):
    """Operands with small integer values, so that every fp32 sum K2 forms is exact and every
    output is an integer below 256 (exact in bf16): K2 must then equal its torch reference bit
    for bit, whatever its tiles, split-K or summation order. Codes, weight, x and B in [-2, 2];
    h in [-2, 2] with every adapter token's h nonzero in each slice; scales 1 and a power of
    two. Returns (x, codes, scales, weight, w_scale, h, lora, batch)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(output_slices)

    def ints(*shape, low=-2, high=3):
        return torch.randint(low, high, shape, generator=gen).float()

    x = ints(t, k).to(torch.bfloat16)
    codes = ints(t, k).to(torch.float8_e4m3fn)
    scales = torch.ones(t, 1)
    weight = ints(n, k).to(torch.float8_e4m3fn)
    w_scale = torch.tensor([0.5])
    lora_a = tuple(ints(max_loras, 1, rank, k).to(torch.bfloat16).to(device)
                   for _ in output_slices)
    lora_b = tuple(ints(max_loras, 1, width, rank, low=1).to(torch.bfloat16).to(device)
                   for width in output_slices)
    lora = LoraWeights(lora_a, lora_b, tuple(output_slices))
    batch = AdapterBatch.from_token_mapping(
        torch.tensor(MAPPINGS[mapping](t, max_loras), dtype=torch.int32, device=device), max_loras)
    h = torch.zeros(1, len(output_slices), t, rank)
    active = batch.token_lora_mapping.cpu() >= 0
    h[0, :, active] = ints(len(output_slices), int(active.sum()), rank, low=1)
    return (x.to(device), codes.to(device), scales.to(device), weight.to(device),
            w_scale.to(device), h.to(device), lora, batch)


def exact_lora_delta(h, lora, batch):
    """fp64 `[T, N]`: each token's h B_slot^T, zero for tokens without an adapter."""
    t = h.shape[2]
    delta = torch.zeros(t, lora.out_features, dtype=torch.float64)
    mapping = batch.token_lora_mapping.cpu().long()
    begin = 0
    for s, width in enumerate(lora.output_slices):
        b = lora.lora_b[s].cpu().double()
        for tok in range(t):
            slot = int(mapping[tok])
            if slot >= 0:
                delta[tok, begin:begin + width] = h[0, s, tok].cpu().double() @ b[slot, 0].T
        begin += width
    return delta


def pad_batch(x, batch, padded_tokens, garbage=1 << 20):
    """x and batch padded to `padded_tokens` rows as vLLM pads a batch to a captured CUDA graph's
    size: the metadata counts only the real tokens, and the padding's slots and sorted indices
    are stale (here out of range, so a kernel that read them would fault or write elsewhere)."""
    t = x.shape[0]
    extra = padded_tokens - t
    x = torch.cat([x, torch.randn(extra, x.shape[1], generator=torch.Generator().manual_seed(1))
                   .to(x.dtype).to(x.device)])
    stale = torch.full((extra,), garbage, dtype=torch.int32, device=x.device)
    return x, AdapterBatch(torch.cat([batch.token_lora_mapping, stale]),
                           torch.cat([batch.sorted_token_indices, stale]), batch.lora_ids,
                           batch.num_tokens_per_lora, batch.lora_token_start)


def vllm_layout_batch(mapping: torch.Tensor, max_loras: int) -> AdapterBatch:
    """The batch as vLLM 0.26's `LoRAKernelMeta.prepare_tensors` lays it out: entries sized for
    every slot (`max_loras + 1`), the active ones first in ascending id (-1 first when present),
    the rest -1 with zero counts and zero starts (not the running end: `lora_token_start` is not
    monotonic past the active entries)."""
    ids = torch.full((max_loras + 1,), -1, dtype=torch.int32)
    counts = torch.zeros(max_loras + 1, dtype=torch.int32)
    start = torch.zeros(max_loras + 2, dtype=torch.int32)
    active, active_counts = torch.unique(mapping.cpu(), sorted=True, return_counts=True)
    ids[: active.numel()] = active
    counts[: active.numel()] = active_counts.to(torch.int32)
    start[1: 1 + active.numel()] = torch.cumsum(active_counts, 0).to(torch.int32)
    order = torch.sort(mapping.cpu(), stable=True).indices.to(torch.int32)
    device = mapping.device
    return AdapterBatch(mapping.to(torch.int32), order.to(device), ids.to(device),
                        counts.to(device), start.to(device))


def check_k2_adds_the_adapters_as_vllms_expand(k2_config, *, seed, tokens, widths, device="cpu",
                                               max_loras=8, mapping="one_token_each"):
    """K2 (FP8), and the hybrid path's expand on K2's GEMM alone, against that GEMM followed by
    vLLM's own expand (its CPU op, `vllm_oracles.lora_expand_cpu`), bit for bit: vLLM rounds
    each delta to bf16 and adds it to its GEMM's bf16 output. Integer operands keep every fp32
    sum exact; per-token scales that are not powers of two make the base inexact in bf16, and h
    up to 80 the delta (sums past 256): one rounding of base + delta, or the fp32 delta added
    to the bf16 base, then differ from vLLM's (checked, else the case proves nothing)."""
    from epilora_kernels import fused, reference
    from epilora_testing import assert_bitwise_equal, vllm_oracles

    _, codes, _, weight, w_scale, h, lora, batch = make_integer_problem(
        seed, tokens, 64, widths, 16, max_loras, mapping, device=device)
    gen = torch.Generator().manual_seed(seed)
    scales = (torch.rand(tokens, 1, generator=gen) + 0.1).to(device)
    h = h * torch.randint(20, 41, h.shape, generator=gen).float().to(device)
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2_config)
    base = fused.fp8_gemm(codes, scales, weight, w_scale, config=k2_config)
    want = vllm_oracles.lora_expand_cpu(base.cpu().clone(), h[0].cpu(),
                                        tuple(b.cpu() for b in lora.lora_b),
                                        batch.token_lora_mapping.cpu())
    assert_bitwise_equal(y.cpu(), want, name="K2 vs its GEMM then vLLM's expand")
    ours = fused.lora_expand(base.clone(), h, lora, batch, config=k2_config)
    assert_bitwise_equal(ours.cpu(), want, name="the hybrid expand vs vLLM's")
    assert_bitwise_equal(reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch)
                         .cpu(), want, name="the reference vs vLLM's")
    delta = exact_lora_delta(h, lora, batch)
    exact_base = (scales * (w_scale * (codes.float() @ weight.float().T))).double().cpu()
    for name, other in (("one rounding", exact_base + delta),
                        ("an fp32 delta", base.double().cpu() + delta)):
        assert not torch.equal(other.to(torch.bfloat16), want), f"{name} gives vLLM's bits too"


def bias_of_halves(n, seed, device="cpu"):
    """A bf16 bias `[n]` of halves in [-59.5, 60.5]: exact in bf16, and beside the integer
    problems' bases every fp32 sum base + bias is exact (an FMA and a multiply then an add
    agree)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-60, 61, (n,), generator=gen) + 0.5).to(torch.bfloat16).to(device)


def check_the_bias_is_added_before_rounding(path, tokens, *, device="cpu", bound=False,
                                            k=64, widths=(32, 16, 16), rank=16):
    """`lora_linear` (or a `LoraProjection` bound once, `bound`) on `path` with a projection's
    bias, bit for bit against the reference: the bias added to the GEMM's fp32 result before
    it is rounded, as vLLM's CUTLASS epilogue adds it. Integer operands with a weight scale of
    16 make bases up to 8192, integers exact in fp32 and many inexact in bf16, and a bias of
    halves keeps base + bias exact in fp32 (an FMA and a multiply then an add agree): adding
    the bias after the rounding then differs (checked, else the case proves nothing)."""
    from epilora_kernels import LoraProjection, lora_linear, reference
    from epilora_testing import assert_bitwise_equal

    x, codes, scales, weight, _, _, lora, batch = make_integer_problem(
        7, tokens, k, widths, rank, 4, "mixed_with_base", device=device)
    w_scale = torch.tensor([16.0], device=device)
    bias = bias_of_halves(lora.out_features, 7, device)
    # The FP8 paths on the caller's codes (exact scales); the W8A16 and hybrid paths on x (the
    # hybrid path's default base GEMM quantizes it and adds the bias: this check is bitwise
    # there under the interpreter only, where that GEMM is ours).
    quantized = None if path in ("w8a16", "hybrid") else (codes, scales)
    if bound:
        y = LoraProjection(weight, w_scale, lora)(x, batch, path=path, x_quantized=quantized,
                                                  bias=bias)
    else:
        y = lora_linear(x, weight, w_scale, lora, batch, path=path, x_quantized=quantized,
                        bias=bias)

    def expected(b):
        if path == "w8a16":
            return reference.fused_lora_w8a16_linear(x, weight, w_scale, lora, batch, bias=b)
        return reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                               x_quantized=quantized, bias=b)

    want = expected(bias)
    assert_bitwise_equal(y, want, name=f"{path} path with a bias, {tokens} tokens")
    after = (expected(None).float() + bias.float()).to(torch.bfloat16)
    assert not torch.equal(after, want), "the bias added after rounding gives its bits too"


def record_k2_early(monkeypatch) -> list:
    """EPILOGUE_EARLY of each K2 launch template made from here on in the test (a list the
    launchers append to; none kept from before, so every K2 launched is made here): whether
    the early epilogue is what ran."""
    from epilora_kernels import _launchers

    made, make = [], _launchers._k2_arguments
    monkeypatch.setattr(_launchers, "_K2_TEMPLATES", {})

    def recording(*args, **kwargs):
        arguments = make(*args, **kwargs)
        made.append(arguments["EPILOGUE_EARLY"])
        return arguments

    monkeypatch.setattr(_launchers, "_k2_arguments", recording)
    return made


def run_sm90_script(name: str):
    """Run tests/NAME (an aot_*_sm90.py script) with Triton's interpreter off, as the scripts
    compile for sm_90 on the CPU; the JSON its last line printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name(name)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=600, cwd=script.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
