"""`LoraProjection`: a projection bound once computes what `lora_linear` computes with the same
arguments, bit for bit, on every path and kind of input, shares a token count's launch
settings with the other projections of its shapes, and refuses bad input as clearly
(interpreter)."""

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

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


def _launch_record(value):
    # A launch argument as what the kernel sees of it: a tensor's dtype, shape, strides and
    # alignment (each call allocates its own outputs), a descriptor's besides its block; the
    # rest by value.
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.stride(),
                value.data_ptr() % 16)
    if isinstance(value, TensorDescriptor):
        return ("descriptor", _launch_record(value.base), tuple(value.shape),
                tuple(value.strides), tuple(value.block_shape), value.padding)
    return value


def _launches(monkeypatch) -> list:
    # Every launch made from here on, as (kernel, grid, arguments) records.
    launched = []
    start = _launchers._start_template

    def recording(support, template, grid, tensors):
        arguments = template.arguments(tensors)
        launched.append((template.kernel, grid,
                         {name: _launch_record(value) for name, value in arguments.items()}))
        return start(support, template, grid, tensors)

    monkeypatch.setattr(_launchers, "_start_template", recording)
    return launched


@pytest.mark.parametrize(("path", "kind"), CALLS)
@pytest.mark.parametrize("tokens", [6, 40, 70])  # 40: fused K2 as K1's PDL dependent; 70: TMA
def test_a_projection_launches_and_computes_what_lora_linear_does(path, kind, tokens,
                                                                  monkeypatch):
    # The same launches (kernel, grid, every argument but the buffers' addresses) and the
    # same bits; on the decode, fused and W8A16 paths by the bound launch (lora_linear, which
    # it hands the hybrid path and empty batches, must not be called there).
    x, weight, w_scale, lora, batch = make_problem(3, tokens, K, SLICES, RANK, SLOTS,
                                                   "mixed_with_base")
    given, quantized = _inputs(kind, x)
    bound = ek.LoraProjection(weight, w_scale, lora)
    launched = _launches(monkeypatch)
    want = ek.lora_linear(given, weight, w_scale, lora, batch, path=path,
                          x_quantized=quantized)
    unbound = launched.copy()
    launched.clear()
    if path != "hybrid":
        monkeypatch.setattr(projection, "lora_linear", None)  # called: a TypeError
    assert_bitwise_equal(bound(given, batch, path=path, x_quantized=quantized), want,
                         name="bound")
    assert launched == unbound and len(unbound) >= 2
    assert_bitwise_equal(bound(given, batch, path=path, x_quantized=quantized), want,
                         name="bound, again")


def test_padded_rows_and_an_unaligned_weight_launch_as_lora_linear_does(monkeypatch):
    # Activations and codes in rows wider than K (a slice of a wider buffer), and a weight 8
    # bytes past an aligned address (no TMA for it): the strides and alignment reach the
    # templates' keys and the launches as lora_linear's.
    x, weight, w_scale, lora, batch = make_problem(8, 70, K, SLICES, RANK, SLOTS, "one_adapter")
    wide = torch.zeros(70, K + 16, dtype=torch.bfloat16)
    wide[:, :K] = x
    codes, scales = ek.quantize(x)
    wide_codes = torch.zeros(70, K + 16, dtype=torch.float8_e4m3fn)
    wide_codes[:, :K] = codes
    shifted = torch.empty(weight.numel() + 8, dtype=torch.uint8)[8:]
    shifted = shifted.view(torch.float8_e4m3fn).view(weight.shape)
    shifted.copy_(weight)
    assert shifted.data_ptr() % 16 == 8
    launched = _launches(monkeypatch)
    for w in (weight, shifted):
        bound = ek.LoraProjection(w, w_scale, lora)
        for path, given, quantized in (("fused", wide[:, :K], None),
                                       ("fused", None, (wide_codes[:, :K], scales)),
                                       ("decode", wide[:, :K], (wide_codes[:, :K], scales)),
                                       ("w8a16", wide[:, :K], None)):
            launched.clear()
            want = ek.lora_linear(given, w, w_scale, lora, batch, path=path,
                                  x_quantized=quantized)
            unbound = launched.copy()
            launched.clear()
            assert_bitwise_equal(bound(given, batch, path=path, x_quantized=quantized), want,
                                 name=path)
            assert launched == unbound


@pytest.mark.parametrize("kind", ["x", "codes"])
@pytest.mark.parametrize(("setting", "slots"), [("1", 8), ("auto", 8), ("auto", SLOTS)])
def test_the_delta_kernel_launches_as_lora_linear_launches_it(kind, setting, slots,
                                                               monkeypatch):
    # EPILORA_DELTA_KERNEL=1 or auto (read at construction): where the fused path's K2 would
    # sum several slots' delta before its K loop, the delta kernel writes it into y between K1
    # and K2, as in lora_linear: the same launches, K2 told so, the same bits. `auto` takes
    # 70 tokens over 8 slots (short segments) and declines them over 3 (over 16 a slot),
    # where K2 sums the delta first itself.
    monkeypatch.setenv("EPILORA_EPILOGUE_HALVES", "0")  # the delta goes first wherever it can
    monkeypatch.setenv("EPILORA_DELTA_KERNEL", setting)
    delta = setting == "1" or 70 <= 16 * slots
    x, weight, w_scale, lora, batch = make_problem(9, 70, K, SLICES, RANK, slots,
                                                   "mixed_with_base")
    given, quantized = _inputs(kind, x)
    bound = ek.LoraProjection(weight, w_scale, lora)
    launched, start = [], _launchers._start

    def recording(kernel, grid, **arguments):
        launched.append((kernel, grid, {name: _launch_record(v) for name, v in arguments.items()}))
        return start(kernel, grid, **arguments)

    monkeypatch.setattr(_launchers, "_start", recording)
    templates = _launches(monkeypatch)
    want = ek.lora_linear(given, weight, w_scale, lora, batch, path="fused",
                          x_quantized=quantized)
    unbound, unbound_delta = templates.copy(), launched.copy()
    templates.clear()
    launched.clear()
    got = bound(given, batch, path="fused", x_quantized=quantized)
    assert_bitwise_equal(got, want, name="bound")
    assert templates == unbound and launched == unbound_delta
    names = [kernel.fn.__name__ for kernel, _, _ in launched]
    assert names == ["_quantize_shrink_kernel", *["_segment_delta_kernel"] * delta,
                     "_lora_gemm_kernel"]
    assert templates[-1][2]["DELTA_FIRST"] is True
    assert templates[-1][2]["DELTA_IN_Y"] is delta
    # set after construction, the setting does not reach the projection's launches
    monkeypatch.setenv("EPILORA_DELTA_KERNEL", "0")
    launched.clear()
    assert_bitwise_equal(bound(given, batch, path="fused", x_quantized=quantized), want,
                         name="bound, setting changed after construction")
    assert [kernel.fn.__name__ for kernel, _, _ in launched] == names


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
    # name -> (the call, its message, and for a call's input (not the projection's own) the
    # keywords of the same call to lora_linear, which must raise the same error)
    x, weight, w_scale, lora, batch = make_problem(10, 6, K, SLICES, 8, 2, "mixed_with_base")
    codes, scales = ek.quantize(x)
    bound = ek.LoraProjection(weight, w_scale, lora)
    other = ek.AdapterBatch.from_token_mapping(torch.zeros(5, dtype=torch.int32), 2)
    longs = ek.AdapterBatch(batch.token_lora_mapping.long(), *list(vars(batch).values())[1:])
    three = ek.AdapterBatch.from_token_mapping(batch.token_lora_mapping, 3)
    calls = {
        "batch tokens": ("batch maps 5 tokens", dict(x=x, batch=other, path="fused")),
        "batch dtype": ("token_lora_mapping must be contiguous int32",
                        dict(x=x, batch=longs, path="fused")),
        "slots": ("slots", dict(x=x, batch=three, path="fused")),
        "x rows": ("contiguous rows", dict(x=x.t().contiguous().t(), batch=batch,
                                           path="decode")),
        "x features": ("32 features", dict(x=x[:, :32], batch=batch, path="fused")),
        "x device": ("one device|on meta", dict(x=x.to("meta"), batch=batch, path="fused")),
        "codes dtype": ("codes must be", dict(x=None, batch=batch, path="fused",
                                              x_quantized=(codes.float(), scales))),
        "codes rows": ("5 rows", dict(x=x, batch=batch, path="fused",
                                      x_quantized=(codes[:5], scales[:5]))),
        "codes for w8a16": ("bf16 activations", dict(x=x, batch=batch, path="w8a16",
                                                     x_quantized=(codes, scales))),
        "codes alone for hybrid": ("bf16", dict(x=None, batch=batch, path="hybrid",
                                                x_quantized=(codes, scales))),
        "nothing": ("x_quantized", dict(x=None, batch=batch, path="fused")),
        "path": ("unknown path", dict(x=x, batch=batch, path="nonesuch")),
    }
    cases = {name: ((lambda kw=kw: bound(kw.pop("x"), kw.pop("batch"), **kw)), message,
                    dict(kw, weight=weight, weight_scale=w_scale, lora=lora))
             for name, (message, kw) in calls.items()}
    cases["weight shape"] = (lambda: ek.LoraProjection(weight[:32], w_scale, lora),
                             r"float8_e4m3fn \[64, 64\]", None)
    cases["adapter dtype"] = (lambda: ek.LoraProjection(weight, w_scale, ek.LoraWeights(
        tuple(a.float() for a in lora.lora_a), lora.lora_b, lora.output_slices)),
        "bfloat16", None)
    cases["workspace device"] = (lambda: ek.LoraProjection(weight, w_scale, lora,
                                                           workspace=ek.Workspace("meta")),
                                 "workspace is on meta", None)
    return cases


BAD_CALLS = ["adapter dtype", "batch dtype", "batch tokens", "codes alone for hybrid",
             "codes dtype", "codes for w8a16", "codes rows", "nothing", "path", "slots",
             "weight shape", "workspace device", "x device", "x features", "x rows"]


def test_every_bad_call_is_run():
    assert sorted(_bad_calls()) == BAD_CALLS


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_is_refused_as_lora_linear_refuses_it(case):
    call, message, unbound = _bad_calls()[case]
    with pytest.raises(ValueError, match=message) as bound_error:
        call()
    if unbound is not None:
        with pytest.raises(ValueError, match=message) as lora_linear_error:
            ek.lora_linear(**unbound)
        assert bound_error.type is lora_linear_error.type


@pytest.mark.parametrize(("path", "kind"), [("decode", "x"), ("decode", "codes"),
                                            ("fused", "x"), ("fused", "codes")])
@pytest.mark.parametrize("tokens", [6, 20])
def test_swapped_k2_settings_launch_bound_as_lora_linear_launches_them(path, kind, tokens,
                                                                      monkeypatch, request):
    # Settings that swap K2's decode tiles (as a tuner cache may give them; the interpreter
    # reads the heuristic, patched here): a projection binds the weight's TMA descriptor and
    # launches what lora_linear launches, with the same bits.
    heuristic = launch.heuristic_config

    def swapped(op, tokens, n, k, rank, slices=(), *args, **kwargs):
        cfg = heuristic(op, tokens, n, k, rank, slices, *args, **kwargs)
        if op != "lora_gemm" or tokens > 32:
            return cfg
        return launch.LaunchConfig(block_m=cfg.block_m, block_n=64, block_k=32, block_r=16,
                                   split_k=2, num_stages=3, swap_ab=True)

    monkeypatch.setattr(launch, "heuristic_config", swapped)
    launch.clear_table_cache()  # the settings memos: derived here with the patch, then again
    request.addfinalizer(launch.clear_table_cache)
    x, weight, w_scale, lora, batch = make_problem(5, tokens, 96, (64, 64, 32), RANK, SLOTS,
                                                   "mixed_with_base")
    given, quantized = _inputs(kind, x)
    launched = _launches(monkeypatch)
    want = ek.lora_linear(given, weight, w_scale, lora, batch, path=path,
                          x_quantized=quantized)
    unbound = launched.copy()
    launched.clear()
    k2 = unbound[-1][2]
    assert k2["SWAP_AB"] and k2["W_TMA"] and k2["w_desc"][0] == "descriptor"
    assert k2["A_TMA"] == (kind == "x")  # K1 sorts the codes it makes for TMA reads
    bound = ek.LoraProjection(weight, w_scale, lora)
    assert_bitwise_equal(bound(given, batch, path=path, x_quantized=quantized), want,
                         name="bound, swapped")
    assert launched == unbound
