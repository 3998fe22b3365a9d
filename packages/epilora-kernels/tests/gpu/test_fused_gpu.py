"""The kernels on the H200: K1's codes are vLLM's compiled codes bit for bit, outputs match the
torch reference, exact math and vLLM's own LoRA path (CUTLASS + Punica), results repeat bit for
bit, and a CUDA-graph replay gives the eager bits."""

import dataclasses

import pytest
import torch
from hypothesis import given

from epilora_kernels import _launchers, _tiling, device_support, fused, reference
from epilora_quant import Fp8Arithmetic
from epilora_testing import assert_bitwise_equal
from epilora_testing.corpora import special_activations
from epilora_testing.cuda_graphs import capture
from epilora_testing.strategies import activations

from kernel_cases import (
    MAPPINGS,
    fp64_reference,
    make_integer_problem,
    make_problem,
    record_k2_early,
    relative_error,
)

CUDA = "cuda"
SHAPES = [  # (tokens, K, output slices, rank, max_loras): qkv-, gate_up- and o-like, small
    (1, 4096, (1024, 256, 256), 64, 4),
    (16, 2048, (1024, 1024), 16, 4),
    (37, 1024, (512,), 128, 2),
    (256, 1024, (512, 128, 128), 8, 8),
    (32, 1024, (256,), 64, 32),  # 32 adapters, one token each with "one_token_each"
    (300, 1024, (512, 256, 256), 64, 8),  # K2 in prefill tiles (128x256), rank in steps
]
BF16_TOL = 1e-2


def _problem(shape, mapping, seed=0):
    t, k, slices, rank, max_loras = shape
    return make_problem(seed, t, k, slices, rank, max_loras, mapping, device=CUDA)


@pytest.mark.parametrize("mapping", sorted(MAPPINGS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-K{s[1]}-N{sum(s[2])}-r{s[3]}")
def test_fused_path_on_gpu(shape, mapping):
    x, weight, w_scale, lora, batch = _problem(shape, mapping)
    codes, scales, h = fused.quantize_and_shrink(x, lora, batch)
    want_codes, want_scales, want_h = reference.quantize_and_shrink(
        x, lora, batch, arithmetic=Fp8Arithmetic.INDUCTOR)
    assert_bitwise_equal(codes, want_codes, name="codes", inputs=x)
    assert_bitwise_equal(scales, want_scales, name="scales")
    if bool(want_h.any()):
        assert relative_error(h.sum(0), want_h.sum(0)) < 1e-5
    else:  # no token has an adapter: K1 still writes every row of h, as zeros
        assert_bitwise_equal(h.sum(0), want_h.sum(0), name="h without adapters")
    y = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch)
    exact = fp64_reference(x, weight, w_scale, codes, scales, lora, batch)
    assert relative_error(y, exact) < BF16_TOL
    want = reference.lora_fp8_gemm(codes, scales, weight, w_scale, want_h, lora, batch)
    assert relative_error(y, want) < BF16_TOL
    assert_bitwise_equal(fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch), y,
                         name="second run")


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"T{s[0]}-N{sum(s[2])}")
def test_w8a16_and_hybrid_paths_on_gpu(shape):
    x, weight, w_scale, lora, batch = _problem(shape, "mixed_with_base", seed=1)
    y = fused.fused_lora_w8a16_linear(x, weight, w_scale, lora, batch)
    exact = fp64_reference(x, weight, w_scale, None, None, lora, batch, w8a16=True)
    assert relative_error(y, exact) < BF16_TOL
    codes, scales, _ = reference.quantize_and_shrink(x, lora, batch)
    base = reference.lora_fp8_gemm(codes, scales, weight, w_scale,
                                   torch.zeros_like(fused.lora_shrink(x, lora, batch)), lora,
                                   batch)
    hybrid = fused.lora_expand(base.clone(), fused.lora_shrink(x, lora, batch), lora, batch)
    assert relative_error(hybrid, fp64_reference(x, weight, w_scale, codes, scales, lora,
                                                 batch)) < BF16_TOL


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-K{s[1]}-N{sum(s[2])}")
def test_w8a16_gemm_without_adapters_on_gpu(shape, per_channel):
    # The matched engine's FP8 linears without LoRA: x W^T in fp32, one rounding; eager calls
    # and a CUDA-graph replay give the same bits.
    x, weight, w_scale, _, _ = _problem(shape, "mixed_with_base", seed=5)
    if per_channel:
        w_scale = torch.rand(weight.shape[0], device=CUDA) * 1e-2 + 1e-3
    bias = torch.randn(weight.shape[0], device=CUDA).to(torch.bfloat16)
    y = fused.w8a16_gemm(x, weight, w_scale, bias=bias)
    exact = x.double() @ (weight.double() * w_scale.double().reshape(-1, 1)).T + bias.double()
    assert relative_error(y, exact) < BF16_TOL
    assert relative_error(y, reference.w8a16_gemm(x, weight, w_scale, bias=bias)) < BF16_TOL
    assert_bitwise_equal(fused.w8a16_gemm(x, weight, w_scale, bias=bias), y, name="second run")
    graph, out = capture(lambda: fused.w8a16_gemm(x, weight, w_scale, bias=bias))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, y, name="graph replay")


@pytest.mark.vllm
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-N{sum(s[2])}-r{s[3]}")
def test_matches_vllm_lora_path(shape):
    from vllm import _custom_ops as ops
    from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

    x, weight, w_scale, lora, batch = _problem(shape, "mixed_with_base", seed=2)
    codes, scales = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)
    y_vllm = ops.cutlass_scaled_mm(codes, weight.t(), scales, w_scale, torch.bfloat16)
    buf = torch.zeros(len(lora.output_slices), x.shape[0], lora.max_rank, dtype=torch.float32,
                      device=CUDA)
    meta = batch.vllm_meta_args()
    lora_shrink(x, list(lora.lora_a), buf, *meta, 1.0)
    lora_expand(buf, list(lora.lora_b), y_vllm, *meta, offset_start=0, add_inputs=True)
    y = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    # The same roundings in the same order (vLLM's expand's); the base GEMMs and the shrinks
    # sum in other orders.
    assert relative_error(y, y_vllm) < BF16_TOL


@pytest.mark.parametrize("case", sorted(special_activations(torch.float32)))
def test_k1_codes_on_special_values_equal_vllm_compiled_arithmetic(case):
    x = special_activations(torch.bfloat16, rows=6, cols=1024)[case].to(CUDA)
    _, _, lora, batch = _problem((6, 1024, (256,), 16, 2), "mixed_with_base")[1:]
    codes, scales, _ = fused.quantize_and_shrink(x, lora, batch)
    want_codes, want_scales = reference.quantize_and_shrink(x, lora, batch)[:2]
    assert_bitwise_equal(codes, want_codes, name="codes", inputs=x)
    assert_bitwise_equal(scales, want_scales, name="scales")


def test_cuda_graph_replay_equals_eager():
    x, weight, w_scale, lora, batch = _problem(SHAPES[0], "mixed_with_base", seed=3)
    eager = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    graph, out = capture(lambda: fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, eager, name="graph replay")


@given(x=activations(dtypes=(torch.bfloat16,), max_rows=40, col_multiple=64, max_col_blocks=16))
def test_k1_codes_property_equal_vllm_compiled_arithmetic(x):
    t, k = x.shape
    x = x.to(CUDA)
    _, _, lora, batch = _problem((t, k, (256,), 16, 2), "mixed_with_base")[1:]
    codes, scales, _ = fused.quantize_and_shrink(x, lora, batch)
    want_codes, want_scales = reference.quantize_and_shrink(x, lora, batch)[:2]
    assert_bitwise_equal(codes, want_codes, name="codes", inputs=x)
    assert_bitwise_equal(scales, want_scales, name="scales")


@pytest.mark.parametrize("k", [4096, 12288, 16384 + 64], ids=["4096", "12288", "chunked"])
def test_quantize_equals_vllm_compiled_arithmetic_on_model_widths(k):
    # The quantizer alone (the decode path's first kernel): rows up to 16384 in one pass from
    # registers, longer ones in chunks; special rows first, then random rows.
    special = special_activations(torch.bfloat16, rows=4, cols=k)
    x = torch.cat([*special.values(),
                   torch.randn(8, k, generator=torch.Generator().manual_seed(k)).to(
                       torch.bfloat16) * 3]).to(CUDA)
    codes, scales = fused.quantize(x)
    want_codes, want_scales = reference.quantize(x)
    assert_bitwise_equal(codes, want_codes, name="codes", inputs=x)
    assert_bitwise_equal(scales, want_scales, name="scales")
    k1_codes, k1_scales, _ = fused.quantize_and_shrink(
        x, *_problem((x.shape[0], k, (256,), 16, 2), "mixed_with_base")[3:])
    assert_bitwise_equal(k1_codes, codes, name="K1 codes vs quantize")
    assert_bitwise_equal(k1_scales, scales, name="K1 scales vs quantize")


@pytest.mark.parametrize("block", [(64, 64, 128, 4), (128, 128, 128, 8), (64, 128, 256, 4)],
                         ids=lambda b: "x".join(map(str, b[:3])))
def test_weight_by_tma_equals_pointer_loads_bitwise(block, monkeypatch):
    # Prefill tiles read the weight by TMA (zero-padded past N and K): the same bits as the
    # masked pointer loads, with tails in N (6144 + 40) and K (4096 + 48).
    block_m, block_n, block_k, warps = block
    x, weight, w_scale, lora, batch = _problem((200, 4144, (6144, 40), 128, 2),
                                               "mixed_with_base", seed=3)
    k2 = fused.LaunchConfig(block_m=block_m, block_n=block_n, block_k=block_k, block_r=128,
                            num_warps=warps, num_stages=3)
    assert _tiling.w_tma(device_support(weight.device), weight, k2)
    by_tma = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k2_config=k2)
    gemm_by_tma = fused.fp8_gemm_from_bf16(x, weight, w_scale, config=k2)
    monkeypatch.setattr(_tiling, "w_tma", lambda support, weight, cfg: False)
    fused._PLANS.clear()  # the settings derived with the real w_tma
    assert_bitwise_equal(by_tma, fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                             k2_config=k2), name="fused")
    assert_bitwise_equal(gemm_by_tma, fused.fp8_gemm_from_bf16(x, weight, w_scale, config=k2),
                         name="gemm")


@pytest.mark.parametrize("tiles", [(64, 32, 128, 4, 4, 3), (64, 32, 64, 4, 4, 4),
                                   (128, 64, 64, 8, 8, 3)], ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("shape", [(2048, 4096, (4096, 1024, 1024), 64, 1),
                                   (300, 4096, (12288, 12288), 64, 2),
                                   (512, 1024, (512, 256, 256), 16, 8)],
                         ids=lambda s: f"T{s[0]}-S{len(s[2])}-r{s[3]}-l{s[4]}")
def test_k1_with_every_slice_in_one_program_gives_the_same_bits(shape, tiles):
    # LaunchConfig.slices_together: each slice's sum in the same tiles and K order as a program
    # of its own (the same bits, here on random operands too), a third or half the programs.
    x, weight, w_scale, lora, batch = _problem(shape, "mixed_with_base", seed=4)
    bm, br, bk, split, warps, stages = tiles
    apart = fused.LaunchConfig(block_m=bm, block_r=br, block_k=bk, split_k=split,
                               num_warps=warps, num_stages=stages)
    together = dataclasses.replace(apart, slices_together=True)
    want = fused.quantize_and_shrink(x, lora, batch, config=apart)
    got = fused.quantize_and_shrink(x, lora, batch, config=together)
    for name, a, b in zip(("codes", "scales", "h"), got, want, strict=True):
        assert_bitwise_equal(a, b, name=name)
    assert_bitwise_equal(
        fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=together),
        fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=apart),
        name="fused path")


@pytest.mark.parametrize("shape", [(8, 4096, (12288, 12288), 16, 8),
                                   (16, 4096, (4096,), 64, 32),
                                   (256, 1024, (512, 128, 128), 128, 32)],
                         ids=lambda s: f"T{s[0]}-N{sum(s[2])}-r{s[3]}-l{s[4]}")
def test_the_segment_loop_in_flight_gives_the_same_bits(shape):
    # LaunchConfig.segment_stages: K2's loop over adapter segments with several slices of B in
    # flight sums the same segments in the same order (the same bits, random operands), on the
    # decode and fused paths, eager and in a CUDA graph; each token its own adapter.
    x, weight, w_scale, lora, batch = _problem(shape, "one_token_each", seed=5)
    k1, k2 = fused.decode_settings(x, weight, w_scale, lora, batch)
    deep = dataclasses.replace(k2, segment_stages=_tiling.segment_stages(k2))
    assert deep.segment_stages > 1
    for path in (fused.decode_lora_fp8_linear, fused.fused_lora_fp8_linear):
        want = path(x, weight, w_scale, lora, batch, k1_config=k1, k2_config=k2)
        got = path(x, weight, w_scale, lora, batch, k1_config=k1, k2_config=deep)
        assert_bitwise_equal(got, want, name=f"{path.__name__} in flight")
        graph, out = capture(lambda path=path: path(x, weight, w_scale, lora, batch,
                                                    k1_config=k1, k2_config=deep))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, want, name=f"{path.__name__} in flight, graph")


@pytest.mark.parametrize("shape", [(8, 4096, (4096, 1024, 1024), 16, 8),
                                   (16, 4096, (12288, 12288), 16, 8),
                                   (32, 12288, (4096,), 64, 32)],
                         ids=lambda s: f"T{s[0]}-N{sum(s[2])}-r{s[3]}-l{s[4]}")
def test_k2_gathering_each_rows_adapter_gives_the_reference_bits(shape, monkeypatch):
    # EPILORA_GATHER_SEGMENTS: decode tiles of several slots add each row's adapter by its own
    # slot, summed in registers over rank steps. On integer-valued operands (exact in fp32) the
    # reference's bits, swapped tiles or not, eager and in a CUDA graph; on random operands
    # the decode path within rounding of the segment loop's (the rank summed in another order).
    monkeypatch.setenv("EPILORA_GATHER_SEGMENTS", "1")
    t, k, slices, rank, slots = shape
    _, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(
        7, t, k, slices, rank, slots, "one_token_each", device=CUDA)
    want = reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch)
    for swap in (False, True):
        cfg = fused.LaunchConfig(block_m=16 if t <= 16 else 32, block_n=64, block_k=128,
                                 block_r=rank, num_stages=4, swap_ab=swap)
        assert _tiling.gather_segments(cfg, batch.num_entries, rank) > 0
        got = fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=cfg)
        assert_bitwise_equal(got, want, name=f"gathering K2 (swapped {swap})")
        graph, out = capture(lambda cfg=cfg: fused.lora_fp8_gemm(
            codes, scales, weight, w_scale, h, lora, batch, config=cfg))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, want, name=f"gathering K2 (swapped {swap}), graph")
    x, weight, w_scale, lora, batch = _problem(shape, "one_token_each", seed=5)
    k2 = fused.decode_settings(x, weight, w_scale, lora, batch)[1]
    assert _tiling.gather_segments(k2, batch.num_entries, rank) > 0  # the decode path gathers
    gathered = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
    monkeypatch.setenv("EPILORA_GATHER_SEGMENTS", "0")  # a template of its own (its key)
    segments = fused.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert relative_error(gathered, segments) < 1e-2


@pytest.mark.parametrize("shape", [(300, 1024, (512, 256, 256), 64, 1),
                                   (512, 4096, (12288, 12288), 16, 1),
                                   (520, 2048, (4096, 1024, 1024), 128, 1),
                                   (512, 4096, (4096, 1024, 1024), 16, 8),
                                   (2048, 1024, (1024,), 64, 8)],
                         ids=lambda s: f"T{s[0]}-N{sum(s[2])}-r{s[3]}-l{s[4]}")
def test_k2_epilogue_in_halves_gives_the_bits_of_the_term_parked_in_y(shape, monkeypatch):
    # EPILORA_EPILOGUE_HALVES=all: prefill tiles keep the rounded base in registers and add the
    # delta half the tile's columns at a time: the same sums as the shipped epilogue, which
    # parks one term in y, so the same bits, in 128 x 256 and 64 x 128 tiles and the
    # launchers' own (which take the halves only where their tiles have 64 rows or more),
    # eager and in a CUDA graph. (Integer-valued operands are no exact check here: these tiles
    # sum FP8 products on wgmma in reduced precision.)
    t, k, slices, rank, slots = shape
    mapping = "mixed_with_base" if slots == 1 else "reversed_runs"
    tiles = [fused.LaunchConfig(block_m=128, block_n=256, block_k=128, block_r=rank,
                                num_warps=8, num_stages=3),
             fused.LaunchConfig(block_m=64, block_n=128, block_k=128, block_r=rank,
                                num_stages=3)]
    x, weight, w_scale, lora, batch = _problem(shape, mapping, seed=5)
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "all")
    assert all(_tiling.epilogue_halves(cfg, batch.num_entries, fp8=True) for cfg in tiles)
    runs = {}
    for setting in ("all", "0"):  # each a template of its own (its key)
        monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", setting)
        runs[setting] = [fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                     k2_config=cfg) for cfg in [*tiles, None]]
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "all")
    for cfg, halves, parked in zip([*tiles, None], runs["all"], runs["0"], strict=True):
        _check_fused_eager_and_graph(x, weight, w_scale, lora, batch, cfg, halves, parked,
                                     "K2 in halves")


def _check_fused_eager_and_graph(x, weight, w_scale, lora, batch, cfg, eager, want, what):
    # `eager` (the fused path in K2 settings `cfg`, None: the launchers') has `want`'s bits,
    # and so has the same call replayed from a CUDA graph.
    name = "the launchers' tiles" if cfg is None else f"{cfg.block_m} x {cfg.block_n}"
    assert_bitwise_equal(eager, want, name=f"{what}, {name}")
    graph, out = capture(lambda: fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                                             k2_config=cfg))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, want, name=f"{what}, {name}, graph")


@pytest.mark.parametrize("shape", [(256, 4096, (12288, 12288), 16, 1),
                                   (512, 4096, (4096, 1024, 1024), 16, 1),
                                   (256, 4096, (4096,), 32, 1),
                                   (2048, 4096, (4096,), 16, 1)],
                         ids=lambda s: f"T{s[0]}-N{sum(s[2])}-r{s[3]}")
def test_the_epilogue_operands_loaded_early_give_the_halves_bits(shape, monkeypatch):
    # EPILORA_EPILOGUE_EARLY=1: one slot's halves from h's and B's tiles loaded before the K
    # loop (the fused path: K2 waits for all of K1 first), the same sums as loaded after it:
    # the same bits, in the launchers' own tiles and a 64 x 64 one, eager and in a CUDA graph
    t, k, slices, rank, slots = shape
    x, weight, w_scale, lora, batch = _problem(shape, "mixed_with_base", seed=7)
    tiles = [None, fused.LaunchConfig(block_m=64, block_n=64, block_k=128, block_r=rank,
                                      num_stages=4)]
    monkeypatch.setenv("EPILORA_EPILOGUE_EARLY", "0")
    after = [fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k2_config=cfg)
             for cfg in tiles]
    monkeypatch.setenv("EPILORA_EPILOGUE_EARLY", "1")  # templates of their own (their key)
    early_kernels = record_k2_early(monkeypatch)  # did the rule take each K2's tile?
    for cfg, want in zip(tiles, after, strict=True):
        early = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k2_config=cfg)
        _check_fused_eager_and_graph(x, weight, w_scale, lora, batch, cfg, early, want,
                                     "K2, operands early")
    assert early_kernels and all(early_kernels), early_kernels


# Shapes whose fused path takes the delta first in the launchers' own tiles on any sm_90
# table: beyond 256 tokens prefill tiles (K whole), or 256 tokens in 64-row tiles that fill
# the SMs. (At 130 tokens on 512 x 1024 the launchers split K in two, 48 programs, and no
# delta kernel runs: the case this test had before 2026-12-06's H100 run, where it failed.)
@pytest.mark.parametrize("shape", [(300, 1024, (512, 256, 256), 64, 8),
                                   (256, 4096, (4096, 1024, 1024), 64, 32),
                                   (300, 1024, (512,), 8, 4),
                                   (520, 2048, (4096, 1024, 1024), 128, 8)],
                         ids=lambda s: f"T{s[0]}-N{sum(s[2])}-r{s[3]}-l{s[4]}")
def test_the_delta_kernel_gives_the_delta_firsts_answer(shape, monkeypatch):
    # EPILORA_DELTA_KERNEL=1: several slots' delta written into y by a kernel of its own, K2
    # adding it, against K2 summing it before its K loop (DELTA_FIRST). Integer-valued
    # operands (K2 given h): both deltas exact, the base the same GEMM, so the same bits in
    # 64- and 128-row tiles and the launchers' own. Random operands through the fused path
    # (K1, the delta kernel, K2 as a PDL dependent beyond 32 tokens): the deltas' MMAs differ
    # (16-row tiles against 64 or 128), so within bf16's rounding; a CUDA graph's replay
    # gives the eager bits.
    t, k, slices, rank, slots = shape
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "0")  # the delta goes first wherever it can
    tiles = [fused.LaunchConfig(block_m=128, block_n=256 if min(slices) >= 256 else 128,
                                block_k=128, block_r=max(16, rank), num_warps=8, num_stages=3),
             fused.LaunchConfig(block_m=64, block_n=128, block_k=128, block_r=max(16, rank),
                                num_stages=3), None]
    _, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(
        3, t, k, slices, rank, slots, "one_token_each", device=CUDA)
    runs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("EPILORA_DELTA_KERNEL", setting)
        runs[setting] = [fused.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch,
                                             config=cfg) for cfg in tiles]
    for cfg, kernel, first in zip(tiles, runs["1"], runs["0"], strict=True):
        name = "the launchers' tiles" if cfg is None else f"{cfg.block_m} x {cfg.block_n}"
        assert_bitwise_equal(kernel, first, name=f"delta kernel vs delta first, {name}")
    x, weight, w_scale, lora, batch = _problem(shape, "reversed_runs", seed=7)
    monkeypatch.setenv("EPILORA_DELTA_KERNEL", "0")
    first = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    monkeypatch.setenv("EPILORA_DELTA_KERNEL", "1")
    launched, real = [], _launchers.launch_delta

    def launch_delta(*args):
        launched.append(1)
        real(*args)

    monkeypatch.setattr(_launchers, "launch_delta", launch_delta)
    eager = fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert launched == [1]
    assert relative_error(eager, first) < 1e-3
    graph, out = capture(lambda: fused.fused_lora_fp8_linear(x, weight, w_scale, lora, batch))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, eager, name="the fused path with the delta kernel, graph")
