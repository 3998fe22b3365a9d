"""GRPO's objective against TRL's GRPOTrainer on the same tensors: each `loss_type` we offer,
with and without the KL term and truncated importance sampling, the loss and its gradient;
TRL's `_compute_loss` is called with its model forward replaced by the given log-probs."""

import os
import types
from collections import defaultdict

import pytest
import torch

from epilora_rl.grpo import LOSS_TYPES, GrpoLoss, group_advantages, kl_k3, mean_token_kl

B, T, G = 6, 7, 3


@pytest.fixture(scope="module")
def trl():
    """TRL's GRPOTrainer and nanstd. Importing TRL sets environment variables (among them
    VLLM_LOGGING_LEVEL=ERROR, which silenced a later test's vLLM server): they are undone."""
    saved = dict(os.environ)
    try:
        from trl.trainer.grpo_trainer import GRPOTrainer
        from trl.trainer.utils import nanstd
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return types.SimpleNamespace(GRPOTrainer=GRPOTrainer, nanstd=nanstd)


def _tensors(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    old = logps + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3  # clips some
    ref = logps + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.2
    engine = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5
    mask = (torch.rand(B, T, generator=gen) < 0.8).to(torch.float64)
    mask[:, 0] = 1
    rewards = torch.randint(0, 2, (B,), generator=gen).to(torch.float64)
    return logps, old, ref, engine, mask, group_advantages(rewards, G)


def _trl_loss(trl, loss: GrpoLoss, logps, old, ref, engine, mask, adv, items, accumulation):
    tis = loss.tis_cap is not None
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps),
                                                            None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=loss.beta, loss_type=loss.loss_type,
        epsilon_low=loss.epsilon_low, epsilon_high=loss.epsilon_high,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None,
                                   steps_per_generation=accumulation),
        use_vllm=tis, vllm_importance_sampling_correction=tis,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation,
        max_completion_length=loss.max_completion_length,
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda t: t,
                                          reduce=lambda t, reduction: t, sync_gradients=True),
        _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)))
    inputs = {"prompt_ids": torch.ones(B, 2, dtype=torch.long),
              "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.ones(B, T, dtype=torch.long),
              "completion_mask": mask, "advantages": adv, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": torch.tensor(items)}
    if tis:  # what TRL's rollout step computes for vllm_importance_sampling_mode=token_truncate
        inputs["importance_sampling_ratio"] = torch.clamp(
            torch.exp(torch.nan_to_num((old - engine) * mask, nan=0.0)),
            max=loss.tis_cap)
    return trl.GRPOTrainer._compute_loss(fake, None, inputs)


@pytest.mark.parametrize("tis_cap", [None, 2.0], ids=["no-tis", "tis"])
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-kl", "kl"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_loss_and_its_gradient_are_trls(trl, loss_type, beta, tis_cap):
    loss = GrpoLoss(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=beta,
                    tis_cap=tis_cap, max_completion_length=T)
    logps, old, ref, engine, mask, adv = _tensors(seed=len(loss_type) + int(beta * 100))
    items, accumulation = float(mask.sum()) * 2, 2  # this micro-batch is half the generation's
    ours_in, theirs_in = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    ours = loss(ours_in, old, adv, mask, ref_logps=ref, engine_logps=engine,
                num_items_in_batch=items, accumulation_steps=accumulation)
    theirs = _trl_loss(trl, loss, theirs_in, old, ref, engine, mask, adv, items, accumulation)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    ours.backward()
    theirs.backward()
    assert ours_in.grad.abs().sum() > 0
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-12, atol=1e-12)


def test_group_advantages_are_trls(trl):
    nanstd = trl.nanstd
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0, 2.0])
    mean = rewards.view(-1, 3).mean(dim=1).repeat_interleave(3)
    std = nanstd(rewards.view(-1, 3), dim=1).repeat_interleave(3)
    torch.testing.assert_close(group_advantages(rewards, 3), (rewards - mean) / (std + 1e-4))
    assert (group_advantages(rewards, 3)[3:6] == 0).all()  # one reward for all: no signal
    batch = (rewards - mean) / (nanstd(rewards) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 3, scale_rewards="batch"), batch)
    torch.testing.assert_close(group_advantages(rewards, 3, scale_rewards="none"),
                               rewards - mean)


def test_the_mismatch_is_zero_for_equal_policies_and_positive_otherwise():
    logps, _, ref, _, mask, _ = _tensors(seed=0)
    assert mean_token_kl(logps, logps, mask) == 0
    assert mean_token_kl(logps, ref, mask) > 0 and (kl_k3(logps, ref) >= 0).all()


def test_bad_settings_are_refused_before_any_work():
    with pytest.raises(ValueError, match="loss_type"):
        GrpoLoss(loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        GrpoLoss(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="tis_cap"):
        GrpoLoss(tis_cap=0.5)
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    logps, old, ref, engine, mask, adv = _tensors(seed=1)
    with pytest.raises(ValueError, match="engine_logps"):
        GrpoLoss(tis_cap=2.0)(logps, old, adv, mask)
