"""The GRPO loop on the H200: the engine's matched mode on epilora-kernels' W8A16 kernel, the
trainer's linear on its Triton kernels, two steps from rollout to the next rollout on the
published adapter (the CPU test's checks, tests/train_cases.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from train_cases import check_two_steps, run_config, tiny_fp8_model  # noqa: E402

pytestmark = pytest.mark.vllm


def test_two_steps_on_the_gpu(tmp_path):
    run = check_two_steps(tiny_fp8_model(tmp_path), tmp_path)
    assert all(r["peak_gpu_gib"] is not None for r in run.records)
    assert next(iter(run.params.values())).is_cuda


@pytest.mark.parametrize("release", [False, True], ids=["kv-kept", "kv-released"])
def test_the_base_model_answers_alike_before_and_after_training(tmp_path, release):
    # With the KV cache released in each update, also after a bare sleep and wake.
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from epilora_rl.config import load_config
    from epilora_rl.trainer import GrpoRun

    extra = "\nrelease_kv_cache = true" if release else ""
    config = run_config(tmp_path, tiny_fp8_model(tmp_path), "kv", steps=2, kv_bytes=2 << 30,
                        engine_extra=extra)
    run = GrpoRun(load_config(config))
    prompt = [TokensPrompt(prompt_token_ids=[1, 17, 42, 99, 7, 300])]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, detokenize=False)

    def base_answer():  # no adapter: what the shared weights alone compute
        (out,) = run.llm.generate(prompt, params, use_tqdm=False)
        c = out.outputs[0]
        return list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids,
                                                                 strict=True)]

    before = base_answer()
    if release:
        run.llm.sleep(level=1)
        run.llm.wake_up()
        assert base_answer() == before, "a bare sleep and wake changed the answer"
    records = [run.train_step(), run.train_step()]
    if release:
        assert all(r["kv_released_gib"] > 1.9 for r in records), records
    assert base_answer() == before
