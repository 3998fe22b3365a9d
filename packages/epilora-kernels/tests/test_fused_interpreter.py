"""The kernels against their torch references, in Triton's CPU interpreter (small shapes).

The interpreter divides exactly, so K1's codes are compared bitwise with epilora-quant's
TORCH_CPU mode here (on a GPU, tests/gpu/ compares them with INDUCTOR, vLLM's compiled mode).
The kernels' fp32 sums run in another order than the references', so bf16 outputs are compared
by relative error (bf16 has 8 bits of mantissa: a few 1e-3 at most), and bitwise run to run and
path to path (the kernels round fp32 to bf16 to nearest even here too: `_to_bf16`).
"""

import pytest
import torch
from hypothesis import given

from epilora_kernels import _launchers, _tiling, fused, reference
from epilora_kernels.arch import INTERPRETER
from epilora_kernels.workspace import Workspace, default_workspace
from epilora_quant import Fp8Arithmetic
from epilora_testing import assert_bitwise_equal
from epilora_testing.corpora import special_activations
from epilora_testing.strategies import activations

from kernel_cases import MAPPINGS, fp64_reference, make_problem, relative_error

SHAPES = [  # (tokens, K, output slices, rank, max_loras)
    (1, 64, (32,), 16, 4),
    (5, 96, (32, 16, 16), 8, 4),
    (19, 64, (32, 32), 1, 3),
    (33, 128, (64,), 16, 2),
]
BF16_TOL = 1e-2  # bf16 rounding of the output (and of the base before the adapters: FP8 paths)


@pytest.mark.parametrize("mapping", sorted(MAPPINGS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-K{s[1]}-N{sum(s[2])}-r{s[3]}")
def test_fused_fp8_path_matches_reference_and_exact_math(shape, mapping):
    t, k, slices, rank, max_loras = shape
    x, weight, w_scale, lora, batch = make_problem(0, t, k, slices, rank, max_loras, mapping)
    codes, scales, h = fused.quantize_and_shrink(x, lora, batch)
    want_codes, want_scales, want_h = reference.quantize_and_shrink(
        x, lora, batch, arithmetic=Fp8Arithmetic.TORCH_CPU)
    assert_bitwise_equal(codes, want_codes, name="codes", inputs=x)
    assert_bitwise_equal(scales, want_scales, name="scales")
    if bool(want_h.any()):
        assert relative_error(h.sum(0), want_h.sum(0)) < 1e-5
    else:  # no token has an adapter: K1 still writes every row of h, as zeros
        assert_bitwise_equal(h.sum(0), want_h.sum(0), name="h without adapters")
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch)
    want = reference.lora_fp8_gemm(codes, scales, weight, w_scale, want_h, lora, batch)
    assert relative_error(y, want) < BF16_TOL
    exact = fp64_reference(x, weight, w_scale, codes, scales, lora, batch)
    assert relative_error(y, exact) < BF16_TOL
    again = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert_bitwise_equal(again, y, name="second run")


@pytest.mark.parametrize("mapping", ["mixed_with_base", "one_token_each"])
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: f"T{s[0]}-N{sum(s[2])}")
def test_w8a16_path_matches_reference(shape, mapping):
    t, k, slices, rank, max_loras = shape
    x, weight, w_scale, lora, batch = make_problem(1, t, k, slices, rank, max_loras, mapping)
    y = fused.fused_lora_w8a16_linear(x, weight, w_scale, lora, batch)
    want = reference.fused_lora_w8a16_linear(x, weight, w_scale, lora, batch)
    assert relative_error(y, want) < BF16_TOL
    exact = fp64_reference(x, weight, w_scale, None, None, lora, batch, w8a16=True)
    assert relative_error(y, exact) < BF16_TOL


@pytest.mark.parametrize("split_k", [1, 3])
def test_hybrid_shrink_and_expand_match_reference(split_k):
    x, _, _, lora, batch = make_problem(2, 7, 96, (32, 16, 16), 8, 4, "mixed_with_base")
    cfg = fused.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, split_k=split_k)
    h = fused.lora_shrink(x, lora, batch, config=cfg)
    want_h = reference.lora_shrink(x, lora, batch)
    assert h.shape == want_h.shape  # split-K partials summed in the kernel
    assert relative_error(h, want_h) < 1e-5
    base = torch.randn(7, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    y = fused.lora_expand(base.clone(), h, lora, batch, config=cfg)
    want = reference.lora_expand(base.clone(), want_h, lora, batch)
    assert relative_error(y, want) < BF16_TOL


@pytest.mark.parametrize(("mapping", "slots"), [("mixed_with_base", 1), ("one_adapter", 1),
                                              ("mixed_with_base", 4), ("one_token_each", 4)])
def test_epilogue_in_rank_steps_matches_reference(mapping, slots):
    # Prefill tiles whose slice of B is too big for registers add h B^T in 32-wide rank steps
    # (_tiling.epilogue_rank_chunk; one warp makes 16 x 128 too big): rank 40 of a 128-wide
    # rank tile (partial and empty steps), one slot and several (each step's h loaded once for
    # all segments), the fused path and the hybrid's expand.
    x, weight, w_scale, lora, batch = make_problem(15, 70, 64, (32, 16, 16), 40, slots,
                                                   mapping)
    k2 = fused.LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=128, num_warps=1)
    assert _tiling.epilogue_rank_chunk(k2) == 32
    codes, scales, h = fused.quantize_and_shrink(x, lora, batch)
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    exact = fp64_reference(x, weight, w_scale, codes, scales, lora, batch)
    assert relative_error(y, exact) < BF16_TOL
    base = torch.randn(70, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    expanded = fused.lora_expand(base.clone(), h, lora, batch, config=k2)
    assert relative_error(expanded, reference.lora_expand(base.clone(), h, lora, batch)) \
        < BF16_TOL


@pytest.mark.parametrize("mapping", ["mixed_with_base", "one_adapter", "no_adapter"])
@pytest.mark.parametrize(("block_m", "block_n", "warps"), [(64, 16, 1), (16, 16, 1), (16, 16, 4),
                                                           (32, 16, 1)])
def test_one_slot_epilogue_equals_the_several_slot_one_bitwise(mapping, block_m, block_n, warps):
    # K2 compiles a one-slot epilogue apart (ENTRIES_BLOCK <= 2); the same tokens on slot 0 of
    # four slots run the several-slot one: the same bits, over 70 tokens at rank 40 of a
    # 128-wide rank tile, in each one-slot form: 64-row tiles in rank steps
    # (_tiling.epilogue_rank_chunk), 16-row tiles loading B after the K loop (one warp) or
    # holding it through it, 32-row tiles holding it (_tiling.b_in_registers).
    x, weight, w_scale, lora, one = make_problem(16, 70, 64, (32, 16, 16), 40, 1, mapping)

    def four_slots(t):
        return torch.cat([t, torch.zeros_like(t).expand(3, *t.shape[1:])])

    lora4 = fused.LoraWeights(tuple(map(four_slots, lora.lora_a)),
                              tuple(map(four_slots, lora.lora_b)), lora.output_slices)
    four = fused.AdapterBatch.from_token_mapping(one.token_lora_mapping, 4)
    k2 = fused.LaunchConfig(block_m=block_m, block_n=block_n, block_k=32, block_r=128,
                            num_warps=warps)
    assert (_tiling.epilogue_rank_chunk(k2) > 0, _tiling.b_in_registers(k2)) == {
        64: (True, False), 16: (False, warps == 4), 32: (False, True)}[block_m]
    codes, scales, h = fused.quantize_and_shrink(x, lora, one)
    got, want = (fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, adapters, batch,
                                     config=k2)
                 for adapters, batch in ((lora, one), (lora4, four)))
    assert_bitwise_equal(got, want, name="one-slot K2")


def test_rank_below_the_slot_maximum_and_all_slots_filled():
    x, weight, w_scale, lora, batch = make_problem(4, 9, 64, (32,), 16, 4, "one_token_each",
                                                   rank_used=3)
    y = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    codes, scales, _ = reference.quantize_and_shrink(x, lora, batch,
                                                     arithmetic=Fp8Arithmetic.TORCH_CPU)
    assert relative_error(y, fp64_reference(x, weight, w_scale, codes, scales, lora,
                                            batch)) < BF16_TOL


def test_bad_inputs_are_rejected():
    x, weight, w_scale, lora, batch = make_problem(5, 4, 64, (32,), 8, 2, "one_adapter")
    with pytest.raises(ValueError, match="bfloat16"):
        fused.quantize_and_shrink(x.float(), lora, batch)
    with pytest.raises(ValueError, match="features"):
        fused.quantize_and_shrink(x[:, :32], lora, batch)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused.lora_fp8_gemm(x, x, weight.float(), w_scale, x, lora, batch)
    from epilora_kernels.batch import AdapterBatch

    with pytest.raises(ValueError, match="slots"):
        fused.quantize_and_shrink(x, lora, AdapterBatch.from_token_mapping(
            batch.token_lora_mapping, 3))
    # A batch with more slots than the adapters would index past B's buffer: refused by every
    # launcher that reads B (K2 and the hybrid path's expand too), before any launch.
    wide = AdapterBatch.from_token_mapping(torch.tensor([2, 2, 1, 1]), 3)
    codes, scales = fused.quantize(x)
    h = fused.lora_shrink(x, lora, batch)
    with pytest.raises(ValueError, match="batch has 3 slots, the adapters 2"):
        fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, wide)
    with pytest.raises(ValueError, match="batch has 3 slots, the adapters 2"):
        fused.lora_expand(torch.zeros(4, 32, dtype=torch.bfloat16), h, lora, wide)
    with pytest.raises(ValueError, match="h is on meta"):
        fused.lora_fp8_gemm(codes, scales, weight, w_scale, h.to("meta"), lora, batch)
    with pytest.raises(ValueError, match="trace"):  # the timeline's buffers: int64 rows
        fused._linear(0, x, weight, w_scale, lora, batch, None, None, decode=True,
                      traces=(torch.zeros(64, 8), None))
    with pytest.raises(ValueError, match="trace"):  # a row for every program
        fused._linear(0, x, weight, w_scale, lora, batch, None, None, decode=True,
                      traces=(torch.zeros(1, 8, dtype=torch.int64), None))


@pytest.mark.parametrize("case", sorted(special_activations(torch.float32)))
def test_k1_codes_on_special_values(case):
    # Grid points +-1 ulp, ties, subnormals, zeros: the interpreter-mode cast (integer RNE) and
    # the exact divisions must give epilora-quant's TORCH_CPU codes bit for bit.
    x = special_activations(torch.bfloat16, rows=6, cols=128)[case]
    _, _, lora, batch = make_problem(6, 6, 128, (32,), 8, 2, "mixed_with_base")[1:]
    codes, scales, _ = fused.quantize_and_shrink(x, lora, batch)
    want_codes, want_scales, _ = reference.quantize_and_shrink(
        x, lora, batch, arithmetic=Fp8Arithmetic.TORCH_CPU)
    assert_bitwise_equal(codes, want_codes, name="codes", inputs=x)
    assert_bitwise_equal(scales, want_scales, name="scales")


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "serialized"])
@pytest.mark.parametrize("mapping", ["mixed_with_base", "one_token_each", "no_adapter"])
def test_decode_path_equals_fused_path_bitwise(mapping, pdl):
    # Same tiles: K2 quantizing in-kernel gives the fused path's accumulator bit for bit.
    x, weight, w_scale, lora, batch = make_problem(7, 5, 96, (32, 16, 16), 8, 4, mapping)
    k1 = fused.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, split_k=2)
    k2 = fused.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16)
    decode = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1,
                                          k2_config=k2, pdl=pdl)
    fused_y = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1,
                                          k2_config=k2)
    assert_bitwise_equal(decode, fused_y, name="decode vs fused")
    want = reference.decode_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                            arithmetic=Fp8Arithmetic.TORCH_CPU)
    assert relative_error(decode, want) < BF16_TOL


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize(("t", "mapping"), [(5, "mixed_with_base"), (21, "one_token_each"),
                                            (3, "no_adapter")])
def test_swapped_k2_gives_every_path_the_bits_of_k2_alone(t, mapping, split_k):
    # K2 as the transposed product (`swap_ab`: wgmma's tiles on sm_90, the weight and the
    # codes K1 sorts by TMA): the fused and decode paths give the bits of K2 called alone on
    # K1's codes and h (K1 sorts its codes for the TMA reads here: the interpreter has TMA),
    # and the unswapped K2's answer up to the order of the sums.
    x, weight, w_scale, lora, batch = make_problem(13, t, 96, (64, 64, 32), 8, 4, mapping)
    k1 = fused.LaunchConfig(block_m=16, block_k=32, block_r=16, split_k=2)
    k2 = fused.LaunchConfig(block_m=16 if t <= 16 else 32, block_n=64, block_k=32,
                            block_r=16, split_k=split_k, swap_ab=True)
    codes, scales, h = fused.quantize_and_shrink(x, lora, batch, config=k1)
    alone = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    for path in (fused.fused_lora_fp8_linear, fused.decode_lora_fp8_linear):
        assert_bitwise_equal(path(x, weight, w_scale, lora, batch, k1_config=k1, k2_config=k2),
                             alone, name=f"{path.__name__} with swapped K2 tiles")
    unswapped = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch,
                                    config=fused.LaunchConfig(block_m=16, block_n=64,
                                                              block_k=32, block_r=16))
    assert relative_error(alone, unswapped) < BF16_TOL
    want = reference.decode_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                            arithmetic=Fp8Arithmetic.TORCH_CPU)
    assert relative_error(alone, want) < BF16_TOL
    assert _tiling.w_tma(INTERPRETER, weight, k2)  # the weight by TMA, as on sm_90


@pytest.mark.parametrize("split_k", [1, 2])
def test_decode_path_beyond_the_decode_buckets_with_few_wide_k1_programs(split_k):
    # Beyond DECODE_SHRINK_MAX_TOKENS the decode path's K1 may have a decode_shrink entry of
    # its own (tune_layer.py): few programs over 64 rows and the whole rank, so that K2 finds
    # room beside them. Same bits as the fused path with the same settings.
    t = fused.DECODE_SHRINK_MAX_TOKENS + 1
    x, weight, w_scale, lora, batch = make_problem(9, t, 128, (32, 16), 8, 2, "mixed_with_base")
    k1 = fused.LaunchConfig(block_m=64, block_k=32, block_r=16, split_k=split_k, num_warps=4,
                            num_stages=2)
    k2 = fused.LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=16)
    y = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1,
                                     k2_config=k2)
    assert_bitwise_equal(y, fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                        k1_config=k1, k2_config=k2),
                         name="decode vs fused")
    want = reference.decode_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                            arithmetic=Fp8Arithmetic.TORCH_CPU)
    assert relative_error(y, want) < BF16_TOL


@pytest.mark.parametrize("t", [1, 17])
def test_gemm_without_adapters_matches_reference(t):
    x, weight, w_scale, lora, batch = make_problem(8, t, 64, (32, 32), 8, 2, "no_adapter")
    codes, scales, _ = reference.quantize_and_shrink(x, lora, batch,
                                                     arithmetic=Fp8Arithmetic.TORCH_CPU)
    y = fused.fp8_gemm(codes, scales, weight, w_scale)
    assert relative_error(y, reference.fp8_gemm(codes, scales, weight, w_scale)) < BF16_TOL
    from_bf16 = fused.fp8_gemm_from_bf16(x, weight, w_scale)
    assert_bitwise_equal(from_bf16, y, name="quantize + fp8_gemm vs K1 codes + fp8_gemm")
    # no adapter anywhere: the LoRA GEMM gives the same bits as the plain one
    h = fused.lora_shrink(x, lora, batch)
    assert_bitwise_equal(fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch), y,
                         name="LoRA GEMM without adapters")


@given(x=activations(dtypes=(torch.bfloat16,), max_rows=20, col_multiple=32, max_col_blocks=4))
def test_k1_codes_property(x):
    # Hypothesis-drawn activations (raw bit patterns, seeded distributions, corpus cases).
    t, k = x.shape
    _, _, lora, batch = make_problem(9, t, k, (32,), 8, 2, "mixed_with_base")[1:]
    codes, scales, _ = fused.quantize_and_shrink(x, lora, batch)
    want_codes, want_scales = reference.quantize_and_shrink(
        x, lora, batch, arithmetic=Fp8Arithmetic.TORCH_CPU)[:2]
    assert_bitwise_equal(codes, want_codes, name="codes", inputs=x)
    assert_bitwise_equal(scales, want_scales, name="scales")


@pytest.mark.parametrize("k2_rows", [16, 64])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("mapping", ["mixed_with_base", "no_adapter"])
def test_fused_and_decode_paths_give_k2_the_bits_of_k1s_fp32_h(mapping, split_k, k2_rows):
    # Inside the fused and decode paths K1 rounds h to bf16 for K2's tiles of 64 rows or more,
    # whose epilogue rounded fp32 h itself: the same bits, with K1's planes summed first
    # (split) and zero rows for tokens without an adapter; 16-row tiles keep fp32 h. A zero
    # base weight, so that y is h B^T alone and shows any bit of h.
    x, weight, w_scale, lora, batch = make_problem(11, 70, 160, (32, 16, 16), 8, 4, mapping)
    weight = torch.zeros_like(weight)
    k1 = fused.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, split_k=split_k)
    k2 = fused.LaunchConfig(block_m=k2_rows, block_n=16, block_k=32, block_r=16)
    codes, scales, h = fused.quantize_and_shrink(x, lora, batch, config=k1)
    assert h.dtype == torch.float32
    given = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    for linear in (fused.fused_lora_fp8_linear, fused.decode_lora_fp8_linear):
        assert_bitwise_equal(linear(x, weight, w_scale, lora, batch, k1_config=k1,
                                    k2_config=k2), given,
                             name=f"{linear.__name__} vs K2 on fp32 h")


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("mapping", ["mixed_with_base", "one_token_each"])
def test_split_k_gemm_matches_reference_and_repeats_bitwise(mapping, split_k):
    # K = 160 in 32-wide steps: splits of 96+64 (2) and 64+64+32 (3), one tile of 16 rows, and
    # a second launch reusing the tile counters the first one reset.
    x, weight, w_scale, lora, batch = make_problem(10, 19, 160, (32, 16, 16), 8, 4, mapping)
    cfg = fused.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, split_k=split_k)
    codes, scales, h = fused.quantize_and_shrink(x, lora, batch)
    runs = [fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=cfg)
            for _ in range(2)]
    assert_bitwise_equal(runs[1], runs[0], name="split-K run to run")
    want = reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch)
    assert relative_error(runs[0], want) < BF16_TOL
    plain = fused.fp8_gemm(codes, scales, weight, w_scale, config=cfg)
    assert relative_error(plain, reference.fp8_gemm(codes, scales, weight, w_scale)) < BF16_TOL
    assert_bitwise_equal(fused.fp8_gemm_from_bf16(x, weight, w_scale, config=cfg), plain,
                         name="split-K, fp8_gemm_from_bf16 vs fp8_gemm")
    decode = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k2_config=cfg)
    serial = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k2_config=cfg,
                                          pdl=False)
    assert_bitwise_equal(decode, serial, name="split-K decode path vs serialized")
    assert relative_error(decode, want) < BF16_TOL


def test_expand_ignores_split_k():
    # The expand has no K loop; a split-K config (shared with the shrink) must not change it.
    x, _, _, lora, batch = make_problem(11, 7, 64, (32,), 8, 2, "mixed_with_base")
    h = fused.lora_shrink(x, lora, batch)
    base = torch.zeros(7, 32, dtype=torch.bfloat16)
    one = fused.lora_expand(base.clone(), h, lora, batch,
                            config=fused.LaunchConfig(block_n=16, block_k=32))
    three = fused.lora_expand(base.clone(), h, lora, batch,
                              config=fused.LaunchConfig(block_n=16, block_k=32, split_k=3))
    assert_bitwise_equal(three, one, name="expand with split_k=3")


@pytest.mark.parametrize("k", [12288, 16384 + 64], ids=["one_shot", "chunked"])
def test_quantize_long_rows(k):
    # Rows up to 16384 features are quantized from registers in one pass, longer ones in
    # chunks: both give epilora-quant's codes and scales.
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(3, k, generator=gen) * torch.tensor([[1e-3], [1.0], [300.0]])).to(
        torch.bfloat16)
    x[1, k - 1] = 57.0  # the amax in the last chunk's tail
    codes, scales = fused.quantize(x)
    want_codes, want_scales = reference.quantize(x, arithmetic=Fp8Arithmetic.TORCH_CPU)
    assert_bitwise_equal(codes, want_codes, name="codes", inputs=x)
    assert_bitwise_equal(scales, want_scales, name="scales")
    # K1's quantizing programs: 4096-wide chunks with 4 warps, one pass up to 16384 with 8.
    _, _, lora, batch = make_problem(0, 3, k, (32,), 16, 1, "one_adapter")[1:]
    for warps in (4, 8):
        cfg = fused.LaunchConfig(block_m=16, block_k=64, block_r=16, split_k=2,
                                 num_warps=warps)
        codes, scales, _ = fused.quantize_and_shrink(x, lora, batch, config=cfg)
        assert_bitwise_equal(codes, want_codes, name=f"K1 codes, {warps} warps", inputs=x)
        assert_bitwise_equal(scales, want_scales, name=f"K1 scales, {warps} warps")


@pytest.mark.parametrize("path", ["fused", "decode", "decode_serialized", "hybrid", "gemm"])
def test_counters_are_zero_at_rest_after_every_path(path):
    # Every kernel leaves the shared counters (split-K tiles in K1 and K2, the decode path's
    # count of quantized rows and of K2 programs past it) at zero; the next launch relies on
    # it. Split-K everywhere, several adapter segments per tile, a second run for repeats.
    x, weight, w_scale, lora, batch = make_problem(13, 19, 160, (32, 16, 16), 8, 4,
                                                   "mixed_with_base")
    k1 = fused.LaunchConfig(block_m=16, block_k=32, block_r=16, split_k=3)
    k2 = fused.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, split_k=2)
    runs = {
        "fused": lambda: fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                     k1_config=k1, k2_config=k2),
        "decode": lambda: fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                       k1_config=k1, k2_config=k2),
        "decode_serialized": lambda: fused.decode_lora_fp8_linear(
            x, weight, w_scale, lora, batch, k1_config=k1, k2_config=k2, pdl=False),
        "hybrid": lambda: fused.lora_expand(
            torch.zeros(19, 64, dtype=torch.bfloat16),
            fused.lora_shrink(x, lora, batch, config=k1), lora, batch, config=k2),
        "gemm": lambda: fused.fp8_gemm_from_bf16(x, weight, w_scale, config=k2),
    }
    first = runs[path]()
    counters = default_workspace(x.device).counters(0)
    assert int(counters.count_nonzero()) == 0, counters.nonzero().flatten().tolist()
    assert_bitwise_equal(runs[path](), first, name=f"{path}, second run")
    assert default_workspace(x.device).is_clean()


def test_counter_buffer_grows_before_k1_not_between_the_launches(monkeypatch):
    # Grown between K1 and K2, the buffer would put a fill kernel between K1 and its PDL
    # dependent and free K1's counters while K1 runs: the first request covers both kernels'.
    x, weight, w_scale, lora, batch = make_problem(17, 40, 64, (96,), 8, 1, "one_adapter")
    k1 = fused.LaunchConfig(block_m=16, block_k=32, block_r=16, split_k=2)
    k2 = fused.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, split_k=2)
    asked = []
    counters = Workspace.counters
    monkeypatch.setattr(Workspace, "counters",
                        lambda self, tiles: asked.append(tiles) or counters(self, tiles))
    fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1, k2_config=k2)
    k1_tiles = 2 * 3 * 1 * 1  # (entries, row tiles, rank tiles, slices)
    k2_tiles = 3 * 6  # (row tiles, column tiles)
    assert asked[0] == max(k1_tiles, k2_tiles) and max(asked) == asked[0], asked


@pytest.mark.parametrize(("slots", "one_slot"), [(1, True), (4, False)])
def test_both_kernels_look_up_one_slot_entries_only_for_one_slot(slots, one_slot, monkeypatch):
    # The table's one-slot entries (K2's epilogue, K1's row tiles differ with the slots) must
    # reach K1's lookup as well as K2's, and never a batch of several slots.
    x, weight, w_scale, lora, batch = make_problem(8, 40, 64, (96,), 8, slots, "one_adapter")
    asked = []
    select = _tiling.select_config
    monkeypatch.setattr(_tiling, "select_config", lambda *a, **kw: asked.append(
        (a[1], a[-1] if len(a) > 7 else kw.get("one_slot"))) or select(*a, **kw))
    fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert sorted(asked) == [("decode_shrink", one_slot), ("lora_gemm", one_slot)], asked
    # on the caller's codes, K1's own entries (the tuner's codes mode)
    asked.clear()
    fused.decode_lora_fp8_linear(None, weight, w_scale, lora, batch,
                                 x_quantized=fused.quantize(x))
    assert sorted(asked) == [("decode_shrink_codes", one_slot), ("lora_gemm", one_slot)], asked


@pytest.mark.parametrize("path", ["fused", "decode"])
def test_k1_rank_in_several_tiles_with_split_k(path):
    # K1 may cover the rank in several tiles (block_r < rank) while K2 holds it whole; with
    # split-K each rank tile has its own counter and reduction.
    x, weight, w_scale, lora, batch = make_problem(14, 21, 160, (32, 16), 40, 3,
                                                   "mixed_with_base")
    k1 = fused.LaunchConfig(block_m=16, block_k=32, block_r=16, split_k=3)
    k2 = fused.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=64)
    _, _, h = fused.quantize_and_shrink(x, lora, batch, config=k1)
    assert relative_error(h, reference.lora_shrink(x, lora, batch)) < 1e-5
    run = fused.fused_lora_fp8_linear if path == "fused" else fused.decode_lora_fp8_linear
    y = run(x, weight, w_scale, lora, batch, k1_config=k1, k2_config=k2)
    want = reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                           arithmetic=Fp8Arithmetic.TORCH_CPU)
    assert relative_error(y, want) < BF16_TOL


@pytest.mark.parametrize("mode", ["fused", "w8a16", "gemm"])
def test_weight_by_tma_equals_pointer_loads_bitwise(mode, monkeypatch):
    # 64-row tiles read the weight through a TMA descriptor, zero-padded past N and K: here N
    # (96 + 40) and K (208) end inside a tile, and the bits must be those of the masked pointer
    # loads (the same kernel with the descriptor switched off).
    x, weight, w_scale, lora, batch = make_problem(7, 70, 208, (96, 40), 16, 2, "mixed_with_base")
    k2 = fused.LaunchConfig(block_m=64, block_n=32, block_k=64, block_r=16, num_stages=2)
    assert _tiling.w_tma(INTERPRETER, weight, k2)
    k1 = fused.LaunchConfig(block_m=16, block_k=64, block_r=16, split_k=2, num_stages=2)
    run = {"fused": lambda: fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                        k1_config=k1, k2_config=k2),
           "w8a16": lambda: fused.fused_lora_w8a16_linear(x, weight, w_scale, lora, batch,
                                                          k1_config=k1, k2_config=k2),
           "gemm": lambda: fused.fp8_gemm_from_bf16(x, weight, w_scale, config=k2)}[mode]
    by_tma = run()
    monkeypatch.setattr(_tiling, "w_tma", lambda support, weight, cfg: False)
    assert_bitwise_equal(by_tma, run(), name="TMA vs pointer loads")


def test_weight_rows_not_16_byte_aligned_take_pointer_loads():
    weight = torch.zeros(8, 40, dtype=torch.float8_e4m3fn)[:, :36]  # rows 40 bytes apart
    k2 = fused.LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=16)
    assert not _tiling.w_tma(INTERPRETER, weight, k2)
    assert _tiling.w_tma(INTERPRETER, torch.zeros(8, 48, dtype=torch.float8_e4m3fn), k2)
    assert not _tiling.w_tma(INTERPRETER, torch.zeros(8, 48, dtype=torch.float8_e4m3fn),
                            fused.LaunchConfig(block_m=32, block_n=16, block_k=32, block_r=16))


@pytest.mark.parametrize("path", ["fused", "decode"])
@pytest.mark.parametrize("mapping", ["mixed_with_base", "reversed_runs", "one_token_each"])
def test_codes_in_adapter_order_by_tma_equal_token_order_bitwise(mapping, path, monkeypatch):
    # With 64-row tiles K1 writes its codes in adapter order and K2 reads whole row tiles by
    # TMA (the scale of the row, not of the token): the bits of token-order codes gathered by
    # pointer loads. 70 tokens: the last row tile is partial.
    x, weight, w_scale, lora, batch = make_problem(8, 70, 208, (96, 40), 16, 3, mapping)
    k2 = fused.LaunchConfig(block_m=64, block_n=32, block_k=64, block_r=16, num_stages=2)
    k1 = fused.LaunchConfig(block_m=16, block_k=64, block_r=16, split_k=2, num_stages=2)
    linear = (fused.fused_lora_fp8_linear if path == "fused" else
              fused.decode_lora_fp8_linear)
    sorted_codes = []
    launch_k1 = _launchers.launch_k1
    monkeypatch.setattr(_launchers, "launch_k1", lambda *a, **kw: sorted_codes.append(
        kw["codes_sorted"]) or launch_k1(*a, **kw))
    by_tma = linear(x, weight, w_scale, lora, batch, k1_config=k1, k2_config=k2)
    monkeypatch.setattr(_tiling, "w_tma", lambda support, weight, cfg: False)
    fused._PLANS.clear()  # the settings derived with the real w_tma
    gathered = linear(x, weight, w_scale, lora, batch, k1_config=k1, k2_config=k2)
    assert sorted_codes == [True, False]
    assert_bitwise_equal(by_tma, gathered, name="sorted codes by TMA vs token order")
    want = reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert relative_error(by_tma, want) < BF16_TOL
