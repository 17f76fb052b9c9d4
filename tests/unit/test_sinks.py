"""The `logging` section: a real CPU run copies every metric of every step to TensorBoard, wandb and MLflow, read
back with each tool's own reader; a sink that fails costs one log line, never the run."""

from __future__ import annotations

import json
import math
import struct
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpcrl.config import ConfigError, from_dict, load_yaml, to_dict
from hpcrl.run_config import RunConfig
from hpcrl.store import load_events, load_metrics
from hpcrl.store.run_dir import config_differences
from hpcrl.store.sinks import LoggingConfig, missing_clients, open_sinks, pip_command
from tests.support import hpcrl, make_config

RUN = [
    "num_steps=4",
    "sft.num_steps=4",
    "sft.batch_size=16",
    "data.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "checkpoint.every_steps=2",
]
REPORT_PLOTS = {"reward", "timing", "train"}  # drawn for every run (hpcrl/report/plots.py)


def expected_rows(metrics: dict[str, np.ndarray]) -> dict[str, dict[int, float]]:
    """{key: {step: value}} of metrics.h5, the record every sink must match (NaN: not logged that step), at the
    step as the console counts it: metrics.h5 stores the 0-based index, a sink shows the steps done (index + 1)."""
    steps = [int(s) + 1 for s in metrics["step"]]
    return {
        key: {step: float(v) for step, v in zip(steps, values, strict=True) if not math.isnan(v)}
        for key, values in metrics.items()
        if key != "step"
    }


def h5_key(key: str) -> str:
    return key if "/" in key else f"misc/{key}"


def assert_rows_match(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]], sink: str) -> None:
    assert set(want) <= set(got), f"{sink} lacks metrics {sorted(set(want) - set(got))}"
    for key, by_step in want.items():
        assert sorted(got[key]) == sorted(by_step), f"{sink}: {key} steps {sorted(got[key])} != {sorted(by_step)}"
        for step, value in by_step.items():
            # TensorBoard keeps float32.
            assert got[key][step] == pytest.approx(value, rel=1e-6, abs=1e-30), f"{sink}: {key} at step {step}"


# ---- readers: each tool's own


def tensorboard_data(log_dir: Path) -> tuple[dict[str, dict[int, float]], Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    rows = {
        tag: {e.step: e.value for e in acc.Scalars(tag) if not math.isnan(e.value)} for tag in acc.Tags()["scalars"]
    }
    return {h5_key(k): v for k, v in rows.items() if v}, acc


def wandb_records(run_dir: Path) -> Iterator[Any]:
    """The records of the offline run's .wandb file: a LevelDB-style log of wandb's protobuf records."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = payload if kind in (1, 2) else pending + payload  # full/first, middle/last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_data(run_dir: Path) -> tuple[dict[str, dict[int, Any]], dict[str, Any]]:
    rows: dict[str, dict[int, Any]] = {}
    config: dict[str, Any] = {}
    for record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                rows.setdefault(key, {})[step] = json.loads(item.value_json)
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
    return rows, config


# ---- the run


def test_a_run_copies_every_metric_of_every_step_to_tensorboard_wandb_and_mlflow(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = hpcrl(
        "run", "qs.yaml", *RUN, "--run-dir", "r",
        "logging.tensorboard=true",
        "logging.wandb.project=hpcrl-test", "logging.wandb.mode=offline",
        f"logging.mlflow.tracking_uri={workdir / 'mlruns'}", "logging.mlflow.experiment=sinks",
        cwd=workdir, timeout_s=600,
    )  # fmt: skip
    assert "warning: logging" not in out.stdout + out.stderr
    run = workdir / "r"
    want = expected_rows(load_metrics(run / "metrics.h5"))
    # Every metric at steps 1-4, as the console's "step 1/4" ... "step 4/4" and step_00000004.h5 say.
    assert "train/loss" in want and all(set(by_step) == {1, 2, 3, 4} for by_step in want.values()), want
    assert [line.split("|")[0].split()[1] for line in out.stdout.splitlines() if line.startswith("step ")] == [
        "1/4", "2/4", "3/4", "4/4",
    ]  # fmt: skip
    events = load_events(run / "metrics.h5")
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == 3  # metrics.h5 keeps the 0-based index
    shown = [None if e["step"] is None else e["step"] + 1 for e in events]  # what every sink shows

    tb_rows, acc = tensorboard_data(run / "tensorboard")
    assert_rows_match(tb_rows, want, "tensorboard")
    tensors = acc.Tags()["tensors"]
    assert "config/text_summary" in tensors
    assert {f"events/{e['kind']}/text_summary" for e in events} <= set(tensors)
    assert [t.step for t in acc.Tensors("events/finished/text_summary")] == [4]
    assert REPORT_PLOTS <= {tag.removeprefix("report/") for tag in acc.Tags()["images"]}
    assert {img.step for tag in acc.Tags()["images"] for img in acc.Images(tag)} == {4}

    wb_rows, wb_config = wandb_data(run)
    assert_rows_match({h5_key(k): v for k, v in wb_rows.items() if not k.startswith("_")}, want, "wandb")
    recorded = load_yaml(run / "config.yaml")
    assert wb_config["name"] == "quickstart" and wb_config["train"] == recorded["train"]
    assert list(wb_rows["events/finished"]) == [4]
    assert json.loads(wb_rows["events/finished"][4]) == events[-1]["detail"]
    assert REPORT_PLOTS <= {k.split("/")[1] for k in wb_rows if k.startswith("report/")}
    assert all(list(by_step) == [4] for key, by_step in wb_rows.items() if key.startswith("report/"))

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(str(workdir / "mlruns"))
    experiment = client.get_experiment_by_name("sinks")
    assert experiment is not None
    (ml_run,) = client.search_runs([experiment.experiment_id])
    assert ml_run.info.status == "FINISHED" and ml_run.data.params["train.lr"] == str(recorded["train"]["lr"])
    ml_rows = {
        h5_key(key): {
            m.step: m.value for m in client.get_metric_history(ml_run.info.run_id, key) if not math.isnan(m.value)
        }
        for key in ml_run.data.metrics
    }
    assert_rows_match(ml_rows, want, "mlflow")
    artifacts = {a.path for a in client.list_artifacts(ml_run.info.run_id, "report")}
    assert {f"report/{name}.png" for name in REPORT_PLOTS} <= artifacts
    logged = client.download_artifacts(ml_run.info.run_id, "events.jsonl", str(workdir))
    ml_events = [json.loads(line) for line in Path(logged).read_text().splitlines()]
    assert [e["kind"] for e in ml_events] == [e["kind"] for e in events]
    assert [e["step"] for e in ml_events] == shown
    assert json.loads((run / "sinks.json").read_text()) == {
        "mlflow_run_id": ml_run.info.run_id,
        "wandb_run_id": next(run.glob("wandb/offline-run-*")).name.rsplit("-", 1)[1],
    }


class QuotaExhaustedMlflow(BaseHTTPRequestHandler):
    """An MLflow tracking server that creates the run, then answers every metric batch 429 (quota exhausted)."""

    metric_batches = 0
    artifact_uri = ""

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _run(self) -> dict[str, Any]:
        info = {"run_id": "run1", "run_uuid": "run1", "experiment_id": "1", "status": "RUNNING",
                "lifecycle_stage": "active", "artifact_uri": self.artifact_uri, "run_name": "quota"}  # fmt: skip
        return {"run": {"info": info, "data": {}}}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if "experiments/get-by-name" in self.path:
            self._answer(200, {"experiment": {"experiment_id": "1", "name": "quota", "lifecycle_stage": "active"}})
        elif "runs/get" in self.path:
            self._answer(200, self._run())
        else:
            self._answer(200, {})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path.endswith("runs/create"):
            self._answer(200, self._run())
        elif self.path.endswith("runs/log-batch") and body.get("metrics"):
            type(self).metric_batches += 1
            self._answer(429, {"error_code": "RESOURCE_EXHAUSTED", "message": "metric quota exceeded"})
        else:
            self._answer(200, {})

    def log_message(self, *args: Any) -> None:
        pass


def test_a_failing_sink_is_reported_once_and_the_run_completes(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    QuotaExhaustedMlflow.artifact_uri = str(workdir / "artifacts")  # events and plots land here
    server = ThreadingHTTPServer(("127.0.0.1", 0), QuotaExhaustedMlflow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the quota answer is final; no backoff here
    try:
        out = hpcrl(
            "run", "qs.yaml", *RUN, "--run-dir", "r",
            f"logging.mlflow.tracking_uri=http://127.0.0.1:{server.server_address[1]}",
            cwd=workdir, timeout_s=600,
        )  # fmt: skip
    finally:
        server.shutdown()
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "logging.mlflow" in line]
    assert len(lines) == 1, lines
    assert "failed to log step 1" in lines[0] and "goes on" in lines[0], lines[0]
    assert QuotaExhaustedMlflow.metric_batches == 1  # dropped after its first failure: no call per step
    metrics = load_metrics(workdir / "r" / "metrics.h5")
    assert list(metrics["step"]) == [0, 1, 2, 3]
    assert load_events(workdir / "r" / "metrics.h5")[-1]["kind"] == "finished"


# ---- configuration and start-up


def test_an_unknown_sink_is_refused_listing_the_valid_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key 'logging.neptune'; valid keys of logging: tensorboard, wandb, "
    ):
        from_dict(RunConfig, {"model": {"path": "m"}, "logging": {"neptune": {"project": "x"}}})
    with pytest.raises(ConfigError, match="missing required key 'logging.wandb.project'"):
        from_dict(RunConfig, {"model": {"path": "m"}, "logging": {"wandb": {"mode": "offline"}}})
    with pytest.raises(ConfigError, match="logging.wandb.mode: expected one of 'online', 'offline'"):
        from_dict(RunConfig, {"model": {"path": "m"}, "logging": {"wandb": {"project": "p", "mode": "dryrun"}}})
    with pytest.raises(ConfigError, match="logging: tensorboard is empty"):
        from_dict(LoggingConfig, {"tensorboard": " "}, path="logging")
    cfg = from_dict(LoggingConfig, {"tensorboard": "tb", "mlflow": {}})
    assert cfg.enabled == ["tensorboard", "mlflow"] and from_dict(LoggingConfig, {}).enabled == []


def test_a_missing_client_is_named_with_the_pip_command_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without wandb looks like to find_spec
    cfg = make_config({"logging.wandb": {"project": "p", "mode": "offline"}, "logging.tensorboard": True})
    assert missing_clients(cfg.logging) == {"wandb": "wandb"}
    said: list[str] = []
    sinks = open_sinks(cfg.logging, tmp_path, run_name=cfg.name, params={}, say=said.append)
    assert sinks is not None and sinks.names == ["tensorboard"]
    sinks.close()
    assert (
        len(said) == 1 and "logging.wandb set, but the client is not installed: pip install 'hpcrl[wandb]'" in said[0]
    )
    assert pip_command(["wandb", "mlflow", "wandb"]) == "pip install 'hpcrl[wandb,mlflow]'"


def test_a_resumed_run_may_add_or_drop_a_sink() -> None:
    recorded = to_dict(make_config())
    assert config_differences(recorded, make_config({"logging.tensorboard": True, "logging.mlflow": {}})) == []
    assert config_differences(recorded, make_config({"seed": 1})) == ["seed: 0 -> 1"]
