"""Multi-turn episodes as the trainer's Groups: one Sample per training sequence, its loss mask carried along.

A sequence's prompt is what comes before its first trained token (the system and user messages of turn 1 and the
template); everything after is the response, with loss only on the sampled tokens. A branching episode gives one
Sample per leaf, all with the episode's reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hpcrl.rollout.data import Example
from hpcrl.rollout.generate import Group, Sample, sample_seed
from hpcrl.sessions.environment import Environment, EpisodeResult, episode_metrics, run_episode

__all__ = ["group_from_episodes", "rollout_groups"]


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


def rollout_groups(
    env: Environment,
    examples: Sequence[Example],
    server_url: str,
    *,
    num_samples: int,
    step: int,
    seed: int,
    sampling: dict[str, Any] | None = None,
    limits: dict[str, int] | None = None,
    max_concurrency: int = 16,
) -> tuple[list[Group], dict[str, float]]:
    """`num_samples` episodes per example, run concurrently; their Groups and the rollout/* episode metrics.

    Episode seeds depend only on (seed, step, example, sample), as single-turn samples' do, so a step repeats."""
    jobs = [(p, s) for p in range(len(examples)) for s in range(num_samples)]

    def one(job: tuple[int, int]) -> EpisodeResult:
        p, s = job
        row = {"prompt": examples[p].prompt, "answer": examples[p].answer}
        episode_seed = sample_seed(seed, step, p, s) % 2**31
        return run_episode(env, row, server_url, sampling=sampling, limits=limits, seed=episode_seed)

    with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(jobs)))) as pool:
        results = list(pool.map(one, jobs))
    groups = [
        group_from_episodes(example, results[p * num_samples : (p + 1) * num_samples])
        for p, example in enumerate(examples)
    ]
    return groups, episode_metrics(results)
