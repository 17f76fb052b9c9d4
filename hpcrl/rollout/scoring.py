"""Scoring a step's groups with the run's reward function: bounded in time, stoppable by a preemption."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpcrl.rollout.config import RewardConfig
from hpcrl.rollout.rewards import RewardError, ScoreResult, ScoringInterrupted, check_failures, load_reward, score
from hpcrl.samples.sample import Group


class RewardScorer:
    """Scores a step's samples; a stop for too many failures is recorded (`on_stop`) before it is raised."""

    def __init__(
        self,
        cfg: RewardConfig,
        *,
        interrupted: Callable[[], bool],
        on_stop: Callable[[int, dict[str, Any]], None],
        by_environment: bool = False,
    ) -> None:
        """`by_environment`: multi-turn samples arrive scored by their environment; only the failure limit applies."""
        self.fn = load_reward(cfg.fn)
        self.cfg = cfg
        self.interrupted = interrupted
        self.on_stop = on_stop
        self.by_environment = by_environment

    def score(self, step: int, groups: list[Group]) -> ScoreResult | None:
        """Score the groups in place; None when a preemption signal came while a reward was running."""
        samples = [s for g in groups for s in g.samples]
        if self.by_environment:
            result = ScoreResult([s.reward for s in samples], [s.reward_error for s in samples])
            self._check(step, result)
            return result
        answers = [g.example.answer for g in groups for _ in g.samples]
        metas = [g.example.meta for g in groups for _ in g.samples]
        try:
            result = score(
                self.fn, [s.text for s in samples], answers, metas=metas, timeout_s=self.cfg.timeout_s,
                interrupted=self.interrupted,
            )  # fmt: skip
        except ScoringInterrupted:
            return None
        for s, r, e in zip(samples, result.rewards, result.errors, strict=True):
            s.reward, s.reward_error = r, e
        self._check(step, result)
        return result

    def _check(self, step: int, result: ScoreResult) -> None:
        try:
            check_failures(result, self.cfg.max_failed_share)
        except RewardError as exc:
            first = next(e for e in result.errors if e is not None)
            self.on_stop(step, {"reason": "reward_failures", "num_failed": result.num_failed, "first_error": first})
            raise RewardError(f"{exc}; the run stops (event 'stopped'): fix the reward and rerun to resume") from None
