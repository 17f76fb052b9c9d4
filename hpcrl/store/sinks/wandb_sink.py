"""Weights & Biases: the config as the run's config, a history row per step, events as text, the report's plots."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcrl.store.sinks.config import LoggingConfig


class WandbSink:
    name = "wandb"

    def __init__(
        self,
        cfg: LoggingConfig,
        *,
        run_dir: Path,
        run_name: str,
        params: Mapping[str, Any],
        ids: dict[str, str],
    ) -> None:
        import wandb

        assert cfg.wandb is not None
        # The same wandb run across preemptions: its id lives in the run dir (RUN_DIR/sinks.json).
        run_id = ids.setdefault("wandb_run_id", uuid.uuid4().hex[:16])
        self._run = wandb.init(
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            mode=cfg.wandb.mode,
            dir=str(run_dir),
            name=run_name,
            id=run_id,
            resume="allow",
            config=dict(params),
            # The job log stays hpcrl's own (no console capture), and no system-stats sampler takes the driver's CPU.
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self._last_step = 0

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)
        self._last_step = step

    def event(self, kind: str, step: int | None, detail: Mapping[str, Any]) -> None:
        # wandb's steps only grow: an event of an earlier step (or of none) joins the last row.
        at = self._last_step if step is None else max(step, self._last_step)
        self._run.log({f"events/{kind}": json.dumps(dict(detail), sort_keys=True)}, step=at)

    def images(self, step: int | None, paths: Sequence[Path]) -> None:
        import wandb

        at = self._last_step if step is None else max(step, self._last_step)
        self._run.log({f"report/{path.stem}": wandb.Image(str(path)) for path in paths}, step=at)

    def close(self) -> None:
        self._run.finish()
