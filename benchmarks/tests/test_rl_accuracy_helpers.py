"""benchmarks/rl_accuracy.py without a GPU: its configs are ones `epilora-rl train` accepts, its
intervals, and its rows from the runs' results."""

import math
import runpy
import statistics
import sys
from argparse import Namespace
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1]
sys.path.insert(0, str(BENCHMARKS))  # the script imports the serving benchmark's helpers
RL = runpy.run_path(str(BENCHMARKS / "rl_accuracy.py"))


def _args(**overrides):
    values = {"model_dir": "/models/bf16", "fp8_model_dir": None, "gpu_memory_utilization": 0.08,
              "kv_cache_bytes": None, "enforce_eager": False, "eval_size": 100, "steps": 3,
              "jobs": 1, **{k: None for k in RL["SIZES"]}}
    return Namespace(**{**values, **overrides})


@pytest.mark.parametrize("system", ["bf16", "matched", "w8a8-tis"])
def test_each_systems_config_is_one_the_cli_reads(system, tmp_path):
    from epilora_rl.config import load_config

    args = _args(group_size=4)
    path = tmp_path / "run.toml"
    path.write_text(RL["toml_text"](RL["run_config"](system, args, 7, tmp_path / "out")))
    config = load_config(path)
    assert config.engine.mode == RL["MODES"][system]
    assert config.model.quantization == (None if system == "bf16" else "fp8")
    assert config.task.options == RL["TASK"]["options"]
    assert (config.grpo.group_size, config.run.seed, config.run.steps) == (4, 7, 3)
    assert config.loss().tis_cap == (2.0 if system == "w8a8-tis" else None)


def test_intervals():
    low, high = RL["interval"]([0.5, 0.6, 0.7], 100)
    # t(0.975, 2 degrees of freedom) x sd / sqrt(n), around the mean.
    assert (low + high) / 2 == pytest.approx(0.6)
    assert high - low == pytest.approx(2 * 4.303 * 0.1 / math.sqrt(3))
    low, high = RL["interval"]([0.0], 50)  # one seed: Wilson, which stays inside [0, 1]
    assert low == pytest.approx(0.0, abs=1e-12) and 0 < high < 0.1
    assert RL["wilson"](50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)


def test_rows_from_two_seeds():
    def result(seed):
        records = [{"reward": 0.1 * s + seed, "kl_per_token": 1e-3 * (s + 1),
                    "generate_s": 1.0 + s, "train_s": 2.0, "peak_gpu_gib": 3.0 + s}
                   for s in range(6)]
        return {"evals": {"before": 0.2, "after": 0.4 + 0.1 * seed}, "records": records}

    rows = RL["rows_of"]("matched", {0: result(0), 1: result(1)}, _args(steps=6))
    by = {(r["metric"], r.get("phase")): r for r in rows}
    assert by[("accuracy", "after")]["value"] == pytest.approx(0.45)
    assert by[("accuracy", "after")]["samples"] == [0.4, 0.5]
    assert by[("kl_per_token", None)]["value"] == pytest.approx(3.5e-3)
    last = RL["LAST_STEPS"]
    tail = sum(0.1 * s for s in range(6 - last, 6)) / last
    assert by[("reward", None)]["value"] == pytest.approx(tail + 0.5)
    # Step time: the steps after the first of each seed; peak: the highest.
    assert by[("step_s", None)]["n"] == 10
    assert by[("step_s", None)]["value"] == statistics.median([3.0 + s for s in range(1, 6)])
    assert by[("peak_gpu_gib", None)]["value"] == 8.0
