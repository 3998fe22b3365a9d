"""EPILORA_DECODE_ONE_LAUNCH=1: the decode path on the caller's codes as one launch, K2 whose
first programs are the shrink's (on the interpreter, which runs a grid's programs in order;
test_compile_sm90.py compiles it for sm_90 and tests/gpu/ runs it there)."""

import pytest

import epilora_kernels as ek
from epilora_kernels import _fused_kernels, _launchers, fused, launch, reference, tuner
from epilora_kernels.arch import device_support
from epilora_testing import assert_bitwise_equal

from kernel_cases import make_problem

K1_SETTINGS = ek.LaunchConfig(block_m=16, block_k=32, block_r=16, split_k=2, num_stages=2)


def _launch_forms(monkeypatch) -> list:
    # per launch from here on: whether it was the one launch (K2 with the shrink's inputs)
    forms = []
    real_start = _launchers._start_template

    def start(support, template, *rest):
        forms.append(template.kernel is _fused_kernels._lora_gemm_kernel
                     and "counts_ptr" in template.slots)
        return real_start(support, template, *rest)

    monkeypatch.setattr(_launchers, "_start_template", start)
    return forms


# K2 split in two: its own split-K counters, the same buffer as the shrink's, used after them
K2_SPLIT = ek.LaunchConfig(block_m=16, block_n=16, block_k=32, block_r=16, split_k=2)


@pytest.mark.parametrize("operands", ["x+codes", "codes"])
@pytest.mark.parametrize(("tokens", "slices", "mapping", "k2"), [
    (1, (32, 16, 16), "one_adapter", None), (5, (64,), "one_adapter", None),
    (9, (32, 32), "mixed_with_base", None), (3, (48,), "no_adapter", None),
    (6, (32, 16, 16), "mixed_with_base", K2_SPLIT)])
def test_one_launch_gives_the_two_launches_bits_and_leaves_the_counters_at_rest(
        tokens, slices, mapping, k2, operands, monkeypatch):
    # With the same shrink settings, the same h and so the same bits as the two launches,
    # through decode_lora_fp8_linear (each call twice: a count left set would let the second
    # call's GEMM programs pass their wait before h is whole), then a bound projection.
    x, weight, w_scale, lora, batch = make_problem(7, tokens, 128, slices, 16, 1, mapping)
    quantized = ek.quantize(x)
    given = None if operands == "codes" else x
    want = ek.decode_lora_fp8_linear(given, weight, w_scale, lora, batch, x_quantized=quantized,
                                     k1_config=K1_SETTINGS, k2_config=k2)
    monkeypatch.setenv("EPILORA_DECODE_ONE_LAUNCH", "1")
    starts = _launch_forms(monkeypatch)
    workspace = ek.Workspace.for_batches("cpu", max_tokens=16, max_out_features=64, max_rank=16,
                                         max_loras=1)
    for _ in range(2):
        got = ek.decode_lora_fp8_linear(given, weight, w_scale, lora, batch,
                                        x_quantized=quantized, workspace=workspace,
                                        k1_config=K1_SETTINGS, k2_config=k2)
        assert_bitwise_equal(got, want, name="one launch")
        assert workspace.is_clean()
    assert starts == [True] * 2  # each call one launch, the one launch
    # The projection, on its own settings: the reference's answer.
    want_ref = reference.decode_lora_fp8_linear(given, weight, w_scale, lora, batch,
                                                   x_quantized=quantized)
    projection = ek.LoraProjection(weight, w_scale, lora, workspace=workspace)
    for _ in range(2):
        got = projection(given, batch, path="decode", x_quantized=quantized)
        assert workspace.is_clean()
        delta = (got.float() - want_ref.float()).abs().max()
        assert delta <= 2e-2 * want_ref.float().abs().max(), delta
    assert starts == [True] * 4


def test_one_launch_only_where_it_applies(monkeypatch):
    # Two-launch where K1 quantizes, with several slots, beyond the decode tokens, or unset.
    x, _, _, _, batch = make_problem(3, 4, 64, (32,), 16, 1, "one_adapter")
    support = device_support(x.device)
    several = make_problem(3, 4, 64, (32,), 16, 3, "one_token_each")[4]
    args = dict(decode=True, pdl=True, quantize=False, prefetch=None)
    assert not fused.one_launch(support, _launchers.FP8, 4, batch, **args)  # unset
    monkeypatch.setenv("EPILORA_DECODE_ONE_LAUNCH", "1")
    assert fused.one_launch(support, _launchers.FP8, 4, batch, **args)
    assert not fused.one_launch(support, _launchers.FP8, 4, several, **args)
    assert not fused.one_launch(support, _launchers.FP8, 33, batch, **args)
    assert not fused.one_launch(support, _launchers.FP8, 4, batch, **(args | {"quantize": True}))
    assert not fused.one_launch(support, _launchers.W8A16, 4, batch, **args)


@pytest.mark.parametrize("tokens", [1, 16, 32])
@pytest.mark.parametrize(("k", "slices", "rank"), [
    (4096, (4096, 1024, 1024), 64), (4096, (4096,), 128), (12288, (4096,), 16)])
def test_lead_shrink_heuristic_splits_k_in_whole_steps_within_the_budget(tokens, k, slices,
                                                                         rank):
    cfg = launch.heuristic_config("decode_lead_shrink", tokens, sum(slices), k, rank, slices)
    depth = -(-k // cfg.split_k)
    assert depth % cfg.block_k == 0 or depth < cfg.block_k  # whole K steps
    assert (cfg.split_k - 1) * depth < k  # no split without K
    tiles = -(-tokens // cfg.block_m) * -(-rank // cfg.block_r) * len(slices)
    assert tiles * cfg.split_k <= max(tiles, launch.LEAD_SHRINK_PROGRAMS)


def test_projections_made_with_and_without_it_keep_their_own_form(monkeypatch):
    # The setting is read when a projection is made; two projections of the same shapes made
    # either side of it share the launch plans of their shapes, not their form.
    x, weight, w_scale, lora, batch = make_problem(5, 4, 128, (64,), 16, 1, "one_adapter")
    quantized = ek.quantize(x)
    two = ek.LoraProjection(weight, w_scale, lora)
    monkeypatch.setenv("EPILORA_DECODE_ONE_LAUNCH", "1")
    one = ek.LoraProjection(weight, w_scale, lora)
    forms = _launch_forms(monkeypatch)
    for projection in (two, one, two, one):
        projection(None, batch, path="decode", x_quantized=quantized)
    assert forms == [False, False, True, False, False, True]  # K1 + K2, one launch, ...


def test_the_tuner_and_the_settings_identity_follow_it(monkeypatch):
    # The tuner's K1 op and whether it searches K1 (one launch: not, up to 32 tokens only), and
    # the identity an engine's precompile record is kept under.
    before = launch.settings_identity("NVIDIA H200")
    assert tuner._k1_op(True, 1, 4) == "decode_shrink_codes"
    monkeypatch.setenv("EPILORA_DECODE_ONE_LAUNCH", "1")
    assert launch.settings_identity("NVIDIA H200") != before
    assert tuner._k1_op(True, 1, 32) == "decode_lead_shrink"
    assert not tuner.k1_tuned(True, 1, 32)
    assert tuner._k1_op(True, 1, 33) == "decode_shrink_codes"  # beyond: two launches
    assert tuner._k1_op(True, 2, 4) == "decode_shrink_codes"  # several slots: two launches
    assert tuner._k1_op(False, 1, 4) == "decode_shrink"  # K1 quantizes: two launches
