"""Copies of the run's metrics and events in TensorBoard, wandb and MLflow (the `logging` config section).

`MetricsWriter` (hpcrl/store/metrics.py) hands every row and event it records to a `SinkSet`, so nothing
else in the run knows the sinks exist. Each client is imported only when its sink is configured.
"""

from __future__ import annotations

from hpcrl.store.sinks.base import Sink, SinkSet, missing_clients, open_sinks, pip_command
from hpcrl.store.sinks.config import LoggingConfig, MlflowConfig, WandbConfig

__all__ = [
    "LoggingConfig",
    "MlflowConfig",
    "Sink",
    "SinkSet",
    "WandbConfig",
    "missing_clients",
    "open_sinks",
    "pip_command",
]
