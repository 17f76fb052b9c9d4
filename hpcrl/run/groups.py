"""Where a step's groups come from: the one difference between a synchronous and an asynchronous run.

The driver loop (hpcrl/driver.py) is the same for both; it asks its `StepGroups` for the groups of a step, says
when they were trained, pushes weights through it, and tells it when a checkpoint was written or the run stops.

- `SyncGroups` (rollout.mode=sync): the step generates its groups, then scores them; the engines wait while the
  trainer trains, and a push reaches idle engines.
- `AsyncGroups` (rollout.mode=async): a producer thread generates and scores beside the trainer
  (hpcrl/rollout/producer.py); a step collects what it buffered, a push reaches engines with requests in flight,
  and the prompt ledger of each checkpoint is written where a user can read it (docs/async.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from hpcrl.rollout.data import PromptSource
from hpcrl.rollout.dynamic import DynamicSampler
from hpcrl.rollout.episodes import EpisodeRollout
from hpcrl.rollout.generate import Draw, Rollout
from hpcrl.rollout.producer import AsyncRollout
from hpcrl.rollout.scoring import RewardScorer
from hpcrl.samples.sample import Example, Group
from hpcrl.store.progress import StepTimer
from hpcrl.store.run_dir import write_file_atomically
from hpcrl.sync.publisher import WeightPublisher

LEDGER_FILE = "prompt_ledger.json"


class StepGroups(Protocol):
    def start(self) -> None:
        """Before the first step of this process."""

    def take(self, step: int, timer: StepTimer) -> list[Group] | None:
        """The scored groups step `step` trains on, timed as its rollout; None: a preemption signal came first."""

    def trained(self, step: int) -> None:
        """The groups of `step` were trained on."""

    def publish(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to the engines as `version`; the push's figures."""

    def pop_metrics(self) -> dict[str, float]:
        """This step's figures of the source itself."""

    def checkpointed(self) -> None:
        """A checkpoint was just written."""

    def stop(self) -> None:
        """The run stops early (a preemption signal)."""

    def finish(self) -> None:
        """The run finished all its steps."""


class SyncGroups:
    def __init__(
        self,
        rollout: Rollout | EpisodeRollout,
        rewards: RewardScorer,
        data: PromptSource,
        publisher: WeightPublisher,
        dynamic: DynamicSampler | None = None,
    ) -> None:
        self.rollout, self.rewards, self.data, self.publisher = rollout, rewards, data, publisher
        self.dynamic = dynamic

    def start(self) -> None:
        pass

    def take(self, step: int, timer: StepTimer) -> list[Group] | None:
        groups = self._scored(step, self.data.batch(step), timer)
        if groups is None or self.dynamic is None:
            return groups

        def more(step: int, examples: Sequence[Example], k: int) -> list[Group] | None:
            return self._scored(step, examples, timer, Draw(namespace=f"dynamic{k}/"))

        return self.dynamic.fill(step, groups, more)

    def _scored(
        self, step: int, examples: Sequence[Example], timer: StepTimer, draw: Draw | None = None
    ) -> list[Group] | None:
        with timer.phase("rollout"):
            if draw is None:
                groups = self.rollout.generate(step, examples)
            else:
                assert isinstance(self.rollout, Rollout), "dynamic sampling draws single-turn groups"
                groups = self.rollout.generate(step, examples, draw)
        with timer.phase("reward"):
            scored = self.rewards.score(step, groups)
        return None if scored is None else groups  # None: a preemption signal came while a reward still ran

    def trained(self, step: int) -> None:
        pass

    def publish(self, version: int) -> dict[str, float]:
        return self.publisher.publish(version)

    def pop_metrics(self) -> dict[str, float]:
        return {} if self.dynamic is None else self.dynamic.pop_metrics()

    def checkpointed(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def finish(self) -> None:
        pass


class AsyncGroups:
    def __init__(self, producer: AsyncRollout, run_dir: Path, *, interrupted: Callable[[], bool]) -> None:
        self.producer = producer
        self.ledger_path = run_dir / LEDGER_FILE
        self.interrupted = interrupted

    def start(self) -> None:
        self.producer.start()

    def take(self, step: int, timer: StepTimer) -> list[Group] | None:
        with timer.phase("rollout"):
            return self.producer.collect(step, interrupted=self.interrupted)

    def trained(self, step: int) -> None:
        self.producer.commit(step)

    def publish(self, version: int) -> dict[str, float]:
        return self.producer.publish(version)

    def pop_metrics(self) -> dict[str, float]:
        return self.producer.pop_metrics()

    def checkpointed(self) -> None:
        """The ledger of the checkpoint just written, where a user (or a test) can read it."""
        ledger = self.producer.saved_ledger()
        if ledger is not None:
            _write_json(self.ledger_path, ledger)

    def stop(self) -> None:
        self.producer.stop()

    def finish(self) -> None:
        _write_json(self.ledger_path, self.producer.finish())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # A reader sees the previous ledger or this one, never half of one; a link planted at either name is refused.
    write_file_atomically(path, json.dumps(data).encode())
