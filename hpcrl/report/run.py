"""One run's ``metrics.h5`` read once: metric columns, events and root attributes (``load_run``).

Works on NumPy arrays from ``hpcrl.store.load_metrics`` (no pandas) and reads a run that is still being
written (SWMR, through ``hpcrl.store.metrics``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl.report import METRICS_FILE
from hpcrl.store.metrics import StoreError, load_events, load_metrics, load_root_attrs

_LIVE_READ_RETRY_S = 5.0
_WRITER_OUTSIDE_SWMR = "while it is being written"


def resolve_metrics_path(path: str | os.PathLike[str]) -> Path:
    """Accepts a run directory or its ``metrics.h5`` and returns the metrics file's path."""
    path = Path(path)
    if path.is_dir():
        metrics = path / METRICS_FILE
        if not metrics.exists():
            raise StoreError(
                f"{path} is a directory without {METRICS_FILE}; pass an hpcrl run directory (the --run-dir of "
                "`hpcrl run`) or the path of a metrics.h5"
            )
        return metrics
    if not path.exists():
        raise StoreError(f"{path} does not exist; pass an hpcrl run directory or the path of its {METRICS_FILE}")
    return path


@dataclass(frozen=True, slots=True)
class RunData:
    """Everything one ``metrics.h5`` holds, read once: metric columns, events and root attributes."""

    name: str
    path: Path
    metrics: dict[str, np.ndarray]
    events: list[dict[str, Any]]
    attrs: dict[str, Any]

    @property
    def steps(self) -> np.ndarray:
        """The rows' steps as the console counts them: 1 is the first step, N of N the last (metrics.h5 stores
        the 0-based step index, which ``load_metrics`` returns unchanged)."""
        return self.metrics["step"] + 1

    @property
    def num_rows(self) -> int:
        return int(self.steps.shape[0])

    def column(self, key: str) -> np.ndarray | None:
        """The values of a metric key, or None when the run never logged it."""
        return None if key == "step" else self.metrics.get(key)

    def keys_under(self, prefix: str) -> list[str]:
        """Metric keys below a group, e.g. ``keys_under("guard/")``, sorted."""
        return sorted(k for k in self.metrics if k.startswith(prefix))

    def config(self) -> dict[str, Any]:
        """The resolved run config from the root attributes ({} when absent or unreadable)."""
        text = self.attrs.get("config")
        if not isinstance(text, str):
            return {}
        import yaml

        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError:
            # The config only labels the report (planned steps): a damaged one must not stop it.
            return {}
        return loaded if isinstance(loaded, dict) else {}


def _counted_from_one(event: dict[str, Any]) -> dict[str, Any]:
    """An event's step as the console and the rows count it (stored as the 0-based index, None outside a step)."""
    return event if event["step"] is None else {**event, "step": int(event["step"]) + 1}


def run_name(path: Path) -> str:
    """The run's name: its directory (the parent of ``metrics.h5``)."""
    return (path.parent if path.name == METRICS_FILE else path).name or str(path)


def load_run(path: str | os.PathLike[str], *, name: str | None = None) -> RunData:
    """Reads a run directory (or its ``metrics.h5``); works while the run is still writing."""
    metrics_path = resolve_metrics_path(path)
    deadline_s = time.monotonic() + _LIVE_READ_RETRY_S
    while True:
        try:
            return RunData(
                name=name or run_name(metrics_path),
                path=metrics_path,
                metrics=load_metrics(metrics_path),
                events=[_counted_from_one(e) for e in load_events(metrics_path)],
                attrs=load_root_attrs(metrics_path),
            )
        except StoreError as error:
            # A live writer leaves SWMR for milliseconds to add a key or an event; the store's readers give
            # up at once when they open the file in that window (HDF5 then says "not already open for SWMR
            # writing", which they do not treat as retryable), so a report of a running job retries here.
            if _WRITER_OUTSIDE_SWMR not in str(error) or time.monotonic() > deadline_s:
                raise
        time.sleep(0.05)


__all__ = ["RunData", "load_run", "resolve_metrics_path", "run_name"]
