"""`LaunchConfig.slices_together`: K1's shrink programs each computing every slice's rank tile
from one read of x give the same h, bit for bit on integer-valued operands (exact fp32 sums in
either order), in K1 alone, on the fused path and on the decode path on codes, with tokens
without an adapter, several slots, split K and several rank tiles; with a third or half the
programs (interpreter; test_compile_sm90.py compiles it for sm_90)."""

import dataclasses

import pytest
import torch

import epilora_kernels as ek
from epilora_kernels import _launchers, _tiling, fused
from epilora_kernels.arch import device_support
from epilora_kernels.batch import AdapterBatch, LoraWeights
from epilora_testing import assert_bitwise_equal

from kernel_cases import MAPPINGS


def _integer_problem(seed, tokens, k, slices, rank, slots, mapping):
    # x, A and B small integers (exact in bf16 and FP8), so that every sum is exact in fp32
    gen = torch.Generator().manual_seed(seed)
    n = sum(slices)
    x = torch.randint(-3, 4, (tokens, k), generator=gen).to(torch.bfloat16)
    weight = torch.randint(-4, 5, (n, k), generator=gen).to(torch.float8_e4m3fn)
    w_scale = torch.full((1,), 0.25)
    lora = LoraWeights(
        tuple(torch.randint(-2, 3, (slots, 1, rank, k), generator=gen).to(torch.bfloat16)
              for _ in slices),
        tuple(torch.randint(-2, 3, (slots, 1, w, rank), generator=gen).to(torch.bfloat16)
              for w in slices), tuple(slices))
    batch = AdapterBatch.from_token_mapping(
        torch.tensor(MAPPINGS[mapping](tokens, slots), dtype=torch.int32), slots)
    return x, weight, w_scale, lora, batch


CASES = [  # tokens, slices, rank, slots, mapping, K1's settings
    (5, (32, 16, 16), 16, 1, "one_adapter", dict(block_m=16, block_r=16, block_k=32)),
    (9, (32, 16, 16), 32, 3, "mixed_with_base",
     dict(block_m=16, block_r=16, block_k=32, split_k=2)),
    (7, (32, 32), 32, 4, "one_token_each", dict(block_m=16, block_r=32, block_k=64)),
    (20, (32, 32), 16, 2, "reversed_runs", dict(block_m=16, block_r=16, block_k=32, split_k=3)),
    (4, (48,), 16, 1, "one_adapter", dict(block_m=16, block_r=16, block_k=32)),
]


@pytest.mark.parametrize(("tokens", "slices", "rank", "slots", "mapping", "fields"), CASES)
def test_every_slice_in_one_program_gives_the_same_h_with_fewer_programs(
        tokens, slices, rank, slots, mapping, fields):
    x, _, _, lora, batch = _integer_problem(1, tokens, 128, slices, rank, slots, mapping)
    apart = ek.LaunchConfig(**fields)
    together = dataclasses.replace(apart, slices_together=True)
    want = ek.quantize_and_shrink(x, lora, batch, config=apart)
    got = ek.quantize_and_shrink(x, lora, batch, config=together)
    for name, a, b in zip(("codes", "scales", "h"), got, want, strict=True):
        assert_bitwise_equal(a, b, name=name)
    assert bool((want[2] != 0).any())  # h is not all zeros: the comparison can fail
    programs = [_launchers.k1_grid(tokens, lora, batch, cfg, quantize=True)[0] - tokens
                for cfg in (apart, together)]
    assert programs[1] * len(slices) == programs[0]
    assert _tiling.slices_together(together, lora) == (len(slices) > 1)


@pytest.mark.parametrize(("tokens", "slices", "rank", "slots", "mapping", "fields"), CASES[:4])
def test_the_fused_and_decode_paths_give_the_same_bits_with_either(
        tokens, slices, rank, slots, mapping, fields):
    # The fused path (K2 in 64-row tiles: bf16 h) on x, the decode path on the caller's codes
    # (the shrink reading them, h scaled by each row's scale after its exact sum) and on x.
    x, weight, w_scale, lora, batch = _integer_problem(2, tokens, 128, slices, rank, slots,
                                                       mapping)
    apart = ek.LaunchConfig(**fields)
    together = dataclasses.replace(apart, slices_together=True)
    k2 = ek.LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=max(16, rank))
    fused_ys = [ek.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=cfg,
                                         k2_config=k2) for cfg in (apart, together)]
    assert_bitwise_equal(fused_ys[1], fused_ys[0], name="fused path")
    codes = (x.to(torch.float8_e4m3fn), torch.linspace(0.5, 2.0, tokens).reshape(tokens, 1))
    decode_ys = [ek.decode_lora_fp8_linear(None, weight, w_scale, lora, batch,
                                           x_quantized=codes, k1_config=cfg)
                 for cfg in (apart, together)]
    assert_bitwise_equal(decode_ys[1], decode_ys[0], name="decode path on codes")
    quantizing = [ek.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=cfg)
                  for cfg in (apart, together)]  # K1 quantizing x beside the shrink
    assert_bitwise_equal(quantizing[1], quantizing[0], name="decode path on x")


def test_the_one_launch_takes_its_shrink_a_slice_a_program():
    # Its shrink programs inside K2 count one slice each (`_shrink_count`): settings asking
    # for every slice in one are served one slice a program.
    x, weight, w_scale, lora, batch = _integer_problem(3, 4, 128, (32, 16, 16), 16, 1,
                                                       "one_adapter")
    given = ek.LaunchConfig(block_m=16, block_r=16, block_k=32, slices_together=True)
    cfg1, _ = fused._settings(device_support(x.device), _launchers.FP8, x, weight, w_scale, lora,
                              batch, given, None, decode=True, quantize=False, pdl=True,
                              counted=False, warm_l2=0, wait_k1_first=False, lead=True)
    assert cfg1 == dataclasses.replace(given, slices_together=False)


def test_the_heuristics_prefill_k1_takes_every_slice_together_with_the_same_bits():
    # `launch.prefill_slices_together`: several slices and a grid that fills 132 SMs (4225
    # tokens in 64-row tiles, two rank tiles, K unsplit: 134 programs together). What the
    # dispatcher's K1 takes by default there gives one slice a program's codes, scales and h.
    tokens, slices = 4225, (32, 16, 16)
    x, _, _, lora, batch = _integer_problem(4, tokens, 128, slices, 64, 1, "one_adapter")
    chosen = _tiling.config(device_support(x.device), "quantize_shrink", tokens, lora, None)
    assert chosen.slices_together and (chosen.block_k, chosen.num_stages) == (64, 4), chosen
    got = ek.quantize_and_shrink(x, lora, batch)
    want = ek.quantize_and_shrink(x, lora, batch,
                                  config=dataclasses.replace(chosen, slices_together=False))
    for name, a, b in zip(("codes", "scales", "h"), got, want, strict=True):
        assert_bitwise_equal(a, b, name=name)
    assert bool((want[2] != 0).any())
