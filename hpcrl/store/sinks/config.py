"""The `logging` section of a run config: where, besides metrics.h5, every step's metrics and the run's events go.

    logging:
      tensorboard: true                  # or a directory; true: RUN_DIR/tensorboard
      wandb: {project: grpo, entity: my-team, mode: offline}
      mlflow: {tracking_uri: http://mlflow.example.org:5000, experiment: grpo}

metrics.h5 stays the run's record (resume, `hpcrl report`); the sinks are copies for the tools a team already
watches. Each needs its client (`pip install 'hpcrl[tensorboard]'`, `[wandb]`, `[mlflow]`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, frozen=True)
class WandbConfig:
    """Weights & Biases: one wandb run per hpcrl run, resumed with it after a preemption."""

    project: str
    """The wandb project the run is logged to."""
    entity: str | None = None
    """The wandb team or user; null: the API key's default entity."""
    mode: Literal["online", "offline"] = "online"
    """online: sent as the run goes; offline: written under RUN_DIR/wandb only (upload later with `wandb sync`)."""

    def __post_init__(self) -> None:
        if not self.project.strip():
            raise ValueError("project is empty; name the wandb project, e.g. wandb: {project: grpo}")
        if self.entity is not None and not self.entity.strip():
            raise ValueError("entity is empty; leave it out (null) for the API key's default entity")


@dataclass(kw_only=True, frozen=True)
class MlflowConfig:
    """MLflow: one MLflow run per hpcrl run, resumed with it after a preemption."""

    tracking_uri: str | None = None
    """The tracking server (http://host:5000) or a local directory (a file store); null: $MLFLOW_TRACKING_URI,
    else RUN_DIR/mlruns."""
    experiment: str | None = None
    """The MLflow experiment, created when missing; null: the run's `name`."""

    def __post_init__(self) -> None:
        for name in ("tracking_uri", "experiment"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name} is empty; leave it out (null) for the default")


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    """Copies of every step's metrics and every event in TensorBoard, wandb or MLflow (driver process only).

    The run's config goes along as the run's parameters, and the report's plots as images when the run
    finishes (with `hpcrl[report]` installed). A sink that fails says so once and is dropped: the run goes on,
    and metrics.h5 keeps every metric."""

    tensorboard: str | bool = False
    """true: event files in RUN_DIR/tensorboard; a directory: there; false: off."""
    wandb: WandbConfig | None = None
    """Weights & Biases: one wandb run per hpcrl run, resumed with it after a preemption; null: off."""
    mlflow: MlflowConfig | None = None
    """MLflow: one MLflow run per hpcrl run, resumed with it after a preemption; null: off."""

    def __post_init__(self) -> None:
        if isinstance(self.tensorboard, str) and not self.tensorboard.strip():
            raise ValueError("tensorboard is empty; set true (RUN_DIR/tensorboard), a directory, or false")

    @property
    def enabled(self) -> list[str]:
        """The sinks this section turns on, by name."""
        named = {"tensorboard": self.tensorboard is not False, "wandb": self.wandb, "mlflow": self.mlflow}
        return [name for name, on in named.items() if on]
