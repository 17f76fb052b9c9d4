"""Weights & Biases: the config as the run's config, a history row per step, events as text, the report's plots."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcrl.store.sinks.base import BaseSink, SinkSetup


class WandbSink(BaseSink):
    name = "wandb"

    def open(self, setup: SinkSetup) -> None:
        import wandb

        cfg = setup.cfg.wandb
        assert cfg is not None
        # The same wandb run across preemptions: its id lives in the run dir (RUN_DIR/sinks.json).
        run_id = setup.ids.setdefault("wandb_run_id", uuid.uuid4().hex[:16])
        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=str(setup.run_dir),
            name=setup.run_name,
            id=run_id,
            resume="allow",
            config=setup.params,
            # The job log stays hpcrl's own (no console capture), and no system-stats sampler takes the driver's CPU.
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    def write_row(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def step_of(self, step: int | None) -> int:
        # wandb's steps only grow: an event of an earlier step (or of none) joins the last row.
        return max(super().step_of(step), self.last_step)

    def event(self, kind: str, step: int | None, detail: Mapping[str, Any]) -> None:
        self._run.log({f"events/{kind}": json.dumps(dict(detail), sort_keys=True)}, step=self.step_of(step))

    def images(self, step: int | None, paths: Sequence[Path]) -> None:
        import wandb

        self._run.log({f"report/{path.stem}": wandb.Image(str(path)) for path in paths}, step=self.step_of(step))

    def close(self) -> None:
        self._run.finish()
