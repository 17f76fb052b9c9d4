"""Multi-turn episodes as the trainer's Groups: one Sample per training sequence, its loss mask carried along.

A sequence's prompt is what comes before its first trained token (the system and user messages of turn 1 and the
template); everything after is the response, with loss only on the sampled tokens. A branching episode gives one
Sample per leaf, all with the episode's reward.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpcrl.rollout.data import Example
from hpcrl.rollout.generate import Group, Sample
from hpcrl.sessions.environment import EpisodeResult

__all__ = ["group_from_episodes"]


def group_from_episodes(example: Example, results: Sequence[EpisodeResult]) -> Group:
    """The Group of one dataset row's episodes; an episode without a sampled token trains nothing and is left out."""
    group = Group(example=example)
    for result in results:
        for seq in result.sequences:
            mask = seq["loss_mask"]
            start = next((i for i, m in enumerate(mask) if m), None)
            if start is None:
                continue
            group.samples.append(
                Sample(
                    prompt_ids=seq["token_ids"][:start],
                    output_ids=seq["token_ids"][start:],
                    logprobs=seq["logprobs"][start:],
                    text=str(result.messages[-1].get("content") or ""),
                    finish=seq["finish_reason"],
                    weight_versions=seq["weight_versions"][start:],
                    reward=result.reward,
                    reward_error=result.reward_error,
                    loss_mask=mask[start:],
                )
            )
    return group
