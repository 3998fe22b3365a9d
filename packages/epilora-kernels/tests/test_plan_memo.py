"""The fused path's launch settings, derived once per shape, token count, weight alignment and
launch table (`fused._plan`): a repeated call derives nothing, and each of those makes its own
plan. The launches are recorded, not run (the settings are the subject)."""

import pytest
import torch

from epilora_kernels import _launchers, fused, launch
from epilora_kernels.arch import DeviceSupport

from kernel_cases import make_problem

SM90 = DeviceSupport("NVIDIA H200", (9, 0), fp8_mma=True, pdl=True, tma=True, interpreter=False)


@pytest.fixture
def derived(monkeypatch):
    """The token count of each call that derived its settings (a reused plan adds none);
    launches recorded, not run."""
    calls = []
    settings = fused._settings
    monkeypatch.setattr(fused, "_settings", lambda *a, **kw: calls.append(a[6].num_tokens)
                        or settings(*a, **kw))
    monkeypatch.setattr(fused, "_support", lambda x, path: SM90)  # the H200's tables
    monkeypatch.setattr(_launchers, "launch_k1", lambda *a, **kw: (None, None, None))
    monkeypatch.setattr(_launchers, "launch_k2", lambda *a, **kw: kw.get("y", a[7]))
    return calls


def _call(t, weight=None):
    x, w, w_scale, lora, batch = make_problem(1, t, 256, (128, 64), 16, 3, "mixed_with_base")
    fused.fused_lora_fp8_linear(x, w if weight is None else weight, w_scale, lora, batch)
    return w


def test_a_repeated_call_derives_nothing_and_each_token_count_its_own(derived):
    _call(70)
    _call(70)
    _call(80)
    assert derived == [70, 80]


def test_a_misaligned_weight_and_another_table_get_their_own_plans(derived, monkeypatch):
    weight = _call(300)
    misaligned = torch.empty(weight.numel() + 1, dtype=weight.dtype)[1:].view(weight.shape)
    misaligned.copy_(weight)  # rows no longer 16-byte aligned: no TMA
    _call(300, weight=misaligned)
    monkeypatch.setenv("EPILORA_LAUNCH_TABLES", "0")  # the heuristic alone
    _call(300)
    assert derived == [300, 300, 300]
    plans = list(fused._PLANS.values())
    assert plans[0][3] and not plans[1][3]  # codes sorted for K2's TMA, then not
    launch.clear_table_cache()
    assert fused._PLANS == {}
