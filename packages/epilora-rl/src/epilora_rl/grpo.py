"""GRPO's objective, in TRL's definitions (trl 1.16 `GRPOTrainer`): group-normalized advantages,
a per-token clipped ratio, an optional KL to the base, truncated importance sampling of the
engine's samples, and the token aggregations TRL names by `loss_type`.

Tensors are `[B, T]` over completion tokens (`mask` 1 where a token counts), B = prompts x G.
"""

import math
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass(frozen=True)
class GrpoLoss:
    """The objective's settings, named and defaulted as TRL's `GRPOConfig` names them.

    loss_type: how per-token losses become one number: `grpo` (mean over each sequence's
        tokens, then over sequences), `bnpo` (mean over the batch's tokens), `dr_grpo` (sum over
        tokens / (B x max_completion_length)), `dapo` (sum over tokens / the tokens of the whole
        generation batch, `num_items_in_batch`: TRL's default).
    epsilon_low, epsilon_high: the ratio's clip range [1 - low, 1 + high].
    beta: weight of the k3 estimate of KL(policy || base) per token (0: no reference needed).
    tis_cap: truncated importance sampling of engine samples, per token: the loss is weighted by
        min(exp(trainer's logp at sampling - engine's logp), cap) (TRL's `token_truncate`); None
        for rollouts that need no correction (the matched engine).
    max_completion_length: dr_grpo's constant denominator.
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    tis_cap: float | None = None
    max_completion_length: int | None = None

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: expected one of {LOSS_TYPES}")
        if not (0 <= self.epsilon_low < 1 and self.epsilon_high >= 0):
            raise ValueError(f"epsilon_low={self.epsilon_low}, epsilon_high={self.epsilon_high}:"
                             " need 0 <= low < 1 and high >= 0")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta}: must be >= 0")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            raise ValueError(f"tis_cap={self.tis_cap}: must be >= 1 (or None)")
        if self.loss_type == "dr_grpo" and not (self.max_completion_length or 0) > 0:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")

    def __call__(self, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, *, ref_logps: torch.Tensor | None = None,
                 engine_logps: torch.Tensor | None = None,
                 num_items_in_batch: float | torch.Tensor | None = None,
                 accumulation_steps: int = 1) -> torch.Tensor:
        """The loss of one micro-batch (already divided for `accumulation_steps` of them).

        logps: the trainer's per-token log-probabilities (with gradient); old_logps: the same
        before this step's updates (detached; `logps.detach()` on the first pass); advantages
        `[B]`; ref_logps: the base's, when beta > 0; engine_logps: the engine's at sampling,
        when tis_cap is set; num_items_in_batch: `dapo`'s denominator, the completion tokens of
        the whole generation batch (default: this micro-batch's)."""
        mask = mask.to(logps.dtype)
        adv = advantages[:, None] if advantages.dim() == 1 else advantages
        ratio = torch.exp(logps - old_logps)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        if self.tis_cap is not None:
            if engine_logps is None:
                raise ValueError("tis_cap is set: pass engine_logps")
            diff = torch.nan_to_num((old_logps - engine_logps) * mask, nan=0.0)
            per_token = per_token * torch.clamp(torch.exp(diff), max=self.tis_cap)
        if self.beta:
            if ref_logps is None:
                raise ValueError("beta > 0: pass ref_logps")
            per_token = per_token + self.beta * kl_k3(logps, ref_logps)
        total = per_token * mask
        if self.loss_type == "grpo":
            loss = (total.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif self.loss_type == "bnpo":
            loss = total.sum() / mask.sum().clamp(min=1.0)
        elif self.loss_type == "dr_grpo":
            loss = total.sum() / (per_token.shape[0] * self.max_completion_length)
        else:  # dapo: the generation batch's tokens, whatever micro-batch this is
            items = mask.sum() if num_items_in_batch is None else num_items_in_batch
            return total.sum() / torch.as_tensor(items, dtype=total.dtype).clamp(min=1.0)
        return loss / accumulation_steps


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per token, Schulman's k3 estimate of KL(policy || reference): exp(d) - d - 1 with
    d = ref - policy (>= 0, unbiased on the policy's samples)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def group_advantages(rewards: torch.Tensor, group_size: int, *,
                     scale_rewards: str = "group") -> torch.Tensor:
    """`[B]` advantages of rewards `[B]` in groups of `group_size` consecutive samples (one
    prompt's): reward minus its group's mean, divided by the group's (or the batch's) standard
    deviation (unbiased) + 1e-4, or not divided (`none`)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: expected one of {SCALE_REWARDS}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = _std(groups, dim=1).repeat_interleave(group_size)
    else:
        std = _std(rewards.reshape(1, -1), dim=1).expand_as(rewards)
    return centred / (std + 1e-4)


def _std(x: torch.Tensor, dim: int) -> torch.Tensor:
    # Unbiased, and 0 (not NaN) for one sample, as TRL's nanstd without NaNs.
    n = x.shape[dim]
    if n < 2:
        return torch.zeros(x.shape[:dim] + x.shape[dim + 1:], dtype=x.dtype, device=x.device)
    return x.std(dim=dim, correction=1)


def mean_token_kl(engine_logps: torch.Tensor, trainer_logps: torch.Tensor,
                  mask: torch.Tensor) -> float:
    """Per-token KL(engine || trainer) on the engine's own samples (k3, as `kl_k3` with the
    engine as the sampling policy), averaged over the tokens of `mask`: the engine-trainer
    mismatch."""
    kl = kl_k3(engine_logps, trainer_logps) * mask
    count = float(mask.sum())
    return float(kl.sum()) / count if count else math.nan
