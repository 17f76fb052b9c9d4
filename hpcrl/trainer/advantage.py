"""Group-relative advantages (GRPO).

A group is every sample drawn for one prompt; advantages compare a sample only with its siblings, so
no value model is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hpcrl.trainer.batch import TrainBatch

if TYPE_CHECKING:
    from hpcrl.samples.sample import Group

__all__ = ["Overlong", "batch_from_groups", "group_advantages", "zero_std_group_share"]


def _check_rewards(rewards: Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating tensor, got {rewards.dtype}")
    if rewards.shape[1] == 0:
        raise ValueError("rewards must have group_size >= 1")


def _constant_groups(rewards: Tensor) -> Tensor:
    # Exact equality rather than std == 0: the mean of identical floats can differ from them by an ulp,
    # which would turn a constant group into a tiny nonzero std and a huge advantage.
    return (rewards == rewards[:, :1]).all(dim=1)


def group_advantages(rewards: Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages ``(r - mean_group) / (std_group + eps)`` of shape ``[num_groups, group_size]``.

    The std is the population std (``unbiased=False``): the group is the whole set being compared, not a
    sample of a larger one, and it stays defined for a group of one. With ``normalize_std=False`` the
    advantages are only centred (Dr. GRPO style). Groups whose rewards are all equal carry no learning
    signal and get exactly 0, never NaN or rounding noise.
    """
    _check_rewards(rewards)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    mean = rewards.mean(dim=1, keepdim=True)
    adv = rewards - mean
    if normalize_std:
        std = rewards.std(dim=1, unbiased=False, keepdim=True)
        # A constant group would divide 0 by eps (or by 0); it is zeroed below, so keep the divisor sane.
        adv = adv / (std + eps).clamp_min(torch.finfo(rewards.dtype).tiny)
    return torch.where(_constant_groups(rewards)[:, None], torch.zeros_like(adv), adv)


def zero_std_group_share(rewards: Tensor) -> float:
    """Share of groups whose rewards are all equal (they contribute no policy gradient)."""
    _check_rewards(rewards)
    if rewards.shape[0] == 0:
        return 0.0
    return _constant_groups(rewards).float().mean().item()


@dataclass(frozen=True)
class Overlong:
    """DAPO's treatment of long answers (Yu et al. 2025, "DAPO"): a soft length penalty and the truncated masked.

    ``penalty(n)`` for an answer of ``n`` tokens with budget ``L = max_new_tokens`` and window ``W``: 0 up to
    ``L - W`` tokens, then falling linearly to ``-penalty`` at ``L`` (DAPO's overlong reward shaping), added to
    the reward before the group's advantages. ``mask_truncated``: answers cut at the budget (finish ``length``)
    leave the loss (overlong filtering): a cut answer's reward says nothing about its unfinished reasoning.
    """

    max_new_tokens: int
    window_tokens: int = 0
    penalty: float = 1.0
    mask_truncated: bool = False

    def penalty_of(self, num_tokens: int) -> float:
        if self.window_tokens == 0:
            return 0.0
        over = num_tokens - (self.max_new_tokens - self.window_tokens)
        return -self.penalty * min(max(over, 0), self.window_tokens) / self.window_tokens


def batch_from_groups(groups: list[Group], *, normalize_std: bool, overlong: Overlong | None = None) -> TrainBatch:
    """The trainer's batch of a step's scored groups: every sample, with its group-relative advantage."""
    rewards = []
    for g in groups:
        valid = [s.reward for s in g.samples if s.reward_error is None]
        fill = sum(valid) / len(valid) if valid else 0.0
        # A sample whose reward failed gets the group mean: advantage 0, so it teaches nothing.
        row = [s.reward if s.reward_error is None else fill for s in g.samples]
        if overlong is not None:
            row = [r + overlong.penalty_of(len(s.output_ids)) for r, s in zip(row, g.samples, strict=True)]
        rewards.append(row)
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), normalize_std=normalize_std).flatten()
    samples = [s for g in groups for s in g.samples]
    masks = [s.loss_mask for s in samples]
    if overlong is not None and overlong.mask_truncated:
        masks = [[0] * len(s.output_ids) if s.finish == "length" else m for s, m in zip(samples, masks, strict=True)]
        if all(s.finish == "length" for s in samples):
            raise ValueError(
                f"every sample of the step was cut at rollout.max_new_tokens={overlong.max_new_tokens}, and "
                "train.mask_truncated leaves them all out of the loss: raise rollout.max_new_tokens, or set "
                "train.mask_truncated=false until answers fit"
            )
    with_supports = [s.supports is not None for s in samples]
    if any(with_supports) and not all(with_supports):
        raise ValueError("some samples carry sampling supports and others do not; a batch is replayed whole or not")
    return TrainBatch.from_sequences(
        [s.prompt_ids for s in samples],
        [s.output_ids for s in samples],
        advantages=adv.tolist(),
        rollout_logprobs=[s.logprobs for s in samples],
        supports=[s.supports for s in samples if s.supports is not None] if any(with_supports) else None,
        response_masks=masks,
        routed_experts=[s.routed_experts for s in samples]
        if any(s.routed_experts is not None for s in samples)
        else None,
    )
