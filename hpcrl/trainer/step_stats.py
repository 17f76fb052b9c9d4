"""What both trainer backends do around a step: per-token statistics and the non-finite-step rule."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Protocol

from torch import Tensor

from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.loss import logprob_mismatch


class NonFiniteStepError(RuntimeError):
    pass


class StepSums:
    """Token-weighted sums of a step's statistics over its micro-batches (divide by the step's tokens)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, stats: dict[str, float], tokens: float) -> None:
        for key, value in stats.items():
            if key != "num_tokens" and isinstance(value, float):
                # A non-finite value is left out, but its key stays: replicas reduce the same keys in one tensor.
                self.sums[key] += value * tokens if math.isfinite(value) else 0.0

    def add_rollout_gap(self, logprobs: Tensor, mb: TrainBatch, tokens: float) -> None:
        gap = logprob_mismatch(logprobs.detach(), mb.rollout_logprobs, mb.loss_mask)
        self.sums["train_rollout_logprob_abs_diff"] += gap["train_rollout_logprob_abs_diff"] * tokens
        self.sums["train_rollout_kl"] += gap["train_rollout_kl"] * tokens
        peak = "train_rollout_logprob_max_abs_diff"
        self.sums[peak] = max(self.sums[peak], gap[peak])


class SteppableOptimizer(Protocol):
    """What NanGuard calls: torch's optimizers and hpcrl's Megatron optimizers both have it."""

    def step(self) -> Any: ...

    def zero_grad(self, set_to_none: bool = ...) -> None: ...


class NanGuard:
    """Skip a step whose loss or gradient norm is not finite; stop after `max_in_a_row` such steps."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0

    def step(self, optimizer: SteppableOptimizer, metrics: dict[str, float]) -> dict[str, float]:
        """Apply the optimizer step, or skip it; records `nan_skipped` in metrics."""
        if math.isfinite(metrics["grad_norm"]) and math.isfinite(metrics["loss"]):
            self.in_a_row = 0
            optimizer.step()
            metrics["nan_skipped"] = 0.0
            return metrics
        optimizer.zero_grad(set_to_none=True)
        self.in_a_row += 1
        metrics["nan_skipped"] = 1.0
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteStepError(
                f"{self.in_a_row} steps in a row had a non-finite loss or gradient norm; lower train.lr, "
                "raise train.grad_clip protection, or check the rewards"
            )
        return metrics
