"""K2 (and the hybrid path's expand) bit for bit against its torch reference on integer-valued
operands, where fp32 arithmetic is exact (kernel_cases.make_integer_problem), and each row's
adapter delta (y - y without adapters) checked on its own: a token whose adapter was lost,
applied twice or given another slot's fails, which a norm over the whole output can hide."""

import pytest
import torch

import epilora_kernels as ek
from epilora_kernels import LaunchConfig, _launchers, fused, reference
from epilora_kernels._launchers import FP8, W8A16
from epilora_testing import assert_bitwise_equal

from kernel_cases import (
    bias_of_halves,
    check_k2_adds_the_adapters_as_vllms_expand,
    check_the_bias_is_added_before_rounding,
    exact_lora_delta,
    make_integer_problem,
    make_problem,
    pad_batch,
    record_k2_early,
)

K2_CONFIGS = {
    "decode-tile": LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, num_stages=2),
    "split-k": LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, split_k=2),
    "32-rows": LaunchConfig(block_m=32, block_n=32, block_k=32, block_r=16),
    "prefill-tma": LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=16, num_stages=2),
    "rank-steps": LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=128, num_warps=1),
    # the transposed product (W x^T: wgmma's tiles on sm_90), whole and split, 16 and 32 rows
    "swap-ab": LaunchConfig(block_m=16, block_n=64, block_k=32, block_r=16, swap_ab=True),
    "swap-ab-split": LaunchConfig(block_m=32, block_n=64, block_k=32, block_r=16, split_k=2,
                                  swap_ab=True),
    # several slots' segment loop with slices of B in flight (slots and bounds from vectors):
    # decode tiles, prefill tiles (the delta first) and the rank in steps
    "segments": LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, num_stages=2,
                             segment_stages=4),
    "prefill-segments": LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=16,
                                     num_stages=2, segment_stages=3),
    "rank-steps-segments": LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=128,
                                        num_warps=1, segment_stages=2),
}
SWAPPED = ("swap-ab", "swap-ab-split")
CASES = [  # (tokens, K, slices, rank, max_loras, mapping)
    (5, 64, (32,), 8, 1, "one_adapter"),
    (9, 64, (32, 16, 16), 16, 4, "mixed_with_base"),
    (21, 96, (16, 32), 8, 3, "reversed_runs"),
    (70, 64, (32, 16, 16), 16, 8, "one_token_each"),
    (12, 96, (64, 64, 48), 16, 4, "mixed_with_base"),  # slices whole 64-wide tiles
]


def _check_rows(y, base, h, lora, batch, name):
    # Row by row: y - base is exactly the token's own adapter delta (zero without one).
    got = y.double() - base.double()
    want = exact_lora_delta(h, lora, batch)
    for row in range(y.shape[0]):
        if not torch.equal(got[row].cpu(), want[row]):
            slot = int(batch.token_lora_mapping[row])
            bad = (got[row].cpu() != want[row]).nonzero().flatten()[:4].tolist()
            raise AssertionError(f"{name}: row {row} (slot {slot}) has the wrong adapter "
                                 f"delta at columns {bad}")


# EPILORA_GATHER_SEGMENTS: decode tiles of several slots add each row's adapter from its own
# slot's B, summed in registers over rank steps, instead of an MMA per segment; the settings'
# rank steps 4 (16 x 16 in one warp, 32 x 32 in four), 2 (32 x 64) and 1 (16 x 64 in one warp)
GATHERED = {"decode-tile": LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16,
                                        num_warps=1),
            "32-rows": K2_CONFIGS["32-rows"], "swap-ab-split": K2_CONFIGS["swap-ab-split"],
            "one-warp-wide": LaunchConfig(block_m=16, block_n=64, block_k=32, block_r=16,
                                          num_warps=1)}
GATHER_FITTING = [(case, name) for case in CASES if case[4] > 2 for name, k2 in GATHERED.items()
                  if k2.block_r >= case[3] and not any(w % k2.block_n for w in case[2][:-1])]


@pytest.mark.parametrize(("case", "cfg"), GATHER_FITTING,
                         ids=[f"T{c[0]}-N{sum(c[2])}-{c[5]}-{n}" for c, n in GATHER_FITTING])
def test_k2_gathering_each_rows_adapter_equals_reference_bitwise(case, cfg, monkeypatch):
    from epilora_kernels import _tiling

    monkeypatch.setenv("EPILORA_GATHER_SEGMENTS", "1")
    x, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(0, *case)
    k2 = GATHERED[cfg]
    assert _tiling.gather_segments(k2, batch.num_entries, lora.max_rank) in (1, 2, 4)
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    assert_bitwise_equal(y, reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora,
                                                    batch), name="gathering K2 vs reference")
    _check_rows(y, fused.fp8_gemm(codes, scales, weight, w_scale, config=k2), h, lora, batch,
                "gathering K2")


# Every case with every setting that fits it (rank within the tile, slices whole tiles).
FITTING = [(case, name) for case in CASES for name, k2 in K2_CONFIGS.items()
           if k2.block_r >= case[3] and not any(w % k2.block_n for w in case[2][:-1])]


@pytest.mark.parametrize(("case", "cfg"), FITTING,
                         ids=[f"T{c[0]}-N{sum(c[2])}-{c[5]}-{n}" for c, n in FITTING])
def test_k2_fp8_equals_reference_bitwise_and_every_rows_delta(case, cfg, monkeypatch):
    # The segment loop in every tile, whatever the environment says (the gathering epilogue
    # has its own test above, on these cases' several-slot part)
    monkeypatch.setenv("EPILORA_GATHER_SEGMENTS", "0")
    x, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(0, *case)
    k2 = K2_CONFIGS[cfg]
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    assert_bitwise_equal(y, reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora,
                                                    batch), name="K2 vs reference")
    base = fused.fp8_gemm(codes, scales, weight, w_scale, config=k2)
    assert_bitwise_equal(base, reference.fp8_gemm(codes, scales, weight, w_scale),
                         name="K2 without adapters vs reference")
    _check_rows(y, base, h, lora, batch, "FP8 K2")


# EPILORA_EPILOGUE_HALVES: prefill tiles keep the rounded base in registers and add the delta
# half the tile's columns at a time (one slot: the whole rank or its 32-wide steps; several:
# the segment loop, its slices of B waited for in turn or in flight)
HALVES = {"halves": LaunchConfig(block_m=64, block_n=32, block_k=32, block_r=16, num_stages=2),
          "halves-rank-steps": LaunchConfig(block_m=64, block_n=32, block_k=32, block_r=128,
                                            num_warps=1),
          "halves-128-rows": LaunchConfig(block_m=128, block_n=64, block_k=32, block_r=16),
          "halves-segments": LaunchConfig(block_m=64, block_n=32, block_k=32, block_r=16,
                                          num_stages=2, segment_stages=3),
          # K split: the last split's program sums the partials, then the halves
          "halves-split-k": LaunchConfig(block_m=64, block_n=32, block_k=32, block_r=16,
                                         split_k=2)}
HALVES_CASES = [(5, 64, (32,), 8, 1, "one_adapter"),
                (70, 64, (32, 32, 64), 16, 1, "mixed_with_base"),
                (130, 96, (64, 64), 16, 1, "mixed_with_base"),
                (70, 64, (32, 32, 64), 16, 4, "reversed_runs"),
                (130, 96, (64, 64), 16, 8, "one_token_each"),
                # rank 64 in 32-wide steps: every step carries data
                (70, 64, (32, 32, 64), 64, 1, "mixed_with_base"),
                (70, 64, (64, 64), 64, 4, "reversed_runs")]
HALVES_FITTING = [(case, name) for case in HALVES_CASES for name, k2 in HALVES.items()
                  if k2.block_r >= case[3] and not any(w % k2.block_n for w in case[2][:-1])]


@pytest.mark.parametrize(("case", "cfg"), HALVES_FITTING,
                         ids=[f"T{c[0]}-N{sum(c[2])}-{c[4]}-{c[5]}-{n}" for c, n in HALVES_FITTING])
def test_k2_epilogue_in_halves_equals_reference_and_the_term_parked_in_y(case, cfg, monkeypatch):
    from epilora_kernels import _tiling

    x, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(0, *case)
    k2 = HALVES[cfg]
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "0")
    parked = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "all")
    assert _tiling.epilogue_halves(k2, batch.num_entries, fp8=True)
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    assert_bitwise_equal(y, reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora,
                                                    batch), name="K2 in halves vs reference")
    assert_bitwise_equal(y, parked, name="K2 in halves vs a term parked in y")
    if case[3] <= 16:  # at rank 64 outputs pass 256, inexact in bf16: the reference's bits only
        _check_rows(y, fused.fp8_gemm(codes, scales, weight, w_scale, config=k2), h, lora,
                    batch, "K2 in halves")


# EPILORA_EPILOGUE_EARLY: one slot's halves from h's and B's tiles loaded before the K loop
# (tiles the rule takes: in 4 warps the 128-row one's operands would cost it blocks an SM)
EARLY = {"halves": HALVES["halves"],
         "128-rows": LaunchConfig(block_m=128, block_n=64, block_k=32, block_r=16, num_warps=8),
         "rank-64": LaunchConfig(block_m=64, block_n=32, block_k=32, block_r=64, num_warps=8)}
EARLY_FITTING = [(case, name) for case in HALVES_CASES for name, k2 in EARLY.items()
                 if case[4] == 1 and k2.block_r >= case[3]
                 and not any(w % k2.block_n for w in case[2][:-1])]


@pytest.mark.parametrize(("case", "cfg"), EARLY_FITTING,
                         ids=[f"T{c[0]}-N{sum(c[2])}-r{c[3]}-{c[5]}-{n}" for c, n in EARLY_FITTING])
def test_the_epilogue_operands_loaded_early_give_the_halves_bits(case, cfg, monkeypatch):
    x, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(0, *case)
    h[0, :, batch.token_lora_mapping < 0] = 3.0  # rows without an adapter: h must not count
    k2 = EARLY[cfg]
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "all")
    monkeypatch.setenv("EPILORA_EPILOGUE_EARLY", "0")
    halves = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    monkeypatch.setenv("EPILORA_EPILOGUE_EARLY", "1")
    early = record_k2_early(monkeypatch)
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    assert early == [True]  # h given: whole before the K loop
    assert_bitwise_equal(y, reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora,
                                                    batch), name="K2, operands early, vs reference")
    assert_bitwise_equal(y, halves, name="K2, operands early, vs halves")
    if case[3] <= 16:
        _check_rows(y, fused.fp8_gemm(codes, scales, weight, w_scale, config=k2), h, lora,
                    batch, "K2, operands early")


def test_the_epilogue_operands_load_early_only_where_h_is_whole_and_they_fit(monkeypatch):
    # =1 only: one slot (two entries), in halves, h whole before the K loop (no PDL, or the
    # fused path's wait for all of K1), h's and B's tiles within 64 bytes a thread, K whole
    # (split, only the last split's program adds the delta); never in the decode path (h
    # comes while the loop runs) or the one launch (h made in it)
    import dataclasses

    from epilora_kernels import _tiling

    tile = LaunchConfig(block_m=128, block_n=128, block_k=128, block_r=32, num_warps=8)
    monkeypatch.delenv("EPILORA_EPILOGUE_EARLY", raising=False)
    assert not _tiling.epilogue_early(tile, True, 2, True)  # off by default (untimed)
    monkeypatch.setenv("EPILORA_EPILOGUE_EARLY", "1")
    assert _tiling.epilogue_early(tile, True, 2, True)
    assert not _tiling.epilogue_early(tile, False, 2, True)  # not in halves
    assert not _tiling.epilogue_early(tile, True, 3, True)  # several slots
    assert not _tiling.epilogue_early(tile, True, 2, False)  # h not whole
    assert not _tiling.epilogue_early(dataclasses.replace(tile, block_r=64), True, 2, True)
    assert _tiling.epilogue_early(dataclasses.replace(tile, block_m=64, block_n=64,
                                                      num_warps=4), True, 2, True)
    assert not _tiling.epilogue_early(dataclasses.replace(tile, block_n=256), True, 2, True)
    # staged in shared memory: gate_up's 64 x 128 tile at 128 tokens would fit 2 blocks, not 3
    gate_up_128 = LaunchConfig(block_m=64, block_n=128, block_k=128, block_r=16, num_warps=4,
                               num_stages=3)
    assert not _tiling.epilogue_early(gate_up_128, True, 2, True)
    assert _tiling.epilogue_early(dataclasses.replace(gate_up_128, num_stages=2), True, 2, True)
    _, _, _, _, _, _, lora, _ = make_integer_problem(9, 70, 64, (64, 64), 16, 1, "one_adapter")
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "1")
    # (pdl, wait for codes, wait for K1 first, K split, weight by TMA): whether it is taken
    cases = {(False, False, False, 1, True): True, (True, False, True, 1, True): True,
             (True, True, False, 1, True): False, (True, False, False, 1, True): False,
             (True, True, True, 1, True): False, (False, False, False, 2, True): False,
             (False, False, False, 1, False): False}
    for (pdl, wait_codes, k1_first, split, w_tma), early in cases.items():
        arguments = _launchers._k2_arguments(
            FP8, lora, 2, tile, n=128, stride_a=64, stride_y=128, h_planes=1, split=split,
            w_tma=w_tma, per_channel=False, traced=False, pdl=pdl, wait_codes=wait_codes,
            warm_l2=0, wait_k1_first=k1_first, a_sorted=False, interpreter=True,
            has_bias=False, tokens=70)
        assert arguments["EPILOGUE_EARLY"] == early, (pdl, wait_codes, k1_first, split, w_tma)
    # as read by the caller (a LoraProjection, when made), whatever the environment says now
    assert not _tiling.epilogue_early(tile, True, 2, True, setting="0")
    monkeypatch.setenv("EPILORA_EPILOGUE_EARLY", "0")
    assert _tiling.epilogue_early(tile, True, 2, True, setting="1")
    monkeypatch.setenv("EPILORA_EPILOGUE_EARLY", "yes")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        _tiling.epilogue_early(tile, True, 2, True)


@pytest.mark.vllm
@pytest.mark.parametrize(("cfg", "slots", "mapping"),
                         [(name, 1, "mixed_with_base") for name in HALVES]
                         + [("halves", 8, "one_token_each"),
                            ("halves-segments", 8, "one_token_each")])
def test_k2_epilogue_in_halves_adds_the_adapters_as_vllms_expand(cfg, slots, mapping,
                                                                  monkeypatch):
    # Inexact bases and deltas (the case's check fails one rounding or an fp32 delta)
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "all")
    check_k2_adds_the_adapters_as_vllms_expand(HALVES[cfg], seed=5, tokens=70,
                                               widths=(64, 64), max_loras=slots,
                                               mapping=mapping)


def test_the_epilogue_in_halves_only_in_fp8_prefill_tiles(monkeypatch):
    # auto, the default: one slot (two entries: the slot and tokens without one) from 65
    # tokens, and several slots of rank 32 or less from 32 tokens a slot (65 in all); =1: one
    # slot at any size; =all: several too, where it replaces the delta first (which parks the
    # delta in y); =0: never. FP8 tiles of 64 rows or more only.
    import dataclasses

    from epilora_kernels import _tiling

    tile = HALVES["halves"]
    monkeypatch.delenv("EPILORA_EPILOGUE_HALVES", raising=False)
    assert [_tiling.epilogue_halves(tile, entries, True, tokens)
            for entries, tokens in ((2, 64), (2, 65), (9, 64), (9, 65))] == [
        False, True, False, False]
    # (entries, tokens, rank): 8 slots need 256 tokens, 4 slots 128, 16 slots 512, 2 slots 65
    # (not 64: 65 in all); ranks above 32 (33, 64) never; no rank given (0), never
    cells = ((9, 256, 16), (9, 255, 16), (9, 4096, 64), (5, 128, 32), (5, 127, 32),
             (5, 4096, 33), (17, 512, 16), (17, 511, 16), (3, 65, 16), (3, 64, 16),
             (2, 65, 128), (2, 64, 16), (9, 512, 0))
    assert [_tiling.epilogue_halves(tile, entries, True, tokens, rank)
            for entries, tokens, rank in cells] == [
        True, False, False, True, False, False, True, False, True, False, True, False, False]
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "1")
    assert _tiling.epilogue_halves(tile, 2, fp8=True)
    assert not _tiling.epilogue_halves(tile, 9, fp8=True)
    for setting in ("auto", "1", "all"):
        monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", setting)
        assert not _tiling.epilogue_halves(tile, 2, False, 512)  # W8A16: one rounding, in fp32
        for other in (dataclasses.replace(tile, block_m=32),
                      dataclasses.replace(tile, block_n=16),
                      dataclasses.replace(tile, block_n=64, swap_ab=True)):
            assert not _tiling.epilogue_halves(other, 2, True, 512), (setting, other)
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "all")
    assert _tiling.epilogue_halves(tile, 9, fp8=True)
    _, _, _, _, _, _, lora, _ = make_integer_problem(9, 5, 64, (32, 32), 16, 8, "one_adapter")
    arguments = _launchers._k2_arguments(
        FP8, lora, 9, tile, n=64, stride_a=64, stride_y=64, h_planes=1, split=1,
        w_tma=False, per_channel=False, traced=False, pdl=False, wait_codes=False, warm_l2=0,
        wait_k1_first=False, a_sorted=False, interpreter=True, has_bias=False)
    assert arguments["EPILOGUE_HALVES"] and not arguments["DELTA_FIRST"]
    # auto: the launchers pass the slots' rank (16 here) and the batch's tokens to the rule
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "auto")
    for tokens, halves in ((256, True), (255, False)):
        arguments = _launchers._k2_arguments(
            FP8, lora, 9, tile, n=64, stride_a=64, stride_y=64, h_planes=1, split=1,
            w_tma=False, per_channel=False, traced=False, pdl=False, wait_codes=False,
            warm_l2=0, wait_k1_first=False, a_sorted=False, interpreter=True, has_bias=False,
            tokens=tokens)
        assert (arguments["EPILOGUE_HALVES"], arguments["DELTA_FIRST"]) == (halves, not halves)
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "0")
    assert not _tiling.epilogue_halves(tile, 2, True, 512)
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "yes")
    with pytest.raises(ValueError, match="expected auto, 0, 1 or all"):
        _tiling.epilogue_halves(tile, 2, fp8=True)


# EPILORA_DELTA_KERNEL: where K2 would sum several slots' delta before its K loop, a kernel
# of its own writes it into y (adapter rows only) and K2 adds it: segments straddling its
# 16-row tiles (one_token_each: 9 tokens a slot), runs in reverse, tokens without an adapter,
# three slices, the rank whole and in steps (rank 128: two 64-wide steps), h in bf16
DELTA_KERNEL = {"prefill-tma": K2_CONFIGS["prefill-tma"],
                "prefill-segments": K2_CONFIGS["prefill-segments"],
                "128-rows": LaunchConfig(block_m=128, block_n=32, block_k=32, block_r=16)}
DELTA_KERNEL_CASES = [(70, 64, (32, 16, 16), 16, 8, "one_token_each"),
                      (130, 96, (64, 64), 16, 8, "one_token_each"),
                      (70, 64, (32, 32), 16, 4, "reversed_runs"),
                      (70, 64, (32,), 8, 3, "mixed_with_base")]
DELTA_KERNEL_FITTING = [(case, name) for case in DELTA_KERNEL_CASES
                        for name, k2 in DELTA_KERNEL.items()
                        if not any(w % k2.block_n for w in case[2][:-1])]


@pytest.mark.parametrize(("case", "cfg"), DELTA_KERNEL_FITTING,
                         ids=[f"T{c[0]}-N{sum(c[2])}-{c[4]}-{c[5]}-{n}"
                              for c, n in DELTA_KERNEL_FITTING])
def test_k2_with_the_delta_kernel_equals_reference_and_the_delta_first(case, cfg,
                                                                       monkeypatch):
    x, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(0, *case)
    k2 = DELTA_KERNEL[cfg]
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "0")
    monkeypatch.setenv("EPILORA_DELTA_KERNEL", "0")
    first = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    monkeypatch.setenv("EPILORA_DELTA_KERNEL", "1")
    launched = []
    real = _launchers.launch_delta

    def launch_delta(support, y, *args):  # y full of NaN first: K2 must not read unwritten rows
        launched.append(1)
        y.fill_(float("nan"))
        real(support, y, *args)

    monkeypatch.setattr(_launchers, "launch_delta", launch_delta)
    for h_in in (h, h.to(torch.bfloat16)):  # K1 writes h in bf16 for K2's prefill tiles
        y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h_in, lora, batch, config=k2)
        assert_bitwise_equal(y, reference.lora_fp8_gemm(codes, scales, weight, w_scale, h,
                                                        lora, batch),
                             name="K2 with the delta kernel vs reference")
        assert_bitwise_equal(y, first, name="K2 with the delta kernel vs the delta first")
        _check_rows(y, fused.fp8_gemm(codes, scales, weight, w_scale, config=k2), h, lora,
                    batch, "K2 with the delta kernel")
    assert launched == [1, 1]


def test_the_delta_kernel_at_rank_128_in_two_steps(monkeypatch):
    # rank 128: the delta kernel's two 64-wide rank steps (every step carries data: h and B
    # nonzero in all columns); outputs past 256 are inexact in bf16, so the reference's bits
    # only, and the fused path whole (K1, the delta kernel, K2) against the delta first
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "0")
    x, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(
        2, 70, 64, (64, 64), 128, 4, "reversed_runs")
    k2 = LaunchConfig(block_m=64, block_n=32, block_k=32, block_r=128, num_warps=1)
    monkeypatch.setenv("EPILORA_DELTA_KERNEL", "1")
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    assert_bitwise_equal(y, reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora,
                                                    batch), name="delta kernel at rank 128")
    k1 = LaunchConfig(block_m=64, block_r=32, block_k=32, split_k=2)
    whole = ek.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1,
                                     k2_config=k2)
    monkeypatch.setenv("EPILORA_DELTA_KERNEL", "0")
    assert_bitwise_equal(whole, ek.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                         k1_config=k1, k2_config=k2),
                         name="the fused path with the delta kernel vs the delta first")


def test_the_delta_kernel_leaves_rows_padded_past_the_counted_tokens_alone(monkeypatch):
    # vLLM pads a batch to a captured graph's size with rows whose slots and sorted indices are
    # stale: with the delta kernel the real rows are what they are unpadded, the padding the
    # base alone (it neither writes nor reads those rows)
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "0")
    monkeypatch.setenv("EPILORA_DELTA_KERNEL", "1")
    x, weight, w_scale, lora, batch = make_problem(9, 70, 64, (32, 16, 16), 16, 8,
                                                   "one_token_each")
    xp, padded = pad_batch(x, batch, 80)
    k2 = DELTA_KERNEL["prefill-tma"]
    y = ek.fused_lora_fp8_linear(xp, weight, w_scale, lora, padded, k2_config=k2)
    assert_bitwise_equal(y[:70], ek.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                          k2_config=k2), name="real rows")
    none = ek.AdapterBatch.from_token_mapping(torch.full((80,), -1, dtype=torch.int32), 8)
    assert_bitwise_equal(y[70:], ek.fused_lora_fp8_linear(xp, weight, w_scale, lora, none,
                                                          k2_config=k2)[70:], name="padding")


def test_the_delta_kernel_only_where_the_delta_goes_first(monkeypatch):
    # (mode, block_m, entries, split, pdl, wait_k1_first): as DELTA_FIRST; a K2 told the delta
    # is in y where it would not sum it first is refused; auto is the default; a bad value raises
    _, _, _, _, _, _, lora, _ = make_integer_problem(9, 5, 64, (32, 16, 16), 16, 8, "one_adapter")
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "0")
    cfg = LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=16)
    kw = dict(n=64, stride_a=64, stride_y=64, h_planes=1, w_tma=False, per_channel=False,
              traced=False, wait_codes=False, warm_l2=0, a_sorted=False, interpreter=True,
              has_bias=False)
    arguments = _launchers._k2_arguments(FP8, lora, 9, cfg, split=1, pdl=False,
                                         wait_k1_first=False, delta_in_y=True, **kw)
    assert arguments["DELTA_FIRST"] and arguments["DELTA_IN_Y"]
    for entries, split, pdl in ((2, 1, False), (9, 2, False), (9, 1, True)):
        with pytest.raises(ValueError, match="delta_in_y"):
            _launchers._k2_arguments(FP8, lora, entries, cfg, split=split, pdl=pdl,
                                     wait_k1_first=False, delta_in_y=True, **kw)
    from epilora_kernels import _env

    monkeypatch.delenv("EPILORA_DELTA_KERNEL", raising=False)
    assert _env.delta_kernel() == "auto"
    monkeypatch.setenv("EPILORA_DELTA_KERNEL", "yes")
    with pytest.raises(ValueError, match="expected 0, 1 or auto"):
        _env.delta_kernel()


def test_the_delta_kernel_auto_takes_short_segments_only(monkeypatch):
    # EPILORA_DELTA_KERNEL=auto: where the delta goes first, up to DELTA_TOKENS_PER_SLOT
    # tokens a slot held (9 entries: 8 slots and the one without an adapter); `1` at any
    # count; neither where the delta does not go first (one slot, split K)
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "0")
    cfg = LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=16)
    bound = _launchers.DELTA_TOKENS_PER_SLOT * 8

    def use(setting, tokens, entries=9, split=1):
        return _launchers.use_delta_kernel(setting, FP8, cfg, entries, split=split,
                                           pdl=True, wait_k1_first=True, tokens=tokens,
                                           rank=16)

    assert use("auto", bound) and not use("auto", bound + 1)
    assert use("1", bound + 1) and not use("0", bound)
    assert not use("1", 70, entries=2) and not use("auto", 70, split=2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-N{sum(c[2])}-{c[5]}")
def test_k2_w8a16_and_expand_equal_reference_bitwise_and_every_rows_delta(case):
    x, _, _, weight, w_scale, h, lora, batch = make_integer_problem(1, *case)
    k2 = K2_CONFIGS["decode-tile"] if case[0] < 64 else K2_CONFIGS["prefill-tma"]
    y = fused.lora_w8a16_gemm(x, weight, w_scale, h, lora, batch, config=k2)
    assert_bitwise_equal(y, reference.lora_w8a16_gemm(x, weight, w_scale, h, lora, batch),
                         name="W8A16 K2 vs reference")
    for name in SWAPPED:  # the transposed product, where its 64-wide tiles fit the slices
        if not any(w % K2_CONFIGS[name].block_n for w in case[2][:-1]):
            swapped = fused.lora_w8a16_gemm(x, weight, w_scale, h, lora, batch,
                                            config=K2_CONFIGS[name])
            assert_bitwise_equal(swapped, y, name=f"W8A16 K2 {name}")
    base = (w_scale * (x.float() @ weight.float().T)).to(torch.bfloat16)
    # K2 without adapters (the matched engine's), with the settings it picks itself too
    for cfg in (k2, K2_CONFIGS["split-k"], None):
        alone = fused.w8a16_gemm(x, weight, w_scale, config=cfg)
        assert_bitwise_equal(alone, reference.w8a16_gemm(x, weight, w_scale),
                             name="W8A16 K2 without adapters vs reference")
        assert_bitwise_equal(alone, base, name="W8A16 K2 without adapters vs x W^T")
    _check_rows(y, base, h, lora, batch, "W8A16 K2")
    expanded = fused.lora_expand(base.clone(), h, lora, batch, config=k2)
    assert_bitwise_equal(expanded, reference.lora_expand(base.clone(), h, lora, batch),
                         name="expand vs reference")
    _check_rows(expanded, base, h, lora, batch, "expand")


def test_a_lost_adapter_row_is_caught():
    # The row check itself: drop one token's adapter from the reference and it must fail.
    x, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(
        2, 9, 64, (32, 16, 16), 16, 4, "mixed_with_base")
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch)
    base = fused.fp8_gemm(codes, scales, weight, w_scale)
    lost = y.clone()
    row = int((batch.token_lora_mapping >= 0).nonzero()[0])
    lost[row] = base[row]
    with pytest.raises(AssertionError, match=f"row {row}"):
        _check_rows(lost, base, h, lora, batch, "lost")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-N{sum(c[2])}-{c[5]}")
def test_k2_with_per_channel_scales_equals_reference_bitwise(case):
    # Powers of two per output channel keep every product exact: K2 must equal its reference
    # bit for bit, and each column be scaled by its own channel's scale.
    x, codes, scales, weight, _, h, lora, batch = make_integer_problem(3, *case)
    n = lora.out_features
    w_scale = 2.0 ** -(torch.arange(n) % 3).float()  # 1, 1/2, 1/4, ...
    swapped = [] if any(w % 64 for w in case[2][:-1]) else [K2_CONFIGS["swap-ab-split"]]
    for k2 in (K2_CONFIGS["decode-tile"], K2_CONFIGS["prefill-tma"], *swapped):
        y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
        assert_bitwise_equal(y, reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora,
                                                        batch), name="per-channel K2")
        base = fused.fp8_gemm(codes, scales, weight, w_scale, config=k2)
        want = (codes.float() @ weight.float().T) * w_scale[None, :]
        assert_bitwise_equal(base, want.to(torch.bfloat16), name="per-channel GEMM columns")
        _check_rows(y, base, h, lora, batch, "per-channel K2")
    w8a16 = ((x.float() @ weight.float().T) * w_scale[None, :]).to(torch.bfloat16)
    for k2 in (K2_CONFIGS["decode-tile"], K2_CONFIGS["split-k"], K2_CONFIGS["prefill-tma"],
               *swapped):
        assert_bitwise_equal(fused.w8a16_gemm(x, weight, w_scale, config=k2), w8a16,
                             name="per-channel W8A16 GEMM columns")


@pytest.mark.vllm
@pytest.mark.parametrize("cfg", ["decode-tile", "split-k", "prefill-tma", "rank-steps",
                                 "segments", "rank-steps-segments"])
def test_fp8_k2_adds_the_adapters_as_vllms_expand(cfg):
    check_k2_adds_the_adapters_as_vllms_expand(K2_CONFIGS[cfg], seed=4, tokens=70,
                                               widths=(32, 16, 16))


@pytest.mark.parametrize("cfg", ["decode-tile", "prefill-tma"])
def test_w8a16_k2_adds_the_adapters_before_one_rounding(cfg):
    # The trainer's arithmetic: w_scale * acc + delta in fp32, one rounding. A weight scale that
    # is not a power of two makes the base inexact in bf16, so the FP8 paths' two roundings
    # differ (checked). Here only: the interpreter's dot adds the delta to the accumulator in
    # one addition, as the reference does (the rank whole, no rank steps); an MMA need not.
    x, _, _, weight, _, h, lora, batch = make_integer_problem(
        6, 21, 96, (16, 32), 8, 3, "reversed_runs")
    w_scale = torch.tensor([0.37])
    y = fused.lora_w8a16_gemm(x, weight, w_scale, h * 37, lora, batch, config=K2_CONFIGS[cfg])
    want = reference.lora_w8a16_gemm(x, weight, w_scale, h * 37, lora, batch)
    assert_bitwise_equal(y, want, name="W8A16 K2 vs reference")
    base = w_scale * (x.float() @ weight.to(torch.bfloat16).float().T)
    twice = (base.to(torch.bfloat16).double() + exact_lora_delta(h * 37, lora, batch))
    assert not torch.equal(twice.to(torch.bfloat16), want), "two roundings give its bits too"


@pytest.mark.parametrize("cfg", ["decode-tile", "split-k", "prefill-tma", "rank-steps"])
def test_k2_adds_the_bias_before_rounding_the_base(cfg):
    # K2 given the bias directly (FP8 and W8A16, and without adapters), each tile kind: with
    # these eight slots the 64-row tiles sum the delta first and keep it in y (DELTA_FIRST).
    x, codes, _, weight, _, h, lora, batch = make_integer_problem(
        8, 70, 64, (32, 16, 16), 16, 8, "one_token_each")
    w_scale = torch.tensor([16.0])  # bases past 256: inexact in bf16, exact in fp32
    scales = torch.ones(70, 1)
    bias = bias_of_halves(lora.out_features, 8)
    k2 = K2_CONFIGS[cfg]
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2,
                            bias=bias)
    want = reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, bias=bias)
    assert_bitwise_equal(y, want, name="FP8 K2 with a bias")
    after = (reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch).float()
             + bias.float()).to(torch.bfloat16)
    assert not torch.equal(after, want), "the bias added after rounding gives its bits too"
    assert_bitwise_equal(fused.fp8_gemm(codes, scales, weight, w_scale, config=k2, bias=bias),
                         reference.fp8_gemm(codes, scales, weight, w_scale, bias=bias),
                         name="K2 without adapters, with a bias")
    if k2.split_k == 1:
        assert_bitwise_equal(
            fused.lora_w8a16_gemm(x, weight, w_scale, h, lora, batch, config=k2, bias=bias),
            reference.lora_w8a16_gemm(x, weight, w_scale, h, lora, batch, bias=bias),
            name="W8A16 K2 with a bias")
    assert_bitwise_equal(fused.w8a16_gemm(x, weight, w_scale, config=k2, bias=bias),
                         reference.w8a16_gemm(x, weight, w_scale, bias=bias),
                         name="W8A16 K2 without adapters, with a bias")


@pytest.mark.parametrize(("path", "tokens"), [("decode", 5), ("fused", 9), ("fused", 70),
                                              ("w8a16", 9), ("hybrid", 9)])
@pytest.mark.parametrize("bound", [False, True], ids=["lora_linear", "projection"])
def test_every_path_adds_the_bias_before_rounding(path, tokens, bound):
    check_the_bias_is_added_before_rounding(path, tokens, bound=bound)


def test_a_bad_bias_is_refused():
    x, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(
        8, 5, 64, (32, 16, 16), 16, 4, "mixed_with_base")
    n = lora.out_features
    for bias, match in ((torch.zeros(n - 1, dtype=torch.bfloat16), r"bias must be .*\[64\]"),
                        (torch.zeros(n, dtype=torch.float16), "bf16 or fp32"),
                        (torch.zeros(n, 2, dtype=torch.bfloat16)[:, 0], "contiguous")):
        with pytest.raises(ValueError, match=match):
            fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, bias=bias)
        with pytest.raises(ValueError, match=match):
            ek.lora_linear(x, weight, w_scale, lora, batch, bias=bias)
    for path in ("hybrid", None):  # refused whichever path the call takes
        with pytest.raises(ValueError, match="base GEMM adds the bias"):
            ek.lora_linear(x, weight, w_scale, lora, batch, path=path,
                           base_gemm=ek.vendor_fp8_gemm,
                           bias=torch.zeros(n, dtype=torch.bfloat16))


@pytest.mark.parametrize(("mode", "block_m", "entries", "split", "pdl", "wait_k1_first", "first"), [
    (FP8, 64, 9, 1, False, False, True),    # several slots, K1 done before K2 starts
    (FP8, 128, 9, 1, True, True, True),     # the fused path with PDL: waits for all of K1 first
    (FP8, 64, 9, 1, True, False, False),    # the decode path: h only after gdc_wait
    (FP8, 32, 9, 1, False, False, False),   # decode tiles: the delta after the GEMM
    (FP8, 64, 2, 1, False, False, False),   # one slot: the base waits in y instead
    (FP8, 64, 9, 2, False, False, False),   # split-K: the last split sums after the K loop
    (W8A16, 64, 9, 1, False, False, False),  # one rounding of base + delta
])
def test_the_delta_goes_first_only_where_h_is_whole_before_the_k_loop(
        mode, block_m, entries, split, pdl, wait_k1_first, first):
    # K2 reads h before its K loop with DELTA_FIRST: a wrong answer on a GPU (not under the
    # interpreter, which runs K1 to its end first) wherever K1 may still be writing h then.
    _, _, _, _, _, _, lora, _ = make_integer_problem(9, 5, 64, (32, 16, 16), 16, 8, "one_adapter")
    cfg = LaunchConfig(block_m=block_m, block_n=16, block_k=32, block_r=16)
    arguments = _launchers._k2_arguments(
        mode, lora, entries, cfg, n=64, stride_a=64, stride_y=64, h_planes=1, split=split,
        w_tma=False, per_channel=False, traced=False, pdl=pdl, wait_codes=pdl and not
        wait_k1_first, warm_l2=0, wait_k1_first=wait_k1_first, a_sorted=False,
        interpreter=True, has_bias=False)
    assert arguments["DELTA_FIRST"] is first


def test_gathering_under_fit_only_where_the_tiles_slices_of_b_fit_its_l1_budget(monkeypatch):
    # EPILORA_GATHER_SEGMENTS=fit, a 16 x 64 decode tile, (entries, rank): the entries are the
    # slots and one for tokens without an adapter. It gathers with 8 slots of rank 16 (8
    # slices of 2 KB), with 32 of rank 16 (16 rows: at most 16 slices, 32 KB, the budget), not
    # with 8 of rank 64 (64 KB), nor in a 32-row tile; =1 gathers in all of them, =0 (the
    # default) in none.
    import dataclasses

    from epilora_kernels import _tiling

    tile = GATHERED["one-warp-wide"]
    assert tile.block_m == 16 and tile.block_n == 64
    rows_32 = dataclasses.replace(tile, block_m=32, block_n=16)  # 8 slices of 512 B: it fits
    cases = {(9, 16): True, (33, 16): True, (9, 64): False}
    monkeypatch.setenv("EPILORA_GATHER_SEGMENTS", "fit")
    assert {c: _tiling.gather_segments(tile, *c) > 0 for c in cases} == cases
    assert _tiling.gather_segments(tile, 2, 16) == 0  # one segment a tile: the loop
    assert _tiling.gather_segments(rows_32, 9, 16) == 0
    monkeypatch.setenv("EPILORA_GATHER_SEGMENTS", "1")
    assert all(_tiling.gather_segments(tile, *c) > 0 for c in cases)
    assert _tiling.gather_segments(rows_32, 9, 16) > 0
    for setting in ("0", None):
        if setting is None:
            monkeypatch.delenv("EPILORA_GATHER_SEGMENTS")
        else:
            monkeypatch.setenv("EPILORA_GATHER_SEGMENTS", setting)
        assert not any(_tiling.gather_segments(tile, *c) for c in cases)
        assert _tiling.gather_segments(rows_32, 9, 16) == 0
    monkeypatch.setenv("EPILORA_GATHER_SEGMENTS", "yes")
    with pytest.raises(ValueError, match="expected 0, 1 or fit"):
        _tiling.gather_segments(tile, 8, 16)
