"""`hpcrl report` / `hpcrl compare` on a real run made here: numbers from the HDF5 datasets, plots, SWMR, bad files."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcrl.report.build import ReportResult, build_report, unique_names
from hpcrl.report.cli import add_report_commands, main
from hpcrl.report.plots import pause_spans, timing_layers
from hpcrl.report.run import RunData, load_run
from hpcrl.report.summary import WINDOW_METRICS, compare, fmt, largest_step_change, summarize
from hpcrl.store.metrics import MetricsWriter, StoreError, load_events, load_metrics

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 6  # the steps of the shared run (tests.support.SMALL)
RUN_PLOTS = {"reward.png", "timing.png", "logprob_gap.png", "train.png", "throughput.png"}
OPTIONAL_PLOTS = {"thermal.png", "async.png", "fleet.png", "memory.png"}


@pytest.fixture(scope="module")
def real_run(small_run: tuple[Path, str]) -> Path:
    """One real 6-step GRPO run (embedded engine, real HDF5), shared by the session: the tests only read it."""
    return small_run[0]


@pytest.fixture(scope="module")
def report(real_run: Path, tmp_path_factory: pytest.TempPathFactory) -> ReportResult:
    return build_report(real_run, tmp_path_factory.mktemp("report_out"))


def column(f: h5py.File, key: str) -> np.ndarray:
    return f[f"metrics/{key}"][:]


def test_summary_numbers_equal_the_hdf5_datasets(real_run: Path, report: ReportResult) -> None:
    summary, markdown = report.summary, report.markdown
    with h5py.File(real_run / "metrics.h5", "r") as f:
        steps = f["metrics/step"][:]
        assert summary.num_rows == len(steps) == NUM_STEPS
        n = NUM_STEPS // 2  # the default window (10) is capped at half the rows
        assert summary.window == n
        for key, label in WINDOW_METRICS:
            values = column(f, key)
            first, last = summary.means[key].first, summary.means[key].last
            assert first == pytest.approx(float(np.mean(values[:n])), rel=1e-12, abs=0), key
            assert last == pytest.approx(float(np.mean(values[-n:])), rel=1e-12, abs=0), key
            row = next(line for line in markdown.splitlines() if line.startswith(f"| {label} "))
            assert f" {fmt(first)} " in row and f" {fmt(last)} " in row, row
        for phase in ("rollout", "reward", "logprob", "train", "sync", "checkpoint", "total"):
            expected = float(np.median(column(f, f"timing/{phase}_s")))
            assert summary.phase_median_s[phase] == pytest.approx(expected, rel=1e-12), phase
        assert summary.tokens_per_s_median == pytest.approx(float(np.median(column(f, "rollout/tokens_per_s"))))
        assert summary.sync_median_s == pytest.approx(float(np.median(column(f, "sync/seconds"))))
        assert summary.sync_total_s == pytest.approx(float(np.sum(column(f, "sync/seconds"))))
        assert summary.sync_bytes_median == float(np.median(column(f, "sync/bytes")))
        reward = column(f, "rollout/reward_mean")
        i = int(np.argmax(np.abs(np.diff(reward))))
        assert summary.reward_change is not None
        assert (summary.reward_change.step, summary.reward_change.change) == (
            int(steps[i + 1]) + 1,  # the report counts steps from 1, as the console
            reward[i + 1] - reward[i],
        )
        kinds = f["events/kind"].asstr()[:].tolist()
    assert kinds == ["sft_done", "finished"]
    assert summary.status == "finished" and summary.planned_steps == NUM_STEPS
    assert all(i.count == 0 for i in summary.interruptions.values())
    assert f"{fmt(summary.phase_median_s['rollout'])}" in markdown
    assert report.markdown_path.read_text() == markdown


def assert_png_has_content(path: Path) -> None:
    from matplotlib.image import imread

    assert path.stat().st_size > 10_000, path
    pixels = imread(path)[..., :3]
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 900, (path, pixels.shape)
    # A blank or single-colour image has (almost) no variance; a drawn plot has axes, text and curves.
    assert pixels.std() > 0.05, path
    non_white = (pixels < 0.9).any(axis=-1).mean()
    assert 0.01 < non_white < 0.9, (path, non_white)


def test_every_plot_exists_with_content(report: ReportResult) -> None:
    assert {p.name for p in report.plots} == RUN_PLOTS
    for path in report.plots:
        assert_png_has_content(path)
        assert f"]({path.name})" in report.markdown


def guard_row(step: int, hot: bool) -> dict[str, float]:
    return {
        "guard/peak_temp_c/node0/0": 85.0 if hot else 70.0 + step % 3,
        "guard/peak_temp_c/node0/1": 66.0,
        "guard/paused_s": 30.0 if hot else 0.0,
        "queue/size": float(step % 5),
        "queue/staleness_mean": 0.5,
        "memory/train_gb": 1.5 + 0.01 * step,
    }


def test_report_while_the_writer_still_writes(real_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    shutil.copy(real_run / "metrics.h5", run_dir / "metrics.h5")
    base = {k: float(v[-1]) for k, v in load_metrics(run_dir / "metrics.h5").items() if k != "step"}
    out = tmp_path / "out"
    with MetricsWriter(run_dir / "metrics.h5", flush_every_steps=1) as writer:
        for step in range(NUM_STEPS, NUM_STEPS + 8):
            hot = step in (8, 9)
            joined = {"fleet/engines_joined": float(step == 11)}  # an engine of another job joins: fleet.png
            writer.log(step, base | {"rollout/reward_mean": step / 20} | guard_row(step, hot) | joined)
            if step == 8:
                writer.event("thermal_pause", step=step, detail={"node": "node0", "gpu": 0}, time_s=1000.0)
            if step == 9:
                # As hpcrl.guard does: the resume names the node's hottest GPU then, not the one that paused.
                detail = {"node": "node0", "gpu": 1, "temperature_c": 71.0, "duration_s": 42.5}
                writer.event("thermal_resume", step=step, detail=detail, time_s=1042.5)
            if step == 10:
                writer.event("preempted", step=step, detail={"signal": "SIGUSR2"}, time_s=2000.0)
                writer.event("resumed", step=step, detail={}, time_s=2300.0)
                writer.event("engine_dead", step=step, detail={"engine": 0}, time_s=2400.0)
                writer.event("engine_restarted", step=step, detail={"engine": 0}, time_s=2412.0)
            # The report reads while the writer holds the file open in SWMR mode; plots only at the end (time).
            result = build_report(run_dir, out, plots=step == NUM_STEPS + 7)
            assert result.summary.num_rows == step + 1 and result.summary.last_step == step + 1
        events = load_events(run_dir / "metrics.h5")
    summary = result.summary
    assert summary.status.startswith("not finished")
    assert summary.interruptions["preemptions"].count == 1 and summary.interruptions["preemptions"].total_s == 300.0
    assert summary.interruptions["engine restarts"].count == 1
    assert summary.interruptions["engine restarts"].total_s == 12.0
    thermal = summary.interruptions["thermal pauses"]
    assert (thermal.count, thermal.total_s) == (1, 42.5)
    assert [e["kind"] for e in events].count("thermal_pause") == 1
    assert summary.extras["thermal pause seconds (guard/paused_s, sum)"] == 60.0
    assert summary.extras["peak GPU temperature (C)"] == 85.0
    assert summary.extras["memory/train_gb (max)"] == pytest.approx(1.5 + 0.01 * (NUM_STEPS + 7))
    # Rows of the original run lack the guard keys: they read as NaN and are skipped, not zeros.
    assert np.isnan(load_metrics(run_dir / "metrics.h5")["guard/paused_s"][:NUM_STEPS]).all()
    assert pause_spans(load_run(run_dir)) == [(8.5, 10.5)]  # steps 9 and 10 (indexes 8, 9), shaded in thermal.png
    # Events are drawn at the step the console printed when they happened: index 10 is step 11.
    assert [(e["kind"], e["step"]) for e in load_run(run_dir).events if e["step"] == 11] == [
        ("preempted", 11), ("resumed", 11), ("engine_dead", 11), ("engine_restarted", 11),
    ]  # fmt: skip
    assert {p.name for p in result.plots} == RUN_PLOTS | OPTIONAL_PLOTS
    for path in result.plots:
        assert_png_has_content(path)
    assert table_row(result.markdown, "preemptions") == ["preemptions", "1", "0:05:00"]
    assert table_row(result.markdown, "thermal pauses") == ["thermal pauses", "1", "42.5 s"]
    assert table_row(result.markdown, "engine restarts") == ["engine restarts", "1", "12 s"]


WRITER = """
    import sys, time
    from hpcrl.store.metrics import MetricsWriter
    with MetricsWriter(sys.argv[1], flush_every_steps=1) as w:
        for step in range(60):
            row = {"rollout/reward_mean": step / 60, "timing/total_s": 0.01}
            if step >= 30:
                row["guard/paused_s"] = 0.0  # a new key mid-run: the writer leaves SWMR to add it
            w.log(step, row)
            if step % 15 == 7:
                w.event("thermal_pause", step=step, detail={"node": "n", "gpu": 0})
            time.sleep(0.03)
    print("done", flush=True)
"""


def test_report_while_another_process_writes(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.h5"
    path.parent.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(path)], stdout=subprocess.PIPE)
    try:
        seen: list[int] = []
        while writer.poll() is None:
            time.sleep(0.02)
            if not path.exists():
                continue
            try:
                seen.append(build_report(path.parent, tmp_path / "out", plots=False).summary.num_rows)
            except StoreError:
                # Only while the writer is still creating the file; once readable, every read must succeed.
                if seen:
                    raise
        assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
    assert len(seen) >= 3 and seen == sorted(seen), seen
    assert build_report(path.parent, tmp_path / "out", plots=False).summary.num_rows == 60


def run_cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(list(args))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_truncated_foreign_and_missing_files_give_clear_errors(
    real_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = (real_run / "metrics.h5").read_bytes()
    cases = {
        "truncated": (data[: len(data) // 2], "truncated or corrupt"),
        "foreign": (None, "not an hpcrl metrics file"),
        "text": (b"step,reward\n0,1.0\n", "not an HDF5 file"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).mkdir()
        path = tmp_path / name / "metrics.h5"
        if content is None:
            with h5py.File(path, "w") as f:
                f["x"] = np.arange(3)
        else:
            path.write_bytes(content)
        rc, out, err = run_cli("report", str(path.parent), "-o", str(tmp_path / "out"), capsys=capsys)
        assert rc == 1 and out == "", name
        assert err.startswith("hpcrl report: error: ") and message in err and err.count("\n") == 1, err
    (tmp_path / "empty").mkdir()
    rc, _, err = run_cli("report", str(tmp_path / "empty"), capsys=capsys)
    assert rc == 1 and "without metrics.h5" in err and "--run-dir" in err
    rc, _, err = run_cli("compare", str(real_run), str(tmp_path / "foreign"), "-o", str(tmp_path / "c"), capsys=capsys)
    assert rc == 1 and "foreign" in err and "not an hpcrl metrics file" in err
    # The real entry point: exit status and one line on stderr, no traceback.
    proc = subprocess.run(
        [sys.executable, "-m", "hpcrl.report.cli", "report", str(tmp_path / "truncated"), "--no-plots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "truncated or corrupt" in proc.stderr and "Traceback" not in proc.stderr


def test_compare_runs_side_by_side(real_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A second run: the real one continued by 4 steps (as a resumed run would be), in a folder of the same name.
    other = tmp_path / "b" / real_run.name
    other.mkdir(parents=True)
    shutil.copy(real_run / "metrics.h5", other / "metrics.h5")
    metrics = load_metrics(other / "metrics.h5")
    base = {k: float(v[-1]) for k, v in metrics.items() if k != "step"}
    # Rewards are in [0, 1], so steps of +2 are the largest change; argmax takes the first of equal ones.
    with MetricsWriter(other / "metrics.h5") as writer:
        for k in range(4):
            writer.log(NUM_STEPS + k, base | {"rollout/reward_mean": base["rollout/reward_mean"] + 2.0 * (k + 1)})
    rc, out, _ = run_cli("compare", str(real_run), str(other), "-o", str(tmp_path / "cmp"), capsys=capsys)
    assert rc == 0
    markdown = (tmp_path / "cmp" / "compare.md").read_text()
    assert out.startswith(markdown) and "compare.png" in out
    assert_png_has_content(tmp_path / "cmp" / "compare.png")

    names = unique_names([real_run, other])
    assert names == [f"{real_run.parent.name}/{real_run.name}", f"b/{real_run.name}"]  # same folder name: parents added
    comparison = compare([load_run(real_run), load_run(other)])
    n = NUM_STEPS // 2  # capped by the shorter run
    assert comparison.window == n
    for i, path in enumerate([real_run, other]):
        with h5py.File(path / "metrics.h5", "r") as f:
            reward, total, steps = column(f, "rollout/reward_mean"), column(f, "timing/total_s"), f["metrics/step"][:]
        expected = {
            ("reward (raw, mean per step)", f"first {n}"): np.mean(reward[:n]),
            ("reward (raw, mean per step)", f"last {n}"): np.mean(reward[-n:]),
            ("seconds per step", f"last {n}"): np.mean(total[-n:]),
        }
        for row, value in expected.items():
            assert comparison.means[row][i] == pytest.approx(float(value), rel=1e-12), (path, row)
            cells = table_row(markdown, row[0], row[1])
            assert cells[2 + i] == fmt(comparison.means[row][i])
        assert comparison.reward_changes[i] == largest_step_change(steps + 1, reward)
    jump = comparison.reward_changes[1]
    assert jump is not None and jump.step == NUM_STEPS + 1 and jump.change == pytest.approx(2.0)
    assert table_row(markdown, "largest step-to-step reward change")[3] == f"{fmt(jump.change, signed=True)} at step 7"


def table_row(markdown: str, *first_cells: str) -> list[str]:
    """The cells of the markdown table row that starts with ``first_cells``."""
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and cells[: len(first_cells)] == list(first_cells):
            return cells
    raise AssertionError(f"no row {first_cells} in:\n{markdown}")


def test_an_empty_run_reports_no_steps(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path / "run" / "metrics.h5") as writer:
        result = build_report(tmp_path / "run", tmp_path / "out")
        writer.event("sft_done", step=None, detail={})
    assert result.summary.num_rows == 0 and result.plots == []
    assert "no steps recorded yet" in result.markdown
    assert summarize(load_run(tmp_path / "run")).interruptions["preemptions"].count == 0


def test_long_runs_are_drawn_in_bins(real_run: Path, tmp_path: Path) -> None:
    from hpcrl.report.plots import binned, plot_run

    steps, values = np.arange(10), np.arange(10, dtype=np.float64)
    values[3] = np.nan
    x, mean, lo, hi = binned(steps, values, max_points=4)  # bins of 3 rows: [0 1 2] [3 4 5] [6 7 8] [9]
    np.testing.assert_array_equal(x, [1, 4, 7, 9])
    np.testing.assert_array_equal(mean, [1, 4.5, 7, 9])
    assert lo is not None and hi is not None
    np.testing.assert_array_equal(lo, [0, 4, 6, 9])
    np.testing.assert_array_equal(hi, [2, 5, 8, 9])
    paths = plot_run(load_run(real_run), tmp_path, max_points=2)
    assert {p.name for p in paths} == RUN_PLOTS
    assert_png_has_content(tmp_path / "reward.png")


def test_cli_help_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="hpcrl")
    add_report_commands(parser.add_subparsers(dest="cmd", required=True))
    for command, words in [("report", ["RUN_DIR", "--window", "--no-plots", "thermal.png"]), ("compare", ["RUN_DIR"])]:
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = capsys.readouterr().out
        assert all(word in text for word in [*words, "-o DIR", "examples:"]), text
    rc, _, err = run_cli("compare", "only_one", capsys=capsys)
    assert rc == 1 and "at least two runs" in err
    with pytest.raises(SystemExit):
        parser.parse_args(["report", "x", "--window", "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_building_the_cli_imports_no_numpy_h5py_or_torch() -> None:
    # `hpcrl --help` and every command's parsing must stay fast on a login node.
    code = "import json, sys; from hpcrl.cli import build_parser; build_parser(); print(json.dumps(list(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = {name.split(".")[0] for name in json.loads(out)}
    assert not loaded & {"numpy", "h5py", "torch", "matplotlib"}


def test_report_modules_do_not_import_each_other_in_a_cycle() -> None:
    import ast

    paths = sorted((REPO / "hpcrl" / "report").glob("*.py"))
    modules = {path.stem for path in paths}
    imports: dict[str, set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        imports[path.stem] = {m.split(".")[2] for m in names if m.startswith("hpcrl.report.")} & modules - {path.stem}
    order = ["__init__", "run", "summary", "plots", "build", "cli"]
    assert sorted(imports) == sorted(order)
    for module, used in imports.items():
        assert used <= set(order[: order.index(module)]), f"hpcrl.report.{module} imports {used}: a cycle"


def _timing_run(**columns: list[float]) -> RunData:
    metrics = {"step": np.arange(len(next(iter(columns.values()))))}
    metrics |= {f"timing/{k}_s": np.array(v, dtype=np.float64) for k, v in columns.items()}
    return RunData(name="t", path=Path("t/metrics.h5"), metrics=metrics, events=[], attrs={})


def test_the_timing_stack_counts_each_second_once() -> None:
    # A step of 2 s: sync (1 s) is split into pause, send and commit; logprob is the forward inside train.
    run = _timing_run(
        rollout=[0.5, 0.4], reward=[0.1, 0.1], logprob=[0.1, 0.1], train=[0.3, 0.3], sync=[1.0, 0.6],
        sync_pause=[0.2, 0.1], sync_send=[0.5, 0.3], sync_commit=[0.25, 0.1], checkpoint=[0.0, 0.2], total=[2.0, 1.7],
    )  # fmt: skip
    layers = dict(timing_layers(run))
    assert list(layers) == [
        "rollout", "reward", "logprob (forward part of train)", "train (rest)",
        "sync_pause", "sync_send", "sync_commit", "sync (rest)", "checkpoint", "other",
    ]  # fmt: skip
    np.testing.assert_allclose(np.sum(list(layers.values()), axis=0), [2.0, 1.7], rtol=0, atol=1e-12)
    np.testing.assert_allclose(layers["sync (rest)"], [0.05, 0.1], atol=1e-12)
    np.testing.assert_allclose(layers["other"], [0.1, 0.1], atol=1e-12)  # outside every phase


def test_the_timing_stack_of_a_real_run_adds_up_to_the_step_time(real_run: Path) -> None:
    run = load_run(real_run)
    layers = dict(timing_layers(run))
    assert "sync" not in layers and {"sync_pause", "sync_send", "sync_commit", "sync (rest)"} <= set(layers)
    stacked = np.sum(list(layers.values()), axis=0)
    # Each phase lies inside the step's total, so the stack is the step time (to float rounding).
    np.testing.assert_allclose(stacked, run.metrics["timing/total_s"], rtol=1e-9)
    sync = sum(layers[k] for k in ("sync_pause", "sync_send", "sync_commit", "sync (rest)"))
    np.testing.assert_allclose(sync, run.metrics["timing/sync_s"], rtol=1e-9)


def test_the_summary_names_sync_parts_as_parts(report: ReportResult) -> None:
    rows = [line for line in report.markdown.splitlines() if line.startswith("| sync")]
    assert [row.split("|")[1].strip() for row in rows] == [
        "sync",
        "sync_pause (part of sync)",
        "sync_send (part of sync)",
        "sync_commit (part of sync)",
    ]
