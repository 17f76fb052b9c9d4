"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO"): a step trains only on groups whose rewards differ.

A group whose samples all got the same reward has advantage 0 on every sample: it adds tokens to the loss's
normaliser and nothing to its gradient, so as a policy gets better (or stays hopeless) on more prompts, the
effective batch shrinks. Dynamic sampling drops such groups and draws more prompts until the batch is full.

Synchronous runs draw whole extra batches of `prompts_per_step` prompts from a prompt stream of their own (its
own shuffle of the same examples), batch `step * (max_batches - 1) + k` for the k-th extra draw of `step`, with
sampling seeds of their own: the same config and seed redraw the same groups after a resume. The asynchronous
producer simply drops the group on arrival and keeps drawing (rollout/producer.py); both stop the run past
`max_batches` batches' worth of prompts for one step (`DynamicSamplingError`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hpcrl.rollout.buffer import zero_std
from hpcrl.rollout.data import PromptSource
from hpcrl.samples.sample import Example, Group

EXTRA_SEED_OFFSET = 2  # the SFT warm start's order uses seed + 1

DrawMore = Callable[[int, Sequence[Example], int], list[Group] | None]
"""`draw(step, examples, k)`: the scored groups of the k-th extra batch (None: a preemption signal came)."""


class DynamicSamplingError(RuntimeError):
    """A step drew its most prompts and still has too few groups with unequal rewards."""


def has_signal(group: Group) -> bool:
    """Whether a group's rewards differ, so that its advantages do (buffer.filter's `zero_std` keeps the same)."""
    return zero_std(group)


def cap_message(step: int, kept: int, prompts_per_step: int, max_batches: int) -> str:
    return (
        f"dynamic sampling drew {max_batches} x {prompts_per_step} prompts for step {step} and found only {kept} "
        f"groups whose rewards differ, fewer than data.prompts_per_step={prompts_per_step}: the policy's samples "
        "of most prompts all score alike (all right, or all wrong). Raise rollout.dynamic_sampling_max_batches, "
        "raise rollout.temperature, use prompts of a better-suited difficulty, or set "
        "rollout.dynamic_sampling=false (steps then train on the groups as drawn)"
    )


class DynamicSampler:
    """Fills a synchronous step's batch with groups whose rewards differ."""

    def __init__(self, data: PromptSource, *, prompts_per_step: int, max_batches: int) -> None:
        self.prompts_per_step, self.max_batches = prompts_per_step, max_batches
        self.extra = PromptSource(
            data.examples, batch_size=prompts_per_step, seed=data.seed + EXTRA_SEED_OFFSET, shuffle=data.shuffle
        )
        self.metrics: dict[str, float] = {}

    def fill(self, step: int, groups: list[Group], draw: DrawMore) -> list[Group] | None:
        """The first `prompts_per_step` groups with a signal, from `groups` then extra batches (None: preempted)."""
        kept = [g for g in groups if has_signal(g)]
        dropped, batches = len(groups) - len(kept), 1
        while len(kept) < self.prompts_per_step:
            if batches >= self.max_batches:
                raise DynamicSamplingError(cap_message(step, len(kept), self.prompts_per_step, self.max_batches))
            examples = self.extra.batch(step * (self.max_batches - 1) + batches - 1)
            more = draw(step, examples, batches)
            if more is None:
                return None
            batches += 1
            signal = [g for g in more if has_signal(g)]
            dropped += len(more) - len(signal)
            kept += signal
        self.metrics = {"rollout/dynamic_dropped_groups": float(dropped), "rollout/dynamic_batches": float(batches)}
        return kept[: self.prompts_per_step]

    def pop_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out
