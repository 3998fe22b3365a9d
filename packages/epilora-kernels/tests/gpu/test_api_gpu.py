"""The public API on the H200: the dispatcher and every path against the reference, K2 bit for
bit on integer-valued operands with each row's adapter delta, the caller-owned workspace inside
CUDA graphs, and a stress test of the decode path's hand-off from K1's generic stores to K2's
TMA loads (thousands of back-to-back launches over varied batches, every output compared bit
for bit with the serialized launch's)."""

import functools

import pytest
import torch
import triton
import triton.language as tl

import epilora_kernels as ek
from epilora_kernels import reference
from epilora_testing import assert_bitwise_equal
from epilora_testing.cuda_graphs import capture

from kernel_cases import (
    check_k2_adds_the_adapters_as_vllms_expand,
    check_the_bias_is_added_before_rounding,
    exact_codes,
    exact_lora_delta,
    make_integer_problem,
    make_problem,
    pad_batch,
    relative_error,
    vllm_layout_batch,
)

CUDA = "cuda"
BF16_TOL = 1e-2


def test_the_device_has_pdl_and_tma():
    support = ek.device_support(CUDA)
    assert support.capability == (9, 0) and support.pdl and support.tma and support.fp8_mma
    assert ek.supports("decode", in_features=4096, output_slices=(4096, 1024, 1024),
                       max_rank=64)


@pytest.mark.parametrize("path", [None, *ek.PATHS])
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_lora_linear_on_every_path_matches_the_reference(path, tokens):
    x, weight, w_scale, lora, batch = make_problem(0, tokens, 4096, (4096, 1024, 1024), 64, 4,
                                                   "mixed_with_base", device=CUDA)
    y = ek.lora_linear(x, weight, w_scale, lora, batch, path=path)
    want = (reference.fused_lora_w8a16_linear(x, weight, w_scale, lora, batch)
            if path == "w8a16" else
            reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch))
    assert relative_error(y, want) < BF16_TOL
    again = ek.lora_linear(x, weight, w_scale, lora, batch, path=path)
    assert_bitwise_equal(again, y, name="repeat")


@pytest.mark.parametrize("path", [None, *ek.PATHS])
@pytest.mark.parametrize(("tokens", "padded"), [(3, 8), (40, 48), (300, 320)])
def test_rows_padded_past_the_counted_tokens(path, tokens, padded):
    # A CUDA graph's batch padded past vLLM's metadata (stale, out-of-range sorted indices in
    # the padding; 40 and 300 tokens read K1's codes by TMA in adapter order).
    x, weight, w_scale, lora, batch = make_problem(5, tokens, 4096, (4096, 1024, 1024), 64, 4,
                                                   "mixed_with_base", device=CUDA)
    xp, padded_batch = pad_batch(x, batch, padded)
    y = ek.lora_linear(xp, weight, w_scale, lora, padded_batch, path=path)
    torch.cuda.synchronize()
    ref = (reference.fused_lora_w8a16_linear if path == "w8a16"
           else reference.fused_lora_fp8_linear)
    assert relative_error(y[:tokens], ref(x, weight, w_scale, lora, batch)) < BF16_TOL
    no_adapter = ek.AdapterBatch.from_token_mapping(
        torch.full((padded,), -1, dtype=torch.int32, device=CUDA), 4)
    base = ref(xp, weight, w_scale, lora, no_adapter)
    assert relative_error(y[tokens:], base[tokens:]) < BF16_TOL


@pytest.mark.parametrize("path", ["decode", "fused"])
@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_activations_quantized_by_the_caller(path, tokens):
    # vLLM's compiled RMSNorm + quantization makes the codes; K1 only shrinks, K2 reads them
    # from the start. Codes equal to K1's own give K1's result (bit for bit up to 32 tokens,
    # where both read the codes in token order; beyond, K1's own are read by TMA in adapter
    # order).
    x, weight, w_scale, lora, batch = make_problem(6, tokens, 4096, (4096, 1024, 1024), 64, 4,
                                                   "mixed_with_base", device=CUDA)
    given = ek.quantize(x)
    y = ek.lora_linear(x, weight, w_scale, lora, batch, path=path, x_quantized=given)
    own = ek.lora_linear(x, weight, w_scale, lora, batch, path=path)
    if tokens <= 32:
        assert_bitwise_equal(y, own, name="caller's codes")
    want = reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, x_quantized=given)
    assert relative_error(y, want) < BF16_TOL


@pytest.mark.parametrize("path", ["decode", "fused"])
@pytest.mark.parametrize("tokens", [8, 300])
def test_launches_past_triton_give_tritons_bits_and_respecialize(path, tokens):
    # The first call goes through Triton's launch, a repeat straight to its compiled kernels
    # (K1's and K2's launch templates, `_fast_launch.Template`): the same bits. Codes 8 bytes
    # past an aligned address specialize differently (Triton compiles unaligned loads for
    # them): kernels of their own, not the aligned ones, and the same bits again.
    from epilora_kernels import _launchers

    def remembered() -> int:
        return sum(len(template._compiled) for templates in (_launchers._K1_TEMPLATES,
                                                               _launchers._K2_TEMPLATES)
                   for template in templates.values())

    _, _, _, weight, w_scale, _, lora, batch = make_integer_problem(
        18, tokens, 4096, (4096, 1024, 1024), 64, 4, "mixed_with_base", device=CUDA)
    codes, scales, _ = exact_codes(18, tokens, 4096, device=CUDA)
    _launchers._K1_TEMPLATES.clear()
    _launchers._K2_TEMPLATES.clear()
    first = ek.lora_linear(None, weight, w_scale, lora, batch, path=path,
                           x_quantized=(codes, scales))
    assert remembered() == 2  # K1 and K2
    again = ek.lora_linear(None, weight, w_scale, lora, batch, path=path,
                           x_quantized=(codes, scales))
    assert remembered() == 2
    assert_bitwise_equal(again, first, name="past Triton")
    # Other codes through the remembered kernels: their own output (no stale input pointer),
    # that of Triton's launch on them.
    other = codes.view(torch.uint8).flip(0).contiguous().view(torch.float8_e4m3fn)
    past = ek.lora_linear(None, weight, w_scale, lora, batch, path=path,
                          x_quantized=(other, scales))
    assert remembered() == 2
    _launchers._K1_TEMPLATES.clear()
    _launchers._K2_TEMPLATES.clear()
    through = ek.lora_linear(None, weight, w_scale, lora, batch, path=path,
                             x_quantized=(other, scales))
    assert_bitwise_equal(past, through, name="other codes past Triton")
    assert not torch.equal(past, first)
    remembered_before = remembered()
    shifted = torch.empty(codes.numel() + 8, dtype=torch.uint8, device=CUDA)[8:]
    shifted = shifted.view(torch.float8_e4m3fn).view(tokens, 4096)
    shifted.copy_(codes)
    assert shifted.data_ptr() % 16 == 8
    unaligned = ek.lora_linear(None, weight, w_scale, lora, batch, path=path,
                               x_quantized=(shifted, scales))
    assert remembered() == remembered_before + 2
    assert_bitwise_equal(unaligned, first, name="unaligned codes")


@pytest.mark.parametrize("path", ["decode", "fused"])
@pytest.mark.parametrize("tokens", [40, 300])
def test_a_new_token_count_takes_the_templates_and_kernels_triton_would(path, tokens):
    # The token count is a template's slot (an engine's eager steps come with ever new counts):
    # one more token, in the same specialization (neither 1 nor a multiple of 16) and the same
    # launch settings, launches through the templates made for `tokens`, on their compiled
    # kernels; Triton, asked by name with the templates gone, compiles nothing new either but
    # returns those very kernels, and its launch gives the same bits.
    from epilora_kernels import _launchers

    def compiled() -> list:
        return [kernel for templates in (_launchers._K1_TEMPLATES, _launchers._K2_TEMPLATES)
                for template in templates.values() for kernel in template._compiled.values()]

    def call(t: int):
        _, _, _, weight, w_scale, _, lora, batch = make_integer_problem(
            19, t, 4096, (4096, 1024, 1024), 64, 4, "mixed_with_base", device=CUDA)
        codes, scales, _ = exact_codes(19, t, 4096, device=CUDA)
        return ek.lora_linear(None, weight, w_scale, lora, batch, path=path,
                              x_quantized=(codes, scales))

    _launchers._K1_TEMPLATES.clear()
    _launchers._K2_TEMPLATES.clear()
    call(tokens)
    first = compiled()
    assert len(first) == 2  # K1 and K2
    templates = (len(_launchers._K1_TEMPLATES), len(_launchers._K2_TEMPLATES))
    past = call(tokens + 1)
    assert (len(_launchers._K1_TEMPLATES), len(_launchers._K2_TEMPLATES)) == templates
    assert compiled() == first
    _launchers._K1_TEMPLATES.clear()
    _launchers._K2_TEMPLATES.clear()
    through = call(tokens + 1)
    assert all(a is b for a, b in zip(compiled(), first, strict=True))
    assert_bitwise_equal(past, through, name="a new token count past Triton")


@pytest.mark.parametrize("path", ["decode", "fused"])
@pytest.mark.parametrize("tokens", [1, 8, 40, 64, 300])
def test_codes_alone_make_h_in_eager_and_in_a_graph(path, tokens):
    # x=None: the shrink reads the caller's codes (an engine that keeps no bf16 x). Integer
    # codes and power-of-two scales make x = codes * scales exact in bf16, so the same call
    # given that x forms the same sums: equal bit for bit, eager and replayed in a CUDA graph.
    _, _, _, weight, w_scale, _, lora, batch = make_integer_problem(
        16, tokens, 4096, (4096, 1024, 1024), 64, 4, "mixed_with_base", device=CUDA)
    codes, scales, x = exact_codes(16, tokens, 4096, device=CUDA)
    given = (codes, scales)
    y = ek.lora_linear(None, weight, w_scale, lora, batch, path=path, x_quantized=given)
    assert_bitwise_equal(y, ek.lora_linear(x, weight, w_scale, lora, batch, path=path,
                                           x_quantized=given), name="codes vs x")
    want = reference.fused_lora_fp8_linear(None, weight, w_scale, lora, batch,
                                           x_quantized=given)
    assert relative_error(y, want) < BF16_TOL
    workspace = ek.Workspace.for_batches(CUDA, max_tokens=tokens, max_out_features=6144,
                                         max_rank=64, max_loras=4)
    graph, out = capture(lambda: ek.lora_linear(None, weight, w_scale, lora, batch, path=path,
                                                x_quantized=given, workspace=workspace))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, y, name="graph replay")


@pytest.mark.parametrize("path", ek.PATHS)
@pytest.mark.parametrize("tokens", [4, 300])
def test_per_channel_weight_scales_on_every_path(path, tokens):
    x, weight, w_scale, lora, batch = make_problem(2, tokens, 4096, (4096, 1024, 1024), 64, 4,
                                                   "mixed_with_base", device=CUDA,
                                                   per_channel=True)
    y = ek.lora_linear(x, weight, w_scale, lora, batch, path=path)
    want = (reference.fused_lora_w8a16_linear(x, weight, w_scale, lora, batch)
            if path == "w8a16" else
            reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch))
    assert relative_error(y, want) < BF16_TOL
    assert_bitwise_equal(ek.lora_linear(x, weight, w_scale.reshape(-1, 1), lora, batch,
                                        path=path), y, name="[N, 1] vs [N] scales")


K2_GPU = {
    "decode-tile": ek.LaunchConfig(block_m=16, block_n=32, block_k=256, block_r=64,
                                   num_stages=4),
    "split-k": ek.LaunchConfig(block_m=16, block_n=64, block_k=128, block_r=64, split_k=4),
    "prefill-tma": ek.LaunchConfig(block_m=64, block_n=64, block_k=128, block_r=64),
    "wide-tma": ek.LaunchConfig(block_m=128, block_n=128, block_k=128, block_r=64,
                                num_warps=8),
    "prefill": ek.LaunchConfig(block_m=128, block_n=128, block_k=128, block_r=64,
                               num_warps=8, num_stages=3),
    # the transposed product (wgmma's 64 x 16 and 64 x 32 tiles, the weight by TMA)
    "swap-ab": ek.LaunchConfig(block_m=16, block_n=64, block_k=64, block_r=64, num_stages=6,
                               swap_ab=True),
    "swap-ab-split": ek.LaunchConfig(block_m=32, block_n=128, block_k=32, block_r=64,
                                     split_k=2, num_stages=4, swap_ab=True),
}


@pytest.mark.parametrize("cfg", K2_GPU)
@pytest.mark.parametrize("mapping", ["one_adapter", "mixed_with_base", "one_token_each"])
@pytest.mark.parametrize("tokens", [3, 40, 200, 300])
def test_k2_bitwise_on_integer_operands_and_every_rows_delta(tokens, mapping, cfg):
    # Rank 16 over K = 64: every output an integer below 256 in magnitude, exact in bf16, so
    # y - (y without adapters) is each row's delta exactly.
    x, codes, scales, weight, w_scale, h, lora, batch = make_integer_problem(
        1, tokens, 64, (256, 128, 128), 16, 8, mapping, device=CUDA)
    k2 = K2_GPU[cfg]
    y = ek.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora, batch, config=k2)
    assert_bitwise_equal(y, reference.lora_fp8_gemm(codes, scales, weight, w_scale, h, lora,
                                                    batch), name="K2 vs reference")
    base = ek.fp8_gemm(codes, scales, weight, w_scale, config=k2)
    delta = y.double().cpu() - base.double().cpu()
    want = exact_lora_delta(h, lora, batch)
    wrong = [row for row in range(tokens) if not torch.equal(delta[row], want[row])]
    assert not wrong, f"rows with a wrong adapter delta: {wrong[:8]}"



@pytest.mark.vllm
@pytest.mark.parametrize("cfg", K2_GPU)
@pytest.mark.parametrize("tokens", [3, 300])
def test_k2_adds_the_adapters_as_vllms_expand(tokens, cfg):
    check_k2_adds_the_adapters_as_vllms_expand(K2_GPU[cfg], seed=5, tokens=tokens,
                                               widths=(256, 128, 128), device=CUDA)


@pytest.mark.parametrize(("path", "tokens"), [("decode", 2), ("decode", 16), ("fused", 16),
                                              ("fused", 256), ("w8a16", 16), ("w8a16", 256)])
@pytest.mark.parametrize("bound", [False, True], ids=["lora_linear", "projection"])
def test_every_path_adds_the_bias_before_rounding(path, tokens, bound):
    # Qwen2's biased qkv: the bias in K2's epilogue, in fp32 before the base is rounded (the
    # 256-token tiles of these four slots sum the delta first, DELTA_FIRST). K = 512 keeps
    # every FP8 sum exact in wgmma's accumulator.
    check_the_bias_is_added_before_rounding(path, tokens, device=CUDA, bound=bound, k=512,
                                            widths=(2048, 512, 512), rank=64)


@pytest.mark.parametrize("tokens", [16, 300])
def test_the_hybrid_paths_default_base_gemm_adds_the_bias(tokens):
    # cuBLASLt's epilogue (torch._scaled_mm's bias, bf16) is not our arithmetic: near the
    # reference with the bias, far from it without.
    x, weight, w_scale, lora, batch = make_problem(3, tokens, 4096, (4096, 1024, 1024), 64, 4,
                                                   "mixed_with_base", device=CUDA)
    unbiased = reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    bias = (torch.randn(6144, generator=torch.Generator().manual_seed(3)).to(CUDA)
            * unbiased.float().std()).to(torch.bfloat16)  # as large as the outputs
    y = ek.lora_linear(x, weight, w_scale, lora, batch, path="hybrid", bias=bias)
    want = reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, bias=bias)
    assert relative_error(y, want) < BF16_TOL
    assert relative_error(y, unbiased) > 0.5


def test_the_callers_workspace_in_cuda_graphs():
    # Sized before capture for every batch the graphs will see, frozen by the capture; graphs
    # of several sizes and paths share it, replayed in turns: each gives its eager bits.
    ws = ek.Workspace.for_batches(CUDA, max_tokens=256, max_out_features=6144, max_rank=128,
                                  max_loras=4)
    sized = ws.tiles
    graphs = []
    for tokens, path in ((1, "decode"), (16, "decode"), (64, "decode"), (200, "fused"),
                         (256, "w8a16"), (48, None)):
        x, weight, w_scale, lora, batch = make_problem(tokens, tokens, 4096, (4096, 1024, 1024),
                                                       128, 4, "mixed_with_base", device=CUDA)

        def call(x=x, weight=weight, w_scale=w_scale, lora=lora, batch=batch, path=path):
            return ek.lora_linear(x, weight, w_scale, lora, batch, path=path, workspace=ws)

        eager = call()
        graph, out = capture(call)
        # the graph reads its inputs where they were: keep them (the closure holds them) alive
        graphs.append((graph, out, eager, f"{tokens} tokens, {path}", call))
    assert ws.tiles == sized  # sized before capture: it never had to grow
    for _ in range(3):
        for graph, out, eager, name, _ in graphs:
            graph.replay()
            torch.cuda.synchronize()
            assert_bitwise_equal(out, eager, name=name)
            assert ws.is_clean(), name


def test_a_workspace_grows_between_captures_and_keeps_what_graphs_captured():
    # A captured graph keeps its counter buffer: an eager launch that needs more gets a larger
    # one, and the graph still replays its bits; a capture that needs more is refused.
    x, weight, w_scale, lora, batch = make_problem(0, 256, 1024, (4096,), 16, 2, "one_adapter",
                                                   device=CUDA)
    small, large = x[:64], x
    small_batch = ek.AdapterBatch.from_token_mapping(batch.token_lora_mapping[:64], 2)
    split = ek.LaunchConfig(block_m=16, block_n=16, block_k=128, block_r=16, split_k=4)
    ws = ek.Workspace(CUDA, tiles=0)

    def run(x, batch):
        return ek.lora_fp8_gemm(*ek.quantize(x), weight, w_scale, ek.lora_shrink(x, lora, batch),
                                lora, batch, config=split, workspace=ws)

    eager_small = run(small, small_batch)
    graph, out = capture(lambda: run(small, small_batch))
    captured = ws.counters(0)
    eager_large = run(large, batch)  # 16 x 256 tiles: more than the 4094 it had
    assert ws.counters(0) is not captured and ws.tiles >= 4096
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, eager_small, name="graph after the workspace grew")
    assert_bitwise_equal(run(large, batch), eager_large, name="eager after growing")
    ws.freeze()
    bigger = torch.cat([x, x])
    bigger_batch = ek.AdapterBatch.from_token_mapping(torch.cat([batch.token_lora_mapping] * 2),
                                                      2)
    with pytest.raises(ek.WorkspaceTooSmall, match="frozen"):
        run(bigger, bigger_batch)
    assert ws.is_clean()


# The stress test's batches: decode-sized and beyond 32 tokens (64-row K2 tiles reading K1's
# codes by TMA after the count), one slot and several, rows of every width the models have.
STRESS = [(1, 1, "one_adapter"), (5, 4, "mixed_with_base"), (16, 1, "one_adapter"),
          (33, 4, "one_token_each"), (64, 1, "one_adapter"), (100, 4, "reversed_runs"),
          (200, 8, "mixed_with_base"), (256, 1, "one_adapter")]
STRESS_K2 = ek.LaunchConfig(block_m=64, block_n=64, block_k=128, block_r=64, num_stages=3)
STRESS_K1 = ek.LaunchConfig(block_m=64, block_k=128, block_r=64, split_k=4, num_warps=8)
STRESS_ROUNDS = 400  # x 8 batches: 3200 launches of the decode path


def _stress_k2(tokens: int, swapped: bool) -> ek.LaunchConfig | None:
    # K2 reading K1's codes by TMA: 64-row tiles beyond 32 tokens (the launchers' own below),
    # or swapped tiles of 16 and 32 rows at every count
    if swapped:
        return ek.LaunchConfig(block_m=16 if tokens <= 16 else 32, block_n=64, block_k=256,
                               block_r=64, num_stages=6, swap_ab=True)
    return STRESS_K2 if tokens > 32 else None


@pytest.mark.parametrize("swapped", [False, True], ids=["64-row-tiles", "swapped-tiles"])
def test_stress_decode_handoff_to_tma_bitwise_over_thousands_of_launches(swapped):
    cases = []
    for seed, (tokens, slots, mapping) in enumerate(STRESS):
        x, weight, w_scale, lora, batch = make_problem(seed, tokens, 4096, (2048, 512, 512), 64,
                                                       slots, mapping, device=CUDA)
        kwargs = {"k1_config": STRESS_K1 if tokens > 32 else None,
                  "k2_config": _stress_k2(tokens, swapped)}
        want = ek.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, pdl=False, **kwargs)
        cases.append((x, weight, w_scale, lora, batch, kwargs, want.view(torch.int16)))
    ws = ek.Workspace.for_batches(CUDA, max_tokens=256, max_out_features=3072, max_rank=64,
                                  max_loras=8)
    mismatches = torch.zeros(len(cases), dtype=torch.int64, device=CUDA)
    for _ in range(STRESS_ROUNDS):  # back to back: no synchronization until the end
        for i, (x, weight, w_scale, lora, batch, kwargs, want) in enumerate(cases):
            y = ek.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, workspace=ws,
                                          **kwargs)
            mismatches[i] += (y.view(torch.int16) != want).any()
    torch.cuda.synchronize()
    counts = dict(zip([c[:2] for c in STRESS], mismatches.tolist(), strict=True))
    assert not any(counts.values()), f"launches differing from the serialized bits: {counts}"
    assert ws.is_clean()


QWEN3_8B = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
            "gate_up": (4096, (12288, 12288)), "down": (12288, (4096,))}


@pytest.mark.parametrize("kind", ["x", "codes"])
@pytest.mark.parametrize("tokens", [1, 32])  # 16- and 32-row tiles (4 and 16: 1's candidates)
@pytest.mark.parametrize("projection", QWEN3_8B)
def test_swapped_decode_tiles_the_tuner_offers_give_the_unswapped_answer(projection, tokens,
                                                                          kind):
    # Every swapped K2 the tuner would time on Qwen3-8B's shapes (EPILORA_TUNE_SWAP_AB=1), on
    # the caller's codes (the plugin's default; on x, K1 sorting the codes, the pick of the A/B
    # tools only): the decode path's answer up to the order of the sums (each K tile's FP8 sum
    # promoted to fp32), the same bits in a CUDA graph as eager; the pick's, as the fused path
    # with those tiles. Compiled first, in parallel (about 8-11 candidates a case).
    from epilora_kernels import fused, launch

    k, slices = QWEN3_8B[projection]
    x, weight, w_scale, lora, batch = make_problem(31, tokens, k, slices, 64, 1, "one_adapter",
                                                   device=CUDA)
    given, quantized = (x, None) if kind == "x" else (None, ek.quantize(x))
    want = ek.decode_lora_fp8_linear(given, weight, w_scale, lora, batch,
                                     x_quantized=quantized)
    k1, k2 = fused.decode_settings(x, weight, w_scale, lora, batch, codes=kind == "codes")
    pick = launch.swap_candidate(k2, sum(slices), k, slices, tokens)
    assert pick.swap_ab
    candidates = (launch.swap_candidates(k2, sum(slices), k, slices, tokens) if kind == "codes"
                  else [pick])

    def call(cfg, linear=ek.decode_lora_fp8_linear):  # one K1 for both paths: one h
        return linear(given, weight, w_scale, lora, batch, k1_config=k1, k2_config=cfg,
                      x_quantized=quantized)

    with ek.compile_only(threads=16):
        for cfg in candidates:
            call(cfg)
        call(pick, ek.fused_lora_fp8_linear)
    for cfg in candidates:
        y = call(cfg)
        assert relative_error(y, want) < BF16_TOL, cfg
        graph, out = capture(functools.partial(call, cfg))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, y, name=f"{cfg}, graph replay")
        if cfg == pick:
            assert_bitwise_equal(call(cfg, ek.fused_lora_fp8_linear), y, name=f"{cfg}, fused")


@pytest.mark.parametrize(("k", "slices", "rank", "adapters"), [
    (4096, (14336, 14336), 64, 1),   # Llama-3.1-8B's gate_up: 448 programs in 64-wide tiles
    (3584, (18944, 18944), 16, 1),   # Qwen2.5-7B's gate_up
    (4096, (14336, 14336), 16, 8),   # several slots (K2's other epilogue)
])
@pytest.mark.parametrize("tokens", [1, 16])
def test_decode_k2_fitted_to_the_waves_fills_them_and_is_right(k, slices, rank, adapters,
                                                               tokens):
    # Shapes the shipped table was not tuned on: K2's settings are fitted to the device's waves
    # from the compiled kernels' occupancy; the fitted grid fills its waves at least as well as
    # the table's (Llama's gate_up at rank 64, a second wave of stragglers in the table's tiles,
    # to WAVE_EFFICIENCY_OK), and the decode path with them equals its serialized launch bit for
    # bit and the reference within bf16.
    from epilora_kernels import _launchers, _tiling, fused
    from epilora_kernels._launchers import FP8

    x, weight, w_scale, lora, batch = make_problem(7, tokens, k, slices, rank, adapters,
                                                   "mixed_with_base", device=CUDA)
    support = ek.device_support(CUDA)
    k1_cfg, k2_cfg = fused.decode_settings(x, weight, w_scale, lora, batch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def efficiency(cfg):
        per_sm = _launchers.k2_blocks_per_sm(
            support, FP8, torch.float8_e4m3fn, weight, w_scale, torch.float32, lora, batch, cfg,
            pdl=True, wait_codes=True, warm_l2=fused.DECODE_WARM_L2, wait_k1_first=False)
        programs = -(-tokens // cfg.block_m) * -(-sum(slices) // cfg.block_n) * cfg.split_k
        return _tiling.wave_efficiency(programs, per_sm, sms)

    table = _tiling.gemm_config(support, batch, lora, None)
    assert efficiency(k2_cfg) >= efficiency(table), (k2_cfg, table)
    if (k, rank, adapters) == (4096, 64, 1):
        assert efficiency(k2_cfg) >= _tiling.WAVE_EFFICIENCY_OK, k2_cfg
    y = ek.decode_lora_fp8_linear(x, weight, w_scale, lora, batch)
    serial = ek.decode_lora_fp8_linear(x, weight, w_scale, lora, batch, k1_config=k1_cfg,
                                       k2_config=k2_cfg, pdl=False)
    assert_bitwise_equal(y, serial, name="decode, fitted settings")
    want = reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert relative_error(y, want) < BF16_TOL


@pytest.mark.parametrize("operands", ["x", "x+codes", "codes"])
@pytest.mark.parametrize("tokens", [16, 32, 33, 64, 128])
def test_one_active_slot_of_eight_gives_every_row_its_adapter(tokens, operands):
    # vLLM 0.26's layer tests (one adapter among 8 slots, vLLM's metadata layout, activations,
    # weights and adapters all drawn from U(0, 1)), each row's adapter delta checked on its own:
    # x given (K1 quantizes), x with vLLM's codes (K1 only shrinks x), the codes alone (K1
    # shrinks the codes). The delta is y minus the same launch with zero adapters (the same
    # tiles, so the same base bits): on all-positive operands the base's FP8 accumulation is
    # not exact in K2's 64-row tiles (wgmma accumulates FP8 products in reduced precision,
    # Triton's sm_90 default, as vLLM's CUTLASS FP8FastAccum kernels do; ~7% below the exact
    # sum here, while the 16- and 32-row tiles' mma.sync accumulates in fp32), which a delta
    # measured from the exact base would count as a lost adapter.
    gen = torch.Generator().manual_seed(tokens)
    k = n = 4096
    x = torch.rand(tokens, k, generator=gen).to(torch.bfloat16).to(CUDA)
    w = torch.rand(n, k, generator=gen)
    w_scale = (w.abs().amax(dim=1) / 448.0).float()
    weight = (w / w_scale[:, None]).to(torch.float8_e4m3fn).to(CUDA)
    w_scale = w_scale.to(CUDA)
    a = torch.rand(8, 1, 8, k, generator=gen).to(torch.bfloat16).to(CUDA)
    b = (torch.rand(8, 1, n, 8, generator=gen) / 8).to(torch.bfloat16).to(CUDA)
    lora = ek.LoraWeights((a,), (b,), (n,))
    no_adapter = ek.LoraWeights((a,), (torch.zeros_like(b),), (n,))
    batch = vllm_layout_batch(torch.full((tokens,), 5, dtype=torch.int32, device=CUDA), 8)
    given = ek.quantize(x)
    args = {"x": (x, None), "x+codes": (x, given), "codes": (None, given)}[operands]
    y = ek.lora_linear(args[0], weight, w_scale, lora, batch, x_quantized=args[1])
    y_base = ek.lora_linear(args[0], weight, w_scale, no_adapter, batch, x_quantized=args[1])
    want = reference.fused_lora_fp8_linear(args[0], weight, w_scale, lora, batch,
                                           x_quantized=given)
    ref_base = reference.fp8_gemm(*given, weight, w_scale).double()
    got_delta, want_delta = y.double() - y_base.double(), want.double() - ref_base
    row_err = (got_delta - want_delta).norm(dim=1) / want_delta.norm(dim=1)
    assert float(row_err.max()) < 2e-2, row_err



def _compiled_variants() -> int:
    # Kernels Triton's JIT holds compiled, over both kernels and every device.
    from epilora_kernels._fused_kernels import _lora_gemm_kernel, _quantize_shrink_kernel

    return sum(len(caches[0]) for kernel in (_quantize_shrink_kernel, _lora_gemm_kernel)
               for caches in kernel.device_caches.values())


@pytest.mark.parametrize(("path", "threads"), [("decode", 1), ("fused", 1), ("decode", 4)])
def test_compile_only_compiles_what_the_call_then_launches_without_compiling(path, threads,
                                                                           monkeypatch):
    # After the call inside compile_only (K 384, N 96, 7 tokens over 3 slots), the same call
    # outside compiles nothing more and equals its reference; the workspace's counters stay at
    # rest throughout. (Whether compile_only compiled them or an earlier test did, Triton's
    # cache cannot tell: test_compile_sm90.py checks its compiles are the launches' own.) With
    # threads, the kernels' in-memory caches (and the wave fitting's choices) are emptied
    # first, so K1 goes through the threads' compiles (from Triton's disk cache or not) before
    # the call finds it.
    from triton.runtime import _async_compile

    from epilora_kernels import _launchers
    from epilora_kernels._fused_kernels import _lora_gemm_kernel, _quantize_shrink_kernel

    submitted = []
    if threads > 1:
        for kernel in (_quantize_shrink_kernel, _lora_gemm_kernel):
            kernel.device_caches.clear()
        _launchers._FITTED.clear()
        submit = _async_compile.AsyncCompileMode.submit
        monkeypatch.setattr(_async_compile.AsyncCompileMode, "submit",
                            lambda mode, key, *a: submitted.append(key) or submit(mode, key, *a))
    tokens = 7
    x, weight, w_scale, lora, batch = make_problem(23, tokens, 384, (96,), 16, 3,
                                                   "mixed_with_base", device=CUDA)
    workspace = ek.Workspace.for_batches(CUDA, max_tokens=tokens, max_out_features=96,
                                         max_rank=16, max_loras=3)
    with ek.compile_only(threads=threads):
        ek.lora_linear(x, weight, w_scale, lora, batch, path=path, workspace=workspace)
    torch.cuda.synchronize()
    compiled = _compiled_variants()
    # K2 may compile in this thread instead: its wave fitting reads the candidates' registers.
    assert workspace.is_clean() and len(submitted) >= (1 if threads > 1 else 0)
    y = ek.lora_linear(x, weight, w_scale, lora, batch, path=path, workspace=workspace)
    torch.cuda.synchronize()
    assert _compiled_variants() == compiled and workspace.is_clean()
    want = reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch)
    assert relative_error(y, want) < BF16_TOL


@pytest.mark.parametrize(("path", "kind"), [("decode", "x"), ("decode", "codes"),
                                            ("fused", "x"), ("fused", "codes"), ("w8a16", "x")])
def test_a_projection_gives_the_bits_of_lora_linear_eager_and_in_a_graph(path, kind):
    # `LoraProjection` binds the weight and adapters into the launch templates once: the same
    # kernels and settings as lora_linear's, so the same bits, at decode and prefill counts and
    # at a count never seen before (the step settings it derives), eager and in a CUDA graph.
    _, _, _, weight, w_scale, _, lora, _ = make_integer_problem(
        21, 1, 4096, (4096, 1024, 1024), 64, 4, "mixed_with_base", device=CUDA)
    bound = ek.LoraProjection(weight, w_scale, lora)
    workspace = ek.Workspace.for_batches(CUDA, max_tokens=600, max_out_features=6144,
                                         max_rank=64, max_loras=4)
    graphed = ek.LoraProjection(weight, w_scale, lora, workspace=workspace)
    for tokens in (1, 8, 40, 300, 520, 521):
        x, _, _, _, _, _, _, batch = make_integer_problem(
            21, tokens, 4096, (4096, 1024, 1024), 64, 4, "mixed_with_base", device=CUDA)
        codes, scales, _ = exact_codes(21, tokens, 4096, device=CUDA)
        given, quantized = (x, None) if kind == "x" else (None, (codes, scales))
        want = ek.lora_linear(given, weight, w_scale, lora, batch, path=path,
                              x_quantized=quantized)
        name = f"{tokens} tokens"
        assert_bitwise_equal(bound(given, batch, path=path, x_quantized=quantized), want,
                             name=name)
        graph, out = capture(lambda given=given, batch=batch, quantized=quantized: graphed(
            given, batch, path=path, x_quantized=quantized))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, want, name=f"{name}, graph replay")
        assert workspace.is_clean()


@pytest.mark.parametrize("at", ["end", "start"])
@pytest.mark.parametrize("budget_mib", [4, 24, 200])  # a line a row, 24 MiB, past L2
@pytest.mark.parametrize("tokens", [1, 16, 32])
def test_a_decode_call_that_prefetches_the_next_weight_gives_the_same_bits(tokens, budget_mib,
                                                                          at):
    # L2Prefetch only changes what L2 holds: the decode path with it gives the bits of the call
    # without it, through lora_linear and a bound projection, eager and in a CUDA graph replayed
    # many times back to back (the next weight: Qwen3-8B's gate_up, 96 MiB; after it, down).
    _, _, _, weight, w_scale, _, lora, batch = make_integer_problem(
        22, tokens, 4096, (4096, 1024, 1024), 64, 4, "mixed_with_base", device=CUDA)
    codes, scales, _ = exact_codes(22, tokens, 4096, device=CUDA)
    quantized = (codes, scales)
    following = torch.zeros(24576, 4096, dtype=torch.float8_e4m3fn, device=CUDA)
    prefetch = ek.L2Prefetch(following, budget_mib << 20, at=at)
    assert prefetch.nbytes > 0
    want = ek.lora_linear(None, weight, w_scale, lora, batch, path="decode",
                          x_quantized=quantized)
    got = ek.lora_linear(None, weight, w_scale, lora, batch, path="decode",
                         x_quantized=quantized, prefetch=prefetch)
    assert_bitwise_equal(got, want, name="lora_linear with a prefetch")
    workspace = ek.Workspace.for_batches(CUDA, max_tokens=tokens, max_out_features=6144,
                                         max_rank=64, max_loras=4)
    bound = ek.LoraProjection(weight, w_scale, lora, workspace=workspace, prefetch=prefetch)
    assert_bitwise_equal(bound(None, batch, path="decode", x_quantized=quantized), want,
                         name="projection with a prefetch")
    graph, out = capture(lambda: bound(None, batch, path="decode", x_quantized=quantized))
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, want, name="graph replays with a prefetch")
    assert workspace.is_clean()



@triton.jit
def _early_trigger_slow_copy(src_ptr, dst_ptr, n, SPIN_NS: tl.constexpr, BLOCK: tl.constexpr):
    # An adversarial kernel before K1: it lets its programmatic dependents launch at once,
    # spins SPIN_NS, and only then writes (bytes). A dependent that read before waiting for it
    # (griddepcontrol.wait) would read the previous replay's inputs.
    tl.extra.cuda.gdc_launch_dependents()
    start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    now = start
    while now - start < SPIN_NS:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                        dtype=tl.int64, is_pure=False, pack=1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.mark.parametrize("operands", ["codes", "x"])
def test_k1_after_the_kernel_before_waits_for_what_that_kernel_writes(operands, monkeypatch):
    # EPILORA_DECODE_AFTER_PREVIOUS=1: K1 may start while the kernel before it runs. Here that
    # kernel triggers its dependents at once and writes the very activations the call reads
    # only after spinning 5 us; a CUDA graph holds eight such (writer, decode call) pairs over
    # different inputs, replayed 200 times: every output must be the bits of the call made
    # alone (without the setting), so no K1 or K2 read an input before it was written.
    _, _, _, weight, w_scale, _, lora, batch = make_integer_problem(
        23, 4, 4096, (4096, 1024, 1024), 64, 4, "mixed_with_base", device=CUDA)
    inputs = [exact_codes(23 + i, 4, 4096, device=CUDA) for i in range(8)]
    codes_bytes = inputs[0][0].numel()

    def packed(codes, scales, x):  # the call's inputs as one byte buffer, one writer
        if operands == "x":
            return x.view(torch.uint8).flatten()
        return torch.cat([codes.view(torch.uint8).flatten(), scales.view(torch.uint8).flatten()])

    def call(buffer):
        if operands == "x":
            return bound(buffer.view(torch.bfloat16).view(4, 4096), batch, path="decode")
        codes = buffer[:codes_bytes].view(torch.float8_e4m3fn).view(4, 4096)
        scales = buffer[codes_bytes:].view(torch.float32).view(4, 1)
        return bound(None, batch, path="decode", x_quantized=(codes, scales))

    sources = [packed(*i) for i in inputs]
    workspace = ek.Workspace.for_batches(CUDA, max_tokens=4, max_out_features=6144,
                                         max_rank=64, max_loras=4)
    bound = ek.LoraProjection(weight, w_scale, lora, workspace=workspace)
    wants = [call(source.clone()) for source in sources]
    torch.cuda.synchronize()
    monkeypatch.setenv("EPILORA_DECODE_AFTER_PREVIOUS", "1")
    bound = ek.LoraProjection(weight, w_scale, lora, workspace=workspace)  # reads the setting
    buffer = torch.zeros_like(sources[0])
    n = buffer.numel()

    def pairs():
        outs = []
        for source in sources:
            _early_trigger_slow_copy[(triton.cdiv(n, 1024),)](source, buffer, n, SPIN_NS=5000,
                                                               BLOCK=1024)
            outs.append(call(buffer))
        return outs

    graph, outs = capture(pairs)
    for _ in range(200):
        buffer.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for i, (out, want) in enumerate(zip(outs, wants, strict=True)):
            assert_bitwise_equal(out, want, name=f"pair {i}")
    assert workspace.is_clean()
