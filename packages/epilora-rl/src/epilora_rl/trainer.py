"""The GRPO loop on one GPU (or a CPU): rollouts from the in-process engine, the loss on the
trainer over the engine's own weights, AdamW on the adapter, the new adapter published to the
engine from memory, and the step's files, after every step.

A run resumes from its out_dir: the last finished step's adapter, optimizer and records are
reloaded, and the next step is the one after it. Prompts are the task's by index and every
rollout's sampling seed is fixed by (run seed, step), so a resumed run takes the steps an
uninterrupted one takes, none lost or repeated.
"""

import contextlib
import math
import os
import time
from pathlib import Path

import torch

from epilora_rl import _env
from epilora_rl.checkpoint import adapter_dir, load_state, save_adapter, save_state
from epilora_rl.config import RunConfig
from epilora_rl.engine import adapter_config, generate, make_engine, publish
from epilora_rl.grpo import group_advantages, kl_k3
from epilora_rl.linear import LoraLinear
from epilora_rl.model import adapter_state_dict, trainable_model
from epilora_rl.tasks import make_task


def _crash_here(point: str, step: int) -> None:
    if _env.crash_point() == (point, step):
        os._exit(75)  # as a kill would: no cleanup, no files flushed


@contextlib.contextmanager
def adapters_off(model):
    """The base model: every adapter's contribution zero (beta > 0's reference)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    saved = [m.scaling for m in layers]
    for m in layers:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, s in zip(layers, saved, strict=True):
            m.scaling = s


class OutDirHoldsAnotherRun(ValueError):
    """The run's out_dir holds the state of a run with another config (refused before any
    engine starts: resuming it would mix two runs' steps)."""


class GrpoRun:
    """One training run of `config` (see `epilora_rl.config`); `task` overrides the config's."""

    def __init__(self, config: RunConfig, *, task=None):
        from transformers import AutoTokenizer

        self.config = config
        self.out_dir = Path(config.run.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = load_state(self.out_dir)
        if state is not None and state["config"] != config.as_dict():
            raise OutDirHoldsAnotherRun(f"{self.out_dir} holds a run with another config; use "
                                        "another out_dir, or the same config to resume it")
        torch.manual_seed(config.run.seed)  # the adapter's initialization
        self.llm = make_engine(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.model = trainable_model(self.llm, config.model.path, rank=config.lora.rank,
                                     alpha=config.lora.alpha,
                                     target_modules=config.lora.target_modules)
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        o = config.optim
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=o.lr, betas=o.betas,
                                           weight_decay=o.weight_decay)
        self.task = task or make_task(config.task.name, self.tokenizer, seed=config.run.seed,
                                      options=config.task.options, answer=config.task.answer)
        self.loss = config.loss()
        self.step, self.records, self.evals = 0, [], {}
        if state is not None:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(state["adapter"][name])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step, self.records, self.evals = state["step"], state["records"], state["evals"]
        self.request = publish(self.llm, adapter_state_dict(self.model), config,
                               version=self.step + 1)

    # -- one step --------------------------------------------------------------------------

    def train_step(self) -> dict:
        c, s = self.config, self.step
        g = c.grpo
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        prompts = [self.task.prompt(s * g.prompts_per_step + i) for i in range(g.prompts_per_step)]
        begin = step_begin = time.perf_counter()
        # A step's samples take seeds base .. base + prompts * group - 1 (generate): steps
        # spaced that far apart share none.
        per_step = g.prompts_per_step * g.group_size
        groups = generate(self.llm, self.tokenizer, prompts, self.request,
                          n=g.group_size, max_tokens=g.max_completion_tokens,
                          temperature=g.temperature,
                          seed=c.run.seed * 1_000_003 + s * per_step)
        generate_s = time.perf_counter() - begin
        _crash_here("rollout", s)
        rollouts = [r for group in groups for r in group]
        rewards = torch.tensor([self.task.reward(r.text, r.completion_ids, p)
                                for p, group in zip(prompts, groups, strict=True) for r in group],
                               dtype=torch.float32)
        advantages = group_advantages(rewards, g.group_size)

        begin = time.perf_counter()
        released = self._release_kv_cache()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = sum(len(r.completion_ids) for r in rollouts)
        chunks = [list(range(i, min(i + g.micro_batch_size, len(rollouts))))
                  for i in range(0, len(rollouts), g.micro_batch_size)]
        kl_sum = 0.0
        for chunk in chunks:
            batch = [rollouts[i] for i in chunk]
            logps, mask, engine = self.completion_logps(batch)
            ref = None
            if self.loss.beta:
                with torch.no_grad(), adapters_off(self.model):
                    ref = self.completion_logps(batch)[0]
            loss = self.loss(logps, logps.detach(), advantages[chunk].to(logps.device), mask,
                             ref_logps=ref, engine_logps=engine, num_items_in_batch=tokens,
                             accumulation_steps=len(chunks))
            loss.backward()
            kl_sum += float((kl_k3(engine, logps.detach()) * mask).sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(  # 0: measured, not clipped (as HF's)
            list(self.params.values()), c.optim.max_grad_norm or math.inf)
        self.optimizer.step()
        if released is not None:
            self.llm.wake_up()
        train_s = time.perf_counter() - begin
        _crash_here("update", s)

        self.step += 1
        tensors = adapter_state_dict(self.model)
        self.request = publish(self.llm, tensors, c, version=self.step + 1)
        save_adapter(adapter_dir(self.out_dir, self.step), tensors, adapter_config(c))
        _crash_here("checkpoint", s)
        record = {"step": self.step, "adapter_version": self.step,
                  "reward": float(rewards.mean()),
                  "accuracy": float((rewards == 1).float().mean()),
                  "kl_per_token": kl_sum / max(tokens, 1), "tokens": tokens,
                  "grad_norm": float(grad_norm), "generate_s": generate_s, "train_s": train_s,
                  # the whole step: rollouts, rewards, update, publish and the step's files
                  "step_s": time.perf_counter() - step_begin,
                  "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                  "kv_released_gib": released}
        self.records.append(record)
        self._save()
        return record

    def _release_kv_cache(self) -> float | None:
        """With `release_kv_cache`: the engine's KV cache freed for the update; the GiB freed."""
        if not self.config.engine.release_kv_cache:
            return None
        free = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=1)
        return (torch.cuda.mem_get_info()[0] - free) / 2**30

    def completion_logps(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The trainer's log-probabilities of each rollout's completion tokens `[b, T]` (at the
        sampling temperature), the tokens' mask and the engine's log-probabilities."""
        device = next(iter(self.params.values())).device
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in batch]
        width = max(len(r.completion_ids) for r in batch)
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        attention = torch.zeros_like(ids)
        positions = torch.zeros(len(batch), max(width, 1), dtype=torch.long)
        mask = torch.zeros(len(batch), max(width, 1))
        engine = torch.zeros(len(batch), max(width, 1))
        for j, r in enumerate(batch):
            seq = r.prompt_ids + r.completion_ids
            ids[j, : len(seq)] = torch.tensor(seq)
            attention[j, : len(seq)] = 1
            n = len(r.completion_ids)
            # logits at position t predict token t + 1: the completion's from the prompt's last.
            positions[j, :n] = torch.arange(len(r.prompt_ids) - 1, len(seq) - 1)
            mask[j, :n] = 1
            engine[j, :n] = torch.tensor(r.engine_logps)
        logits = self.model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
        rows = torch.arange(len(batch))[:, None]
        picked = logits[rows, positions.to(device)].float() / self.config.grpo.temperature
        targets = ids.gather(1, (positions + 1).clamp(max=ids.shape[1] - 1)).to(device)
        logps = picked.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        return logps, mask.to(device), engine.to(device)

    # -- evaluation, files -----------------------------------------------------------------

    def evaluate(self, name: str) -> float:
        """Greedy accuracy on the task's held-out prompts with the current adapter."""
        n = self.config.task.eval_size
        if not n:
            return math.nan
        prompts = [self.task.prompt(i, held_out=True) for i in range(n)]
        groups = generate(self.llm, self.tokenizer, prompts, self.request,
                          n=1, max_tokens=self.config.grpo.max_completion_tokens,
                          temperature=0.0, seed=0)
        scores = [self.task.reward(g[0].text, g[0].completion_ids, p) == 1
                  for p, g in zip(prompts, groups, strict=True)]
        self.evals[name] = sum(scores) / n
        self._save()
        return self.evals[name]

    def _save(self) -> None:
        save_state(self.out_dir, {
            "step": self.step, "records": self.records, "evals": self.evals,
            "config": self.config.as_dict(),
            "adapter": {n: p.detach().cpu().clone() for n, p in self.params.items()},
            "optimizer": self.optimizer.state_dict()})
