"""The public API (`from epilora_kernels import ...`): the dispatcher, the capability query, the
hybrid path, and clear errors for bad input before any kernel launches (interpreter)."""

import dataclasses

import pytest
import torch

import epilora_kernels as ek
from epilora_kernels import _launchers, _tiling, dispatch, fused, reference
from epilora_kernels.arch import INTERPRETER, DeviceSupport
from epilora_quant import Fp8Arithmetic
from epilora_testing import assert_bitwise_equal

from kernel_cases import (
    exact_codes,
    fp64_reference,
    make_integer_problem,
    make_problem,
    pad_batch,
    relative_error,
)

BF16_TOL = 1e-2
SM90 = DeviceSupport("NVIDIA H200", (9, 0), fp8_mma=True, pdl=True, tma=True, interpreter=False)
SM89 = DeviceSupport("NVIDIA L40S", (8, 9), fp8_mma=True, pdl=False, tma=False,
                     interpreter=False)
SM80 = DeviceSupport("NVIDIA A100", (8, 0), fp8_mma=False, pdl=False, tma=False,
                     interpreter=False)


def test_every_public_name_is_importable_and_listed():
    assert ek.__all__ == sorted(ek._MODULE_OF)  # every lazily loaded name listed, once
    for name in ek.__all__:
        assert getattr(ek, name) is not None, name
    assert "lora_linear" in dir(ek)
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        ek.nonesuch  # noqa: B018


@pytest.mark.parametrize(("support", "tokens", "slots", "want"), [
    (SM90, 1, 1, "decode"), (SM90, 64, 1, "decode"), (SM90, 65, 1, "fused"),
    (SM90, 8, 32, "decode"), (SM90, 32, 32, "decode"), (SM90, 33, 32, "fused"),
    (SM90, 512, 8, "fused"),
    (SM90, 513, 1, "fused"), (SM90, 4096, 32, "fused"), (SM89, 1, 1, "fused"),
    (INTERPRETER, 4, 2, "decode")])
def test_choose_path(support, tokens, slots, want):
    batch = ek.AdapterBatch.from_token_mapping(
        torch.arange(tokens, dtype=torch.int32) % slots, slots)
    assert ek.choose_path(tokens, batch, support) == want


@pytest.mark.parametrize("path", ["decode", "fused", "hybrid", "w8a16", None])
@pytest.mark.parametrize("mapping", ["mixed_with_base", "one_adapter", "no_adapter"])
def test_lora_linear_equals_the_reference_and_the_path_it_runs(path, mapping):
    x, weight, w_scale, lora, batch = make_problem(5, 11, 64, (32, 16, 16), 16, 3, mapping)
    y = ek.lora_linear(x, weight, w_scale, lora, batch, path=path)
    assert y.dtype == torch.bfloat16 and y.shape == (11, 64)
    codes, scales, _ = reference.quantize_and_shrink(x, lora, batch,
                                                     arithmetic=Fp8Arithmetic.TORCH_CPU)
    exact = fp64_reference(x, weight, w_scale, codes, scales, lora, batch, w8a16=path == "w8a16")
    assert relative_error(y, exact) < BF16_TOL
    chosen = path or ek.choose_path(11, batch, INTERPRETER)
    direct = {"decode": fused.decode_lora_fp8_linear, "fused": fused.fused_lora_fp8_linear,
              "w8a16": fused.fused_lora_w8a16_linear,
              "hybrid": dispatch.hybrid_lora_fp8_linear}[chosen]
    assert_bitwise_equal(y, direct(x, weight, w_scale, lora, batch), name=f"{chosen} path")


def test_hybrid_path_takes_the_engines_base_gemm():
    x, weight, w_scale, lora, batch = make_problem(6, 7, 64, (32, 32), 8, 2, "mixed_with_base")
    calls = []

    def base_gemm(x, weight, weight_scale):
        calls.append(x.shape)
        return reference.fp8_gemm_from_bf16(x, weight, weight_scale,
                                            arithmetic=Fp8Arithmetic.TORCH_CPU)

    y = ek.lora_linear(x, weight, w_scale, lora, batch, path="hybrid", base_gemm=base_gemm)
    assert calls == [(7, 64)]
    want = reference.lora_expand(base_gemm(x, weight, w_scale),
                                 reference.lora_shrink(x, lora, batch), lora, batch)
    assert relative_error(y, want) < BF16_TOL
    with pytest.raises(ValueError, match=r"y must be bf16 \[7, 64\]"):
        ek.lora_linear(x, weight, w_scale, lora, batch, path="hybrid",
                       base_gemm=lambda *a: torch.zeros(7, 64))


def test_an_empty_batch_gives_an_empty_output():
    x, weight, w_scale, lora, batch = make_problem(7, 0, 64, (32,), 8, 2, "one_adapter")
    assert ek.lora_linear(x, weight, w_scale, lora, batch).shape == (0, 32)
    empty = ek.w8a16_gemm(x, weight, w_scale)
    assert empty.shape == (0, 32) and empty.dtype == torch.bfloat16
    # Checked as a batch with tokens is: a wrong weight refused on the empty step too.
    with pytest.raises(ValueError, match=r"weight must be float8_e4m3fn \[32, 64\]"):
        ek.lora_linear(x, weight[:, :48].contiguous(), w_scale, lora, batch)


@pytest.mark.parametrize(("path", "kwargs", "support", "reason"), [
    ("decode", {}, SM89, "needs PDL"),
    ("fused", {}, SM80, "FP8 MMA needs sm_89"),
    ("fused", {"weight_scale_numel": 4096}, SM90, "block scales are not"),
    ("fused", {"weight_dtype": torch.bfloat16}, SM90, "float8_e4m3fn"),
    ("fused", {"max_rank": 256}, SM90, "ranks 1..128"),
    ("fused", {"output_slices": (4096, 1000, 1000)}, SM90, "multiple of 16"),
    ("fused", {"output_slices": (16,) * 4}, SM90, "1..3 are served"),
])
def test_supports_says_why_not(path, kwargs, support, reason, monkeypatch):
    monkeypatch.setattr(dispatch, "device_support", lambda device=None: support)
    case = {"in_features": 4096, "output_slices": (4096, 1024, 1024), "max_rank": 64, **kwargs}
    verdict = ek.supports(path, **case)
    assert not verdict and reason in verdict.reason, verdict
    with pytest.raises(ValueError, match="unknown path"):
        ek.supports("fastest", **case)


@pytest.mark.parametrize("path", ek.PATHS)
def test_supports_the_models_projections_on_sm90(path, monkeypatch):
    monkeypatch.setattr(dispatch, "device_support", lambda device=None: SM90)
    for slices, k in (((4096, 1024, 1024), 4096), ((12288, 12288), 4096), ((4096,), 12288),
                      ((3584, 512, 512), 3584), ((18944, 18944), 3584)):
        for rank in (1, 16, 64, 128):
            verdict = ek.supports(path, in_features=k, output_slices=slices, max_rank=rank)
            assert verdict and verdict.reason == "", (slices, rank, verdict)


def test_lora_linear_refuses_what_is_not_supported(monkeypatch):
    x, weight, _, lora, batch = make_problem(8, 3, 64, (32,), 8, 2, "one_adapter")
    with pytest.raises(ek.UnsupportedError, match="block scales are not"):
        ek.lora_linear(x, weight, torch.ones(16), lora, batch)
    monkeypatch.setattr(fused, "device_support", lambda device=None: SM89)
    monkeypatch.setattr(dispatch, "device_support", lambda device=None: SM89)
    with pytest.raises(ek.UnsupportedError, match="needs PDL"):
        ek.lora_linear(x, weight, torch.ones(1), lora, batch, path="decode")
    with pytest.raises(ek.UnsupportedError, match="needs PDL"):
        fused.decode_lora_fp8_linear(x, weight, torch.ones(1), lora, batch)


def test_sm89_launches_without_pdl_or_tma(monkeypatch):
    # An sm_89 part (L40S) runs the fused path with both launches plain and pointer loads: the
    # launchers run with its DeviceSupport, which says the kernels run in the interpreter here
    # (the launchers read that from the call's support, not from the environment per launch).
    sm89 = dataclasses.replace(SM89, interpreter=True)
    x, weight, w_scale, lora, batch = make_problem(9, 70, 64, (32,), 8, 2, "one_adapter")
    seen, operands = [], []
    launch_k2, w_operand = _launchers.launch_k2, _launchers._w_operand
    monkeypatch.setattr(fused, "device_support", lambda device=None: sm89)
    monkeypatch.setattr(_launchers, "launch_k2", lambda support, *a, **kw: seen.append(
        (support, kw["pdl"], kw["a_sorted"])) or launch_k2(support, *a, **kw))
    monkeypatch.setattr(_launchers, "_w_operand", lambda support, weight, cfg: operands.append(
        w_operand(support, weight, cfg)) or operands[-1])
    k2 = ek.LaunchConfig(block_m=64, block_n=16, block_k=32, block_r=16)
    y = ek.fused_lora_fp8_linear(x, weight, w_scale, lora, batch, k2_config=k2)
    assert seen == [(sm89, True, False)]  # asked for PDL, sorted codes not (no TMA)
    assert not _launchers.use_pdl(sm89, True)  # ... and launch_k2 launches without it
    assert len(operands) == 1 and operands[0] is weight  # the weight by pointer loads
    assert _tiling.w_tma(INTERPRETER, weight, k2)  # where TMA exists, these tiles would use it
    want = reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                           arithmetic=Fp8Arithmetic.TORCH_CPU)
    assert relative_error(y, want) < BF16_TOL


def test_the_hybrid_path_refuses_unaligned_shapes_and_the_dispatcher_takes_fused():
    case = {"in_features": 4096, "max_rank": 16}
    verdict = ek.supports("hybrid", output_slices=(1000,), **case)
    assert not verdict and "multiples of 16" in verdict.reason
    assert ek.supports("fused", output_slices=(1000,), **case)
    x, weight, w_scale, lora, batch = make_problem(12, 600, 64, (40,), 8, 2, "one_adapter")
    with pytest.raises(ek.UnsupportedError, match="multiples of 16"):
        ek.lora_linear(x, weight, w_scale, lora, batch, path="hybrid")
    y = ek.lora_linear(x, weight, w_scale, lora, batch)  # N = 40: the fused path serves it
    assert_bitwise_equal(y, ek.fused_lora_fp8_linear(x, weight, w_scale, lora, batch),
                         name="dispatcher on an unaligned shape")


def _bad_inputs():
    x, weight, w_scale, lora, batch = make_problem(10, 6, 64, (32, 16, 16), 8, 2,
                                                   "mixed_with_base")
    codes, scales, h = fused.quantize_and_shrink(x, lora, batch)
    other = ek.AdapterBatch.from_token_mapping(torch.zeros(5, dtype=torch.int32), 2)
    meta = ek.AdapterBatch(batch.token_lora_mapping.long(), *list(vars(batch).values())[1:])
    return {
        "h shape": (lambda: ek.lora_fp8_gemm(codes, scales, weight, w_scale, h[:, :2], lora,
                                             batch), "h must be"),
        "h dtype": (lambda: ek.lora_fp8_gemm(codes, scales, weight, w_scale, h.double(), lora,
                                             batch), "h must be"),
        "codes dtype": (lambda: ek.lora_fp8_gemm(codes.float(), scales, weight, w_scale, h,
                                                 lora, batch), "codes must be"),
        "scales shape": (lambda: ek.lora_fp8_gemm(codes, scales.reshape(-1), weight, w_scale,
                                                  h, lora, batch), "scales must be"),
        "codes strides": (lambda: ek.fp8_gemm(codes.t().contiguous().t(), scales, weight,
                                              w_scale), "codes must be"),
        "batch tokens": (lambda: ek.lora_linear(x, weight, w_scale, lora, other),
                         "batch maps 5 tokens"),
        "batch dtype": (lambda: ek.lora_linear(x, weight, w_scale, lora, meta),
                        "token_lora_mapping must be contiguous int32"),
        "weight shape": (lambda: ek.lora_linear(x, weight[:32], w_scale, lora, batch),
                         r"float8_e4m3fn \[64, 64\]"),
        "weight transposed": (lambda: ek.lora_linear(x, weight.t().contiguous().t(), w_scale,
                                                     lora, batch), "contiguous"),
        "x rows": (lambda: ek.lora_linear(x.t().contiguous().t(), weight, w_scale, lora, batch),
                   "contiguous rows"),
        "x features": (lambda: ek.lora_linear(x[:, :32], weight, w_scale, lora, batch),
                       "32 features"),
        "adapter dtype": (lambda: ek.lora_linear(x, weight, w_scale, ek.LoraWeights(
            tuple(a.float() for a in lora.lora_a), lora.lora_b, lora.output_slices), batch),
            "bfloat16"),
        "device": (lambda: ek.lora_linear(x, weight, w_scale.to("meta"), lora, batch),
                   "one device"),
        "expand y": (lambda: ek.lora_expand(torch.zeros(6, 63, dtype=torch.bfloat16), h, lora,
                                            batch), r"y must be bf16 \[6, 64\]"),
        "slots": (lambda: ek.lora_linear(x, weight, w_scale, lora,
                                         ek.AdapterBatch.from_token_mapping(
                                             batch.token_lora_mapping, 3)), "slots"),
    }


BAD_INPUTS = ["adapter dtype", "batch dtype", "batch tokens", "codes dtype", "codes strides",
              "device", "expand y", "h dtype", "h shape", "scales shape", "slots",
              "weight shape", "weight transposed", "x features", "x rows"]


def test_every_bad_input_case_is_run():
    assert sorted(_bad_inputs()) == BAD_INPUTS


@pytest.mark.parametrize("case", BAD_INPUTS)  # built in the test: collection launches nothing
def test_bad_input_is_a_clear_error(case):
    call, message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("path", ["decode", "fused", "hybrid", "w8a16"])
@pytest.mark.parametrize("shape", [(1, None), (70, ek.LaunchConfig(block_m=64, block_n=16,
                                                                   block_k=32, block_r=16))],
                         ids=["decode-tile", "prefill-tma"])
def test_per_channel_weight_scales_on_every_path(path, shape):
    # llm-compressor's FP8-dynamic checkpoints: one scale per output channel, rows of
    # magnitudes 2^-2 to 2^2 apart, so that a scale applied to the wrong column shows.
    tokens, k2 = shape
    x, weight, w_scale, lora, batch = make_problem(11, tokens, 64, (32, 16, 16), 16, 3,
                                                   "mixed_with_base", per_channel=True)
    assert w_scale.shape == (64,)
    codes, scales, _ = reference.quantize_and_shrink(x, lora, batch,
                                                     arithmetic=Fp8Arithmetic.TORCH_CPU)
    exact = fp64_reference(x, weight, w_scale, codes, scales, lora, batch, w8a16=path == "w8a16")
    if k2 is None or path == "hybrid":
        y = ek.lora_linear(x, weight, w_scale, lora, batch, path=path)
    else:
        run = {"decode": ek.decode_lora_fp8_linear, "fused": ek.fused_lora_fp8_linear,
               "w8a16": ek.fused_lora_w8a16_linear}[path]
        y = run(x, weight, w_scale, lora, batch, k2_config=k2)
    assert relative_error(y, exact) < BF16_TOL
    # [N, 1] (vLLM's channelwise layout) gives the same bits as [N]
    column = ek.lora_linear(x, weight, w_scale.reshape(-1, 1), lora, batch, path=path)
    assert_bitwise_equal(column, ek.lora_linear(x, weight, w_scale, lora, batch, path=path),
                         name="[N, 1] vs [N] scales")
    with pytest.raises(ValueError, match="one per output channel"):
        ek.fused_lora_fp8_linear(x, weight, w_scale[:32], lora, batch)


@pytest.mark.parametrize("path", ek.PATHS)
def test_rows_padded_past_the_counted_tokens_get_no_adapter_and_stay_in_place(path):
    # vLLM's metadata counts the scheduled tokens; a CUDA graph's batch pads them with rows
    # whose slots and sorted indices are stale. The real rows must be what they are unpadded,
    # the padding the base GEMM alone, and nothing read or written out of range.
    x, weight, w_scale, lora, batch = make_problem(9, 5, 64, (32, 16, 16), 16, 3,
                                                   "mixed_with_base")
    xp, padded = pad_batch(x, batch, 12)
    y = ek.lora_linear(xp, weight, w_scale, lora, padded, path=path)
    assert_bitwise_equal(y[:5], ek.lora_linear(x, weight, w_scale, lora, batch, path=path),
                         name=f"{path}: real rows")
    no_adapter = ek.AdapterBatch.from_token_mapping(torch.full((12,), -1, dtype=torch.int32), 3)
    base = ek.lora_linear(xp, weight, w_scale, lora, no_adapter, path=path)
    assert_bitwise_equal(y[5:], base[5:], name=f"{path}: padding")


@pytest.mark.parametrize("path", ["decode", "fused", None])
def test_activations_quantized_by_the_caller_give_the_bits_of_the_paths_own(path):
    # An engine may quantize x itself (vLLM fuses it into RMSNorm): K1 then only shrinks. With
    # the codes K1 would make, the result is the same, bit for bit.
    x, weight, w_scale, lora, batch = make_problem(12, 9, 64, (32, 16, 16), 16, 3,
                                                   "mixed_with_base")
    given = ek.quantize(x)
    y = ek.lora_linear(x, weight, w_scale, lora, batch, path=path, x_quantized=given)
    assert_bitwise_equal(y, ek.lora_linear(x, weight, w_scale, lora, batch, path=path),
                         name=f"{path}: caller's codes")
    want = reference.fused_lora_fp8_linear(x, weight, w_scale, lora, batch,
                                           x_quantized=given)
    assert relative_error(y, want) < BF16_TOL
    with pytest.raises(ValueError, match="x_quantized has 8 rows, x 9"):
        ek.lora_linear(x, weight, w_scale, lora, batch, path=path,
                       x_quantized=(given[0][:8], given[1][:8]))
    with pytest.raises(ValueError, match="x_quantized is for the FP8 paths"):
        ek.lora_linear(x, weight, w_scale, lora, batch, path="w8a16", x_quantized=given)


@pytest.mark.parametrize("split_k", [1, 3])
def test_shrink_of_the_callers_codes_is_the_shrink_of_their_values_bitwise(split_k):
    _, _, _, _, _, _, lora, batch = make_integer_problem(13, 9, 64, (32, 16), 16, 3,
                                                         "mixed_with_base")
    codes, scales, x = exact_codes(13, 9, 64)
    cfg = ek.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, split_k=split_k)
    h = ek.lora_shrink(codes, lora, batch, x_scales=scales, config=cfg)
    assert_bitwise_equal(h, reference.lora_shrink(codes, lora, batch, x_scales=scales),
                         name="h of codes")
    assert_bitwise_equal(h, ek.lora_shrink(x, lora, batch, config=cfg), name="h of x")
    with pytest.raises(ValueError, match="scales must be contiguous fp32"):
        ek.lora_shrink(codes, lora, batch, x_scales=scales.double())


@pytest.mark.parametrize("tokens", [9, 40])  # decode buckets; beyond them (fused: PDL)
@pytest.mark.parametrize("path", ["decode", "fused", None])
def test_paths_given_only_codes_shrink_the_codes(path, tokens):
    # An engine whose compiler fused the quantization into the RMSNorm has no bf16 x: x=None
    # and the codes make h too. Equal to the paths given x = codes * scales (the same sums).
    _, _, _, weight, w_scale, _, lora, batch = make_integer_problem(
        14, tokens, 64, (32, 16, 16), 16, 3, "mixed_with_base")
    codes, scales, x = exact_codes(14, tokens, 64)
    y = ek.lora_linear(None, weight, w_scale, lora, batch, path=path,
                       x_quantized=(codes, scales))
    assert_bitwise_equal(y, ek.lora_linear(x, weight, w_scale, lora, batch, path=path,
                                           x_quantized=(codes, scales)), name=f"{path}")
    want = reference.fused_lora_fp8_linear(None, weight, w_scale, lora, batch,
                                           x_quantized=(codes, scales))
    assert relative_error(y, want) < BF16_TOL
    with pytest.raises(ValueError, match="give x_quantized"):
        ek.lora_linear(None, weight, w_scale, lora, batch, path=path)


def test_codes_only_is_refused_where_bf16_activations_are_needed():
    _, _, _, weight, w_scale, _, lora, batch = make_integer_problem(
        15, 5, 64, (32,), 8, 2, "mixed_with_base")
    codes, scales, _ = exact_codes(15, 5, 64)
    for path in ("hybrid", "w8a16"):
        with pytest.raises(ValueError, match=f"the {path} path computes on bf16 activations"):
            ek.lora_linear(None, weight, w_scale, lora, batch, path=path,
                           x_quantized=(codes, scales))
    with pytest.raises(ValueError, match="the decode path needs x_quantized"):
        ek.decode_lora_fp8_linear(None, weight, w_scale, lora, batch)
    with pytest.raises(ValueError, match="codes must be float8_e4m3fn"):
        ek.fused_lora_fp8_linear(None, weight, w_scale, lora, batch,
                                 x_quantized=(codes.float(), scales))
    with pytest.raises(ValueError, match="x is None"):
        reference.fused_lora_fp8_linear(None, weight, w_scale, lora, batch)


def test_compile_only_refuses_fewer_than_one_thread():
    with pytest.raises(ValueError, match="threads must be at least 1"), ek.compile_only(threads=0):
        pass


def test_compile_only_with_threads_waits_for_its_compiles_and_leaves_no_mode(monkeypatch):
    # The threads' mechanics without a GPU: compiles submitted to Triton's asynchronous mode
    # (as the launches' warmups submit theirs) are finished when the block ends, the first
    # failure is raised then (unless the block itself raised), and the thread is left without
    # a mode either way, so that later compiles (and blocks) work.
    from triton.runtime import _async_compile

    monkeypatch.setattr(_launchers._env, "triton_interpreter", lambda: False)
    finished = []

    def submit(key, compile_fn):
        _async_compile.active_mode.get().submit(key, compile_fn, finished.append)

    def broken():
        raise RuntimeError("ptxas said no")

    with pytest.raises(RuntimeError, match="ptxas said no"), ek.compile_only(threads=2):
        submit("good", lambda: "kernel")
        submit("bad", broken)
    assert _async_compile.active_mode.get() is None
    with ek.compile_only(threads=2):
        submit("again", lambda: "kernel again")
        with _launchers._compiling_in_this_thread():
            assert _async_compile.active_mode.get() is None
    assert "kernel again" in finished and _async_compile.active_mode.get() is None
    with pytest.raises(KeyError, match="the block's own"), ek.compile_only(threads=2):
        submit("bad too", broken)
        raise KeyError("the block's own")
    assert _async_compile.active_mode.get() is None and not _launchers.compiling_only()


def test_compile_only_counts_the_distinct_kernels_its_calls_meet(monkeypatch):
    # Triton's warmup gives one object per specialization (in memory, or a compile's future);
    # a block counts those it met, nested blocks their own.
    monkeypatch.setattr(_launchers._env, "triton_interpreter", lambda: False)
    variants = {0: object(), 1: object()}

    class Kernel:
        @staticmethod
        def warmup(grid, T):
            return variants[T % 16 == 0]

    with ek.compile_only() as compiles:
        _launchers._start(Kernel, (1,), T=3)
        _launchers._start(Kernel, (1,), T=5)  # the same kernel as 3's
        assert compiles.variants == 1
        with ek.compile_only() as inner:
            _launchers._start(Kernel, (1,), T=16)
        _launchers._start(Kernel, (1,), T=32)
        assert (compiles.variants, inner.variants) == (2, 1)
