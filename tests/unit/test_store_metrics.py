"""metrics.h5: rows, NaN backfill, new keys under SWMR, truncation on resume, events, readers in other processes."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcrl.store.metrics import (
    MetricsWriter,
    StoreError,
    load_events,
    load_metrics,
    load_metrics_frame,
    load_root_attrs,
    metric_path,
)

# Flush only when a test asks, so that each test controls what readers see.
NO_AUTO_FLUSH = {"flush_every_steps": 1_000_000, "flush_interval_s": 1e9}


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=60
    )


def test_rows_round_trip_with_nan_for_missing_keys(tmp_path: Path) -> None:
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path, **NO_AUTO_FLUSH) as writer:
        writer.log(0, {"train/loss": 1.5, "timing/rollout_s": 2, "rollout/reward_mean": np.float32(0.25)})
        writer.log(1, {"train/loss": float("inf"), "grad_norm": float("nan")})
        writer.log(3, {"timing/rollout_s": -1.0, "flag": True})
    metrics = load_metrics(path)
    assert list(metrics) == [
        "step",
        "misc/flag",
        "misc/grad_norm",
        "rollout/reward_mean",
        "timing/rollout_s",
        "train/loss",
    ]
    assert metrics["step"].dtype == np.int64 and metrics["step"].tolist() == [0, 1, 3]
    assert metrics["train/loss"].dtype == np.float64
    np.testing.assert_array_equal(metrics["train/loss"], [1.5, math.inf, math.nan])
    np.testing.assert_array_equal(metrics["timing/rollout_s"], [2.0, math.nan, -1.0])
    np.testing.assert_array_equal(metrics["rollout/reward_mean"], [0.25, math.nan, math.nan])
    np.testing.assert_array_equal(metrics["misc/grad_norm"], [math.nan, math.nan, math.nan])
    np.testing.assert_array_equal(metrics["misc/flag"], [math.nan, math.nan, 1.0])
    with h5py.File(path, "r") as f:
        assert f["metrics/train/loss"].maxshape == (None,)
        assert f["metrics/timing/rollout_s"].shape == (3,)


def test_key_names_are_validated() -> None:
    assert metric_path("loss") == "misc/loss"
    assert metric_path("timing/step/generate") == "timing/step/generate"
    for bad in ["train/", "/loss", "a//b", "train/lo ss", "train/..", "é", ""]:
        with pytest.raises(ValueError, match="invalid metric key"):
            metric_path(bad)
    with pytest.raises(ValueError, match="step index"):
        metric_path("step/x")


def test_log_rejects_bad_values_keys_and_clashes(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path / "metrics.h5", **NO_AUTO_FLUSH) as writer:
        with pytest.raises(TypeError, match="'train/loss'.*str"):
            writer.log(0, {"train/loss": "0.5"})
        with pytest.raises(TypeError, match=r"'train/kl'.*\.item\(\)"):
            writer.log(0, {"train/kl": np.array([0.5])})
        with pytest.raises(ValueError, match="invalid metric key 'bad key'"):
            writer.log(0, {"bad key": 1.0})
        with pytest.raises(ValueError, match="same metric"):
            writer.log(0, {"loss": 1.0, "misc/loss": 2.0})
        writer.log(0, {"timing/step": 1.0})
        with pytest.raises(ValueError, match="clashes with 'timing/step'"):
            writer.log(1, {"timing/step/generate": 1.0})
        writer.log(1, {"timing/step": 2.0})
    assert load_metrics(tmp_path / "metrics.h5")["step"].tolist() == [0, 1]


def test_steps_must_strictly_increase_also_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path, **NO_AUTO_FLUSH) as writer:
        writer.log(5, {"a/b": 1.0})
        for step in (5, 4):
            with pytest.raises(ValueError, match=f"step {step} is not after the last logged step 5"):
                writer.log(step, {"a/b": 1.0})
        with pytest.raises(TypeError, match="step must be an int"):
            writer.log(6.0, {"a/b": 1.0})  # type: ignore[arg-type]
    with MetricsWriter(path, **NO_AUTO_FLUSH) as writer:
        with pytest.raises(ValueError, match="truncate_after"):
            writer.log(5, {"a/b": 1.0})
        writer.log(6, {"a/b": 2.0})
    assert load_metrics(path)["step"].tolist() == [5, 6]


def test_rows_are_buffered_until_flush_every_steps(tmp_path: Path) -> None:
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path, flush_every_steps=3, flush_interval_s=1e9) as writer:
        writer.log(0, {"train/loss": 0.0})
        writer.log(1, {"train/loss": 1.0})
        assert load_metrics(path)["step"].tolist() == []
        assert writer.num_rows == 2
        writer.log(2, {"train/loss": 2.0})
        assert load_metrics(path)["step"].tolist() == [0, 1, 2]
    with MetricsWriter(path, flush_every_steps=100, flush_interval_s=0.0) as writer:
        writer.log(3, {"train/loss": 3.0})
        assert load_metrics(path)["step"].tolist() == [0, 1, 2, 3]


def test_new_key_after_swmr_is_on_is_backfilled_with_nan(tmp_path: Path) -> None:
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path, **NO_AUTO_FLUSH) as writer:
        for step in range(4):
            writer.log(step, {"train/loss": float(step)})
        writer.flush()
        writer.log(4, {"train/loss": 4.0, "eval/accuracy": 0.5})
        writer.log(5, {"eval/accuracy": 0.75})
        writer.flush()
        metrics = load_metrics(path)
        # Written under SWMR: a reader opening with swmr=True only succeeds while the writer is in SWMR mode.
        with h5py.File(path, "r", swmr=True, locking=False) as f:
            assert f["metrics/eval/accuracy"].shape == (6,)
    np.testing.assert_array_equal(metrics["eval/accuracy"], [math.nan] * 4 + [0.5, 0.75])
    np.testing.assert_array_equal(metrics["train/loss"], [0.0, 1.0, 2.0, 3.0, 4.0, math.nan])


def test_truncate_after_drops_later_rows_and_keeps_events(tmp_path: Path) -> None:
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path, flush_every_steps=4, flush_interval_s=1e9) as writer:
        for step in range(10):
            writer.log(step, {"train/loss": float(step), "late": 1.0} if step > 7 else {"train/loss": float(step)})
        writer.event("preempted", step=9)
    # The resumed job restarts from the checkpoint of step 4: rows 5..9 will be computed again.
    with MetricsWriter(path, **NO_AUTO_FLUSH) as writer:
        writer.truncate_after(4)
        with pytest.raises(ValueError, match="not after the last logged step 4"):
            writer.log(4, {"train/loss": 0.0})
        writer.event("resumed", step=4)
        writer.log(5, {"train/loss": 50.0})
        writer.log(6, {"train/loss": 60.0})
        writer.truncate_after(5)  # also drops buffered rows
    metrics = load_metrics(path)
    assert metrics["step"].tolist() == [0, 1, 2, 3, 4, 5]
    np.testing.assert_array_equal(metrics["train/loss"], [0.0, 1.0, 2.0, 3.0, 4.0, 50.0])
    np.testing.assert_array_equal(metrics["misc/late"], [math.nan] * 6)
    assert [event["kind"] for event in load_events(path)] == ["preempted", "resumed"]
    with MetricsWriter(path, **NO_AUTO_FLUSH) as writer:
        writer.truncate_after(-1)
        writer.log(0, {"train/loss": 7.0})
    assert load_metrics(path)["step"].tolist() == [0]


def test_events_are_flushed_at_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path, **NO_AUTO_FLUSH) as writer:
        writer.event("thermal_pause", step=3, detail={"gpu": 0, "temperature_c": 85.5}, time_s=1000.25)
        writer.log(3, {"train/loss": 1.0})
        writer.event("engine_dead", step=None, detail={"engine": "e0", "reason": "timeout ☃"})
        assert [event["kind"] for event in load_events(path)] == ["thermal_pause", "engine_dead"]
        assert load_metrics(path)["step"].tolist() == [3]
        with pytest.raises(TypeError, match="'bad'.*JSON"):
            writer.event("bad", step=1, detail={"x": object()})
        with pytest.raises(ValueError, match="event step must be >= 0"):
            writer.event("bad", step=-1)
    first, second = load_events(path)
    assert first == {"time_s": 1000.25, "step": 3, "kind": "thermal_pause", "detail": {"gpu": 0, "temperature_c": 85.5}}
    assert second["step"] is None and second["detail"] == {"engine": "e0", "reason": "timeout ☃"}
    assert second["time_s"] > 1.6e9


def test_root_attrs(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.h5"
    config_yaml = "model: tiny\n" + "x: 1\n" * 30_000  # larger than HDF5's 64 KiB compact attribute limit
    with MetricsWriter(path, root_attrs={"config": config_yaml, "git_commit": "abc123"}) as writer:
        writer.log(0, {"train/loss": 1.0})
        writer.set_root_attrs({"hosts": json.dumps(["node1", "node2"]), "git_commit": "def456"})
        with pytest.raises(TypeError, match="'versions'.*json.dumps"):
            writer.set_root_attrs({"versions": {"torch": "2.13"}})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="reserved"):
            writer.set_root_attrs({"hpcrl_format": "x"})
    assert load_root_attrs(path) == {"config": config_yaml, "git_commit": "def456", "hosts": '["node1", "node2"]'}
    assert load_metrics(path)["train/loss"].tolist() == [1.0]


def test_reader_in_another_process_reads_while_writer_is_open(tmp_path: Path) -> None:
    path = tmp_path / "metrics.h5"
    reader = """
        import json, sys
        from hpcrl.store.metrics import load_events, load_metrics
        metrics = load_metrics(sys.argv[1])
        print(json.dumps({key: value.tolist() for key, value in metrics.items()}))
        print(json.dumps([event["kind"] for event in load_events(sys.argv[1])]))
    """
    with MetricsWriter(path, **NO_AUTO_FLUSH) as writer:
        for step in range(3):
            writer.log(step, {"train/loss": step / 2})
        writer.flush()
        writer.event("started", step=None)
        writer.log(3, {"train/loss": 9.0})  # buffered: the reader must not see it
        result = run_python(reader, str(path))
        assert result.returncode == 0, result.stderr
        metrics_line, events_line = result.stdout.splitlines()
        assert json.loads(metrics_line) == {"step": [0, 1, 2], "train/loss": [0.0, 0.5, 1.0]}
        assert json.loads(events_line) == ["started"]
        writer.log(4, {"train/loss": 8.0, "eval/accuracy": 0.5})
        writer.flush()
        result = run_python(reader, str(path))
        assert result.returncode == 0, result.stderr
        metrics = json.loads(result.stdout.splitlines()[0])
        assert metrics["step"] == [0, 1, 2, 3, 4]
        assert metrics["eval/accuracy"][-1] == 0.5


def test_file_of_a_killed_writer_is_recovered(tmp_path: Path) -> None:
    path = tmp_path / "metrics.h5"
    killed_writer = """
        import os, signal, sys
        from hpcrl.store.metrics import MetricsWriter
        writer = MetricsWriter(sys.argv[1], flush_every_steps=1000, flush_interval_s=1e9)
        for step in range(5):
            writer.log(step, {"train/loss": float(step)})
        writer.flush()
        writer.event("started", step=None)
        writer.log(5, {"train/loss": 5.0})
        os.kill(os.getpid(), signal.SIGKILL)
    """
    result = run_python(killed_writer, str(path))
    assert result.returncode == -9, result.stderr
    with pytest.warns(RuntimeWarning, match="not closed by its last writer"):
        writer = MetricsWriter(path, **NO_AUTO_FLUSH)
    with writer:
        writer.log(5, {"train/loss": 50.0})
    assert load_metrics(path)["train/loss"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 50.0]
    assert [event["kind"] for event in load_events(path)] == ["started"]


def test_readers_give_clear_errors_for_bad_files(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        load_metrics(tmp_path / "missing.h5")
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(StoreError, match="not an HDF5 file"):
        load_events(garbage)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["metrics/step"] = np.arange(3)
    with pytest.raises(StoreError, match="not an hpcrl metrics file"):
        load_root_attrs(foreign)
    truncated = tmp_path / "truncated.h5"
    with MetricsWriter(truncated) as writer:
        for step in range(2000):
            writer.log(step, {"train/loss": float(step), "train/kl": 0.0})
    size_bytes = truncated.stat().st_size
    with open(truncated, "r+b") as f:
        f.truncate(size_bytes // 2)
    with pytest.raises(StoreError, match="truncated or corrupt"):
        load_metrics(truncated)


def test_a_file_whose_writer_is_still_extending_it_is_not_called_truncated(tmp_path: Path) -> None:
    # The window CI caught: a writer had written the superblock's new end of file but not yet the data behind
    # it, so the file read as truncated although nothing was lost. Here the writer is open in SWMR mode and
    # the file is cut short the way that window leaves it.
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path, **NO_AUTO_FLUSH) as writer:
        for step in range(200):
            writer.log(step, {"train/loss": float(step)})
        writer.flush()
        data = path.read_bytes()
        assert data[11] & 0x05 == 0x05  # open for write, SWMR writing
        short = tmp_path / "short" / "metrics.h5"
        short.parent.mkdir()
        short.write_bytes(data[:-4096])
        assert load_metrics(short)["train/loss"].tolist() == [float(step) for step in range(200)]
    # The same cut in a file whose writer closed it is truncated, and says so at once.
    data = path.read_bytes()
    path.write_bytes(data[:-4096])
    started_s = time.monotonic()
    with pytest.raises(StoreError, match="truncated or corrupt"):
        load_metrics(path)
    assert time.monotonic() - started_s < 0.5


# What HDF5 said to readers that landed on an unfinished append in CI: an event's variable-length strings trailing
# their dataset's new extent (test_report_while_another_process_writes), and visititems over the metrics group
# while the writer extended it (test_real_roles_async_requeued_at_random_points_keeps_the_prompt_ledger).
UNFINISHED_APPENDS = [
    OSError("Can't synchronously read data (len not positive after adjustment for EOA)"),
    RuntimeError("Object visitation failed (address of object past end of allocation)"),
]


@pytest.mark.parametrize("failure", UNFINISHED_APPENDS, ids=["eoa", "visitation"])
def test_a_read_that_lands_on_an_unfinished_append_is_retried_while_the_writer_is_open(
    tmp_path: Path, failure: Exception
) -> None:
    # The read fails that way once; with the writer open it is read again, with the writer gone it fails at once,
    # as a StoreError (what a caller such as `hpcrl report` handles).
    from hpcrl.store.metrics import _read

    path = tmp_path / "metrics.h5"
    failures = [0]

    def read_failing_once(f: h5py.File) -> int:
        failures[0] += 1
        if failures[0] == 1:
            raise failure
        return int(f["events/kind"].shape[0])

    with MetricsWriter(path, **NO_AUTO_FLUSH) as writer:
        writer.event("thermal_pause", step=1, detail={"gpu": 0})
        assert _read(path, read_failing_once) == 1 and failures[0] == 2
    failures[0] = 0
    started_s = time.monotonic()
    with pytest.raises(StoreError, match=re.escape(str(failure)[:20])):
        _read(path, read_failing_once)
    assert time.monotonic() - started_s < 0.5 and failures[0] == 1


def test_writer_refuses_foreign_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"not hdf5")
    with pytest.raises(StoreError, match="not an HDF5 file"):
        MetricsWriter(garbage)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w", libver="latest") as f:
        f["data"] = np.arange(3)
    with pytest.raises(StoreError, match="not an hpcrl metrics file"):
        MetricsWriter(foreign)
    with h5py.File(foreign, "r") as f:
        assert f["data"][()].tolist() == [0, 1, 2]


def test_closed_writer_refuses_writes(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.h5")
    writer.log(0, {"train/loss": 1.0})
    writer.close()
    writer.close()
    with pytest.raises(StoreError, match="closed"):
        writer.log(1, {"train/loss": 1.0})
    assert load_metrics(tmp_path / "metrics.h5")["step"].tolist() == [0]


def test_load_metrics_frame(tmp_path: Path) -> None:
    pytest.importorskip("pandas")
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path) as writer:
        writer.log(10, {"train/loss": 1.0})
        writer.log(20, {"train/loss": 2.0, "eval/accuracy": 0.5})
    frame = load_metrics_frame(path)
    assert frame.index.name == "step" and frame.index.tolist() == [10, 20]
    assert sorted(frame.columns) == ["eval/accuracy", "train/loss"]
    assert frame.loc[20, "train/loss"] == 2.0 and math.isnan(frame.loc[10, "eval/accuracy"])
