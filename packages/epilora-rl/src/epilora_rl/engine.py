"""The rollout engine: vLLM in this process, serving the policy's adapter straight from the
trainer's memory.

`publish` builds vLLM's own `LoRAModel` from the adapter's tensors (`from_lora_tensors`, which
packs q/k/v and gate/up and folds alpha / r into B as loading a file does) and adds it to the
engine's adapter manager under the next version's id; requests name that id, so vLLM finds it
loaded and reads no file. The previous version is removed. The engine is the run's: an adapter
loaded into it from elsewhere evicts the policy (one slot). Modes: `matched` (epilora-vllm's
W8A16 mode: the trainer's arithmetic) or `w8a8` (vLLM's FP8 with epilora-vllm's kernels).
"""

import contextlib
import os
from dataclasses import dataclass

import torch

from epilora_rl.config import RunConfig
from epilora_rl.model import engine_model

MEMORY_PATH = "memory://epilora-rl/v{version}"  # vLLM requires a path; nothing reads it


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    engine_logps: list[float]  # the engine's log-probability of each sampled token
    text: str


@contextlib.contextmanager
def _environment(**values: str):
    # Set for the engine's construction only (vLLM and epilora-vllm read them then): a process
    # that starts other engines afterwards, e.g. a test session, does not inherit them.
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_engine(config: RunConfig):
    """The in-process vLLM engine of the run (LoRA on, one slot, the run's rank)."""
    # In process: the trainer reaches into the engine's model. Matched: epilora-vllm's W8A16.
    with _environment(VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      EPILORA_VLLM_MATCHED="1" if config.engine.mode == "matched" else "0"):
        return _make_engine(config)


def _make_engine(config: RunConfig):
    from vllm import LLM

    e = config.engine
    memory = ({"kv_cache_memory_bytes": e.kv_cache_memory_bytes} if e.kv_cache_memory_bytes
              else {"gpu_memory_utilization": e.gpu_memory_utilization})
    if e.release_kv_cache:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("[engine] release_kv_cache needs a CUDA GPU (vLLM's cumem pool)")
        memory.update(enable_sleep_mode=True)
    llm = LLM(config.model.path, quantization=config.model.quantization, enable_lora=True,
              max_loras=1, max_lora_rank=_vllm_rank(config.lora.rank),
              max_model_len=e.max_model_len, dtype="bfloat16", seed=config.run.seed,
              enforce_eager=e.enforce_eager,
              # The sampled tokens' log-probabilities after temperature, as the trainer computes
              # them (TRL's choice too): the importance ratio and the mismatch compare like with
              # like.
              logprobs_mode="processed_logprobs", **memory)
    if e.release_kv_cache:
        # vLLM 0.26's EngineArgs do not take `sleep_mode_backend`; the worker reads it from its
        # model config at its first sleep.
        from epilora_rl import kv_release

        worker = llm.llm_engine.model_executor.driver_worker.worker
        worker.vllm_config.model_config.sleep_mode_backend = kv_release.register()
    return llm


def _vllm_rank(rank: int) -> int:
    # vLLM accepts only these max_lora_rank values.
    return next(r for r in (8, 16, 32, 64, 128) if r >= rank)


def adapter_config(config: RunConfig) -> dict:
    """The adapter's `adapter_config.json` (PEFT's LoRA fields vLLM reads)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.lora.rank,
            "lora_alpha": config.lora.alpha, "target_modules": list(config.lora.target_modules),
            "bias": "none", "base_model_name_or_path": config.model.path}


def publish(llm, tensors: dict[str, torch.Tensor], config: RunConfig, version: int):
    """Make `tensors` (PEFT names, bf16) the engine's adapter `version` (>= 1) and drop the
    previous one; returns the `LoRARequest` that generates with it."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest

    manager = engine_model(llm).lora_manager
    helper = PEFTHelper.from_dict(adapter_config(config))
    helper.validate_legal(manager.lora_config)
    # Copies: vLLM folds alpha / r into B in place, and the caller's tensors are the adapter
    # it saves.
    lora = LoRAModel.from_lora_tensors(version, {k: v.clone() for k, v in tensors.items()},
                                       helper, device="cpu", dtype=torch.bfloat16,
                                       model_vocab_size=manager.vocab_size)
    for old in list(manager.list_adapters()):
        manager.remove_adapter(old)
    manager.add_adapter(lora)
    return LoRARequest(f"policy-v{version}", version, MEMORY_PATH.format(version=version))


def generate(llm, tokenizer, task_prompts: list, lora_request, *, n: int, max_tokens: int,
             temperature: float, seed: int) -> list[list[Rollout]]:
    """`n` samples of each of a task's prompts (`epilora_rl.tasks.Prompt`), seeded: the same
    call gives the same samples. vLLM seeds a prompt's k-th sample `seed + k`, so prompt i
    takes `seed + i * n`: no two samples of the call share a random stream (they take
    `seed .. seed + len(task_prompts) * n - 1`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [p.token_ids(tokenizer) for p in task_prompts]
    params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, logprobs=0,
                             seed=seed + i * n, detokenize=False) for i in range(len(prompts))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        lora_request=lora_request, use_tqdm=False)
    groups = []
    for prompt, out in zip(prompts, outs, strict=True):
        group = []
        for c in out.outputs:
            ids = list(c.token_ids)
            logps = [step[t].logprob for step, t in zip(c.logprobs, ids, strict=True)]
            group.append(Rollout(prompt, ids, logps, tokenizer.decode(ids,
                                                                       skip_special_tokens=True)))
        groups.append(group)
    return groups
