"""The timed dispatch (EPILORA_VLLM_DISPATCH=timed) without a GPU: buckets, the choice of the
fastest candidate with a stand-in timer, the file that makes a later start time nothing,
failures and captures, and the layer's side (candidates built only when timing, a choice
remembered). What it chooses on the H200 is measured there (tests/gpu)."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from epilora_vllm import _env, dispatch
from epilora_vllm.forward import EpiloraForward

CASE = dispatch.Case(4096, (4096, 1024, 1024), 64, 4, False, True, 16)


def test_buckets_are_powers_of_two_at_or_above_the_batch():
    assert [dispatch.bucket(t) for t in (1, 2, 3, 16, 17, 24, 513, 8192)] == [
        1, 2, 4, 16, 32, 32, 1024, 8192]
    with pytest.raises(ValueError, match="0 tokens"):
        dispatch.bucket(0)


def test_case_keys_tell_every_field_apart():
    fields = [dispatch.Case(4096, (4096, 1024, 1024), 64, 4, False, True, 16),
              dispatch.Case(4096, (4096, 1024, 1024), 64, 4, False, True, 32),
              dispatch.Case(4096, (4096, 1024, 1024), 64, 4, False, False, 16),
              dispatch.Case(4096, (4096, 1024, 1024), 64, 4, True, True, 16),
              dispatch.Case(4096, (4096, 1024, 1024), 64, 8, False, True, 16),
              dispatch.Case(4096, (4096, 1024, 1024), 128, 4, False, True, 16),
              dispatch.Case(4096, (4096, 2048), 64, 4, False, True, 16),
              dispatch.Case(2048, (4096, 1024, 1024), 64, 4, False, True, 16)]
    assert len({case.key() for case in fields}) == len(fields)


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
    monkeypatch.setattr(dispatch, "_capturing", lambda: True)
    capturing = dispatch.TimedDispatch(path, lambda run: pytest.fail("timed in a capture"))
    assert capturing.choose(CASE, _never, "decode") == ("decode", False)


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


def test_the_layer_asks_once_per_bucket_and_runs_the_choice(monkeypatch):
    layer = _Layer()
    layer.applied = []
    weight = torch.zeros(8, 4, dtype=torch.float8_e4m3fn)
    layer._base = SimpleNamespace(weight=lambda base: weight,
                                  scale=lambda base: torch.ones(1))
    layer.base_layer = None
    forward = EpiloraForward(layer)
    forward.lora = SimpleNamespace(in_features=4, output_slices=(8,), max_rank=16, max_loras=1)
    asked = []

    class Fake:
        def choose(self, case, candidates, fallback):
            runs = candidates()
            asked.append((case.tokens, case.several_slots, sorted(runs), fallback))
            runs["vllm"]()  # a candidate is a call of that path on this batch
            return "vllm", True

    monkeypatch.setattr(dispatch, "for_device", lambda device: Fake())
    batch = SimpleNamespace(num_entries=2)
    for tokens in (3, 4, 3):
        x = torch.zeros(tokens, 4)
        assert forward._timed_path(x, None, None, batch, fallback="fused") == "vllm"
    # Buckets 4 and 4: asked once. On the CPU no kernel path is supported: vLLM's alone.
    assert asked == [(4, False, ["vllm"], "fused")]
    assert layer.applied == [3]
    assert forward._run("vllm", torch.zeros(5, 4), None, None, batch).shape[0] == 5
