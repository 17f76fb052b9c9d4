"""MLflow: the config as the run's parameters, every metric at its step, events as an artifact, the report's plots."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcrl.store.sinks.base import BaseSink, SinkSetup

# MLflow's log_batch limits (mlflow/utils/validation.py): 1000 metrics and 100 params per call, 6000 characters
# per parameter value.
_METRICS_PER_BATCH = 1000
_PARAMS_PER_BATCH = 100
_PARAM_VALUE_CHARS = 6000


class MlflowSink(BaseSink):
    name = "mlflow"

    def open(self, setup: SinkSetup) -> None:
        cfg, run_dir, run_name, params, ids = setup.cfg, setup.run_dir, setup.run_name, setup.params, setup.ids
        assert cfg.mlflow is not None
        uri = cfg.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or str(run_dir / "mlruns")
        if "://" not in uri or uri.startswith("file://"):
            # MLflow 3 refuses a file store unless asked for one; the config names a directory, so it is asked for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=uri)
        self.tracking_uri = uri
        name = cfg.mlflow.experiment or run_name
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
        run_id = ids.get("mlflow_run_id")
        if run_id is None:
            run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
            ids["mlflow_run_id"] = run_id
            flat = [Param(key, str(value)[:_PARAM_VALUE_CHARS]) for key, value in _flatten(params)]
            for start in range(0, len(flat), _PARAMS_PER_BATCH):
                client.log_batch(run_id, params=flat[start : start + _PARAMS_PER_BATCH])
        else:
            # A resumed run: parameters cannot change in MLflow, and they are the same config.
            client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._events: list[dict[str, Any]] = []
        self._finished = False

    def write_row(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        rows = [Metric(key, value, now_ms, step) for key, value in metrics.items()]
        for start in range(0, len(rows), _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=rows[start : start + _METRICS_PER_BATCH])

    def event(self, kind: str, step: int | None, detail: Mapping[str, Any]) -> None:
        self._finished = self._finished or kind == "finished"
        # Events are rare: the whole list is rewritten as one JSON-lines artifact each time.
        self._events.append({"time_s": time.time(), "step": step, "kind": kind, "detail": dict(detail)})
        text = "".join(json.dumps(event, sort_keys=True) + "\n" for event in self._events)
        self._client.log_text(self.run_id, text, "events.jsonl")

    def images(self, step: int | None, paths: Sequence[Path]) -> None:
        for path in paths:
            self._client.log_artifact(self.run_id, str(path), "report")

    def close(self) -> None:
        # KILLED: stopped before its last step (preempted, failed); a resumed run sets it RUNNING again.
        self._client.set_terminated(self.run_id, status="FINISHED" if self._finished else "KILLED")


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, f"{path}.")
        else:
            yield path, json.dumps(value) if isinstance(value, (list, dict)) or value is None else value
