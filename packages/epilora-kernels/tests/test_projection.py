"""`LoraProjection`: a projection bound once computes what `lora_linear` computes with the same
arguments, bit for bit, on every path and kind of input, shares a token count's launch
settings with the other projections of its shapes, and refuses bad input as clearly
(interpreter)."""

import pytest
import torch

import epilora_kernels as ek
from epilora_kernels import _launchers, launch, projection
from epilora_testing import assert_bitwise_equal

from kernel_cases import make_problem

K, SLICES, RANK, SLOTS = 64, (32, 16, 16), 16, 3


def _inputs(kind: str, x: torch.Tensor):
    codes, scales = ek.quantize(x)
    return {"x": (x, None), "codes": (None, (codes, scales)), "both": (x, (codes, scales))}[kind]


# The paths and what each takes: the FP8 paths bf16 x, the caller's codes or both; the W8A16
# and hybrid paths bf16 x only (their refusals of codes: test_bad_input_is_refused_the_same).
CALLS = [(path, kind) for path in (None, "decode", "fused") for kind in ("x", "codes", "both")]
CALLS += [("w8a16", "x"), ("hybrid", "x")]


@pytest.mark.parametrize(("path", "kind"), CALLS)
@pytest.mark.parametrize("tokens", [6, 40])  # 40: the fused path's K2 as K1's PDL dependent
def test_a_projection_gives_the_bits_of_lora_linear(path, kind, tokens):
    x, weight, w_scale, lora, batch = make_problem(3, tokens, K, SLICES, RANK, SLOTS,
                                                   "mixed_with_base")
    given, quantized = _inputs(kind, x)
    bound = ek.LoraProjection(weight, w_scale, lora)
    want = ek.lora_linear(given, weight, w_scale, lora, batch, path=path,
                          x_quantized=quantized)
    assert_bitwise_equal(bound(given, batch, path=path, x_quantized=quantized), want,
                         name="bound")
    assert_bitwise_equal(bound(given, batch, path=path, x_quantized=quantized), want,
                         name="bound, again")


def test_per_channel_scales_and_every_slot_in_a_prefill_tile():
    x, weight, w_scale, lora, batch = make_problem(4, 70, K, SLICES, RANK, SLOTS, "one_adapter",
                                                   per_channel=True)
    bound = ek.LoraProjection(weight, w_scale, lora)
    for path in ("fused", "w8a16"):
        assert_bitwise_equal(bound(x, batch, path=path),
                             ek.lora_linear(x, weight, w_scale, lora, batch, path=path),
                             name=path)


def test_projections_of_one_shape_share_a_token_counts_settings_and_bind_their_own():
    # Every layer of a shape meets a step's token count: its settings are derived once. Each
    # projection launches with its own weight and adapters (two layers, two outputs).
    projection.clear()
    first = make_problem(5, 9, K, SLICES, RANK, SLOTS, "mixed_with_base")
    second = make_problem(6, 9, K, SLICES, RANK, SLOTS, "mixed_with_base")
    x, batch = first[0], first[4]
    outputs = []
    for _, weight, w_scale, lora, _ in (first, second):
        bound = ek.LoraProjection(weight, w_scale, lora)
        outputs.append(bound(x, batch, path="fused"))
        assert len(projection._STEPS) == 1
        assert_bitwise_equal(outputs[-1], ek.lora_linear(x, weight, w_scale, lora, batch,
                                                         path="fused"), name="layer")
    assert not torch.equal(outputs[0], outputs[1])
    bound(x[:5], ek.AdapterBatch.from_token_mapping(batch.token_lora_mapping[:5], SLOTS),
          path="fused")  # another token count: settings of its own
    assert len(projection._STEPS) == 2
    launch.clear_table_cache()  # new launch tables (the tuner's): derived again
    assert not projection._STEPS


def test_a_launch_failing_after_k1_leaves_the_counters_clean(monkeypatch):
    x, weight, w_scale, lora, batch = make_problem(7, 40, K, SLICES, RANK, SLOTS, "one_adapter")
    workspace = ek.Workspace("cpu")
    bound = ek.LoraProjection(weight, w_scale, lora, workspace=workspace)
    start = _launchers._start_template
    launched = []

    def k2_fails(support, template, grid, tensors):
        if template.kernel is _launchers._lora_gemm_kernel:
            workspace._buffer[0] = 7  # as a K1 that counted its rows for a K2 that never ran
            raise RuntimeError("K2 failed to launch")
        launched.append(template)
        return start(support, template, grid, tensors)

    monkeypatch.setattr(_launchers, "_start_template", k2_fails)
    with pytest.raises(RuntimeError, match="K2 failed"):
        bound(x, batch, path="decode")
    assert launched and workspace.is_clean()


def _bad_calls():
    x, weight, w_scale, lora, batch = make_problem(10, 6, K, SLICES, 8, 2, "mixed_with_base")
    codes, scales = ek.quantize(x)
    bound = ek.LoraProjection(weight, w_scale, lora)
    other = ek.AdapterBatch.from_token_mapping(torch.zeros(5, dtype=torch.int32), 2)
    longs = ek.AdapterBatch(batch.token_lora_mapping.long(), *list(vars(batch).values())[1:])
    return {
        "weight shape": (lambda: ek.LoraProjection(weight[:32], w_scale, lora),
                         r"float8_e4m3fn \[64, 64\]"),
        "adapter dtype": (lambda: ek.LoraProjection(weight, w_scale, ek.LoraWeights(
            tuple(a.float() for a in lora.lora_a), lora.lora_b, lora.output_slices)),
            "bfloat16"),
        "workspace device": (lambda: ek.LoraProjection(weight, w_scale, lora,
                                                       workspace=ek.Workspace("meta")),
                             "workspace is on meta"),
        "batch tokens": (lambda: bound(x, other, path="fused"), "batch maps 5 tokens"),
        "batch dtype": (lambda: bound(x, longs, path="fused"),
                        "token_lora_mapping must be contiguous int32"),
        "slots": (lambda: bound(x, ek.AdapterBatch.from_token_mapping(
            batch.token_lora_mapping, 3), path="fused"), "slots"),
        "x rows": (lambda: bound(x.t().contiguous().t(), batch, path="decode"),
                   "contiguous rows"),
        "x features": (lambda: bound(x[:, :32], batch, path="fused"), "32 features"),
        "codes dtype": (lambda: bound(None, batch, path="fused",
                                      x_quantized=(codes.float(), scales)), "codes must be"),
        "codes rows": (lambda: bound(x, batch, path="fused",
                                     x_quantized=(codes[:5], scales[:5])), "5 rows"),
        "codes for w8a16": (lambda: bound(x, batch, path="w8a16", x_quantized=(codes, scales)),
                            "bf16 activations"),
        "codes alone for hybrid": (lambda: bound(None, batch, path="hybrid",
                                                 x_quantized=(codes, scales)), "bf16"),
        "nothing": (lambda: bound(None, batch, path="fused"), "x_quantized"),
        "path": (lambda: bound(x, batch, path="nonesuch"), "unknown path"),
    }


BAD_CALLS = ["adapter dtype", "batch dtype", "batch tokens", "codes alone for hybrid",
             "codes dtype", "codes for w8a16", "codes rows", "nothing", "path", "slots",
             "weight shape", "workspace device", "x features", "x rows"]


def test_every_bad_call_is_run():
    assert sorted(_bad_calls()) == BAD_CALLS


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_is_refused_the_same(case):
    call, message = _bad_calls()[case]
    with pytest.raises(ValueError, match=message):
        call()
