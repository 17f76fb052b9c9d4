"""What a user reads about steps agrees everywhere: the console, checkpoint names, the report; the run dir is
named after the config's `name:`; a CPU run prints no NVML warning and no token ids; a finished run stops at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcrl.report.build import build_report
from hpcrl.report.plots import _colors, flat_zero, metric_label
from hpcrl.store.metrics import MetricsWriter
from hpcrl.store.run_dir import RunDirError, default_run_dir

REPO = Path(__file__).resolve().parents[2]
SMALL = ["sft.num_steps=0", "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6"]


def hpcrl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def listing(run_dir: Path) -> dict[str, float]:
    return {str(p.relative_to(run_dir)): p.stat().st_mtime for p in run_dir.rglob("*") if p.name != ".hpcrl.lock"}


def test_console_checkpoints_and_report_count_steps_alike(tmp_path: Path, tiny_model_dir: Path) -> None:
    text = (REPO / "experiments" / "quickstart.yaml").read_text()
    # The file's stem differs from its name: the run dir follows the name.
    (tmp_path / "my-experiment.yaml").write_text(
        text.replace("path: runs/models/tiny-qwen3", f"path: {tiny_model_dir}")
    )
    out = hpcrl("run", "my-experiment.yaml", *SMALL, "num_steps=3", "checkpoint.every_steps=1", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = tmp_path / "runs" / "quickstart"
    assert f"-> {Path('runs') / 'quickstart'}" in out.stdout and not (tmp_path / "runs" / "my-experiment").exists()
    said = out.stdout + out.stderr
    assert "nvml" not in said.lower() and "token ids" not in said  # a CPU run, not --verbose
    # The console's last line is "step 3/3" and the newest checkpoint is step_00000003.h5, holding index 2.
    assert [line.split("|")[0].split()[1] for line in out.stdout.splitlines() if line.startswith("step ")] == [
        "1/3", "2/3", "3/3",
    ]  # fmt: skip
    names = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.h5"))
    assert names == ["step_00000002.h5", "step_00000003.h5"]  # keep_last=2
    with h5py.File(run_dir / "checkpoints" / "step_00000003.h5", "r") as f:
        assert int(f.attrs["step"]) == 2  # the stored index, as in metrics.h5
    report = build_report(run_dir, tmp_path / "rep", plots=False)
    assert "steps 1-3 (3 rows of 3 planned)" in report.markdown

    # A finished run: exit 0 at once, no engine or trainer started, nothing in the run dir touched.
    before = listing(run_dir)
    t0 = time.monotonic()
    again = hpcrl("run", "my-experiment.yaml", *SMALL, "num_steps=3", "checkpoint.every_steps=1", cwd=tmp_path)
    elapsed_s = time.monotonic() - t0
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already finished all 3 steps" in again.stdout and "engine" not in again.stdout.lower()
    assert listing(run_dir) == before and elapsed_s < 30, elapsed_s

    # A run dir written before checkpoints were named by the steps done (step_<index>.h5) still resumes.
    ckpt = run_dir / "checkpoints"
    (ckpt / "step_00000002.h5").rename(ckpt / "step_00000001.h5")
    (ckpt / "step_00000003.h5").rename(ckpt / "step_00000002.h5")
    more = hpcrl(
        "run", "my-experiment.yaml", *SMALL, "num_steps=4", "checkpoint.every_steps=1", "--verbose", cwd=tmp_path
    )
    assert more.returncode == 0, more.stdout + more.stderr
    assert "step_00000002.h5 (step 3 done); continuing at step 4" in more.stdout
    assert "first prompt of this step as token ids" in more.stdout  # --verbose shows them
    assert [line.split("|")[0].split()[1] for line in more.stdout.splitlines() if line.startswith("step ")] == ["4/4"]
    assert sorted(p.name for p in ckpt.glob("step_*.h5")) == ["step_00000002.h5", "step_00000004.h5"]


def test_the_default_run_dir_is_the_config_name() -> None:
    assert default_run_dir("quickstart") == Path("runs/quickstart")
    for bad in ("a/b", "..", "", ".hidden", "-x"):
        with pytest.raises(RunDirError, match="cannot name a run directory.*--run-dir"):
            default_run_dir(bad)


def test_plot_labels_are_words_with_units_and_colours_are_distinct(tmp_path: Path) -> None:
    assert metric_label("eval/mean_at_k") == ("mean reward of k samples", "mean reward")
    assert metric_label("train/entropy")[1] == "nats per token" and metric_label("x/wait_s")[1] == "seconds"
    colours = _colors(11)
    assert len(set(colours)) == 11  # the timing stack of a run with every phase has 11 layers
    assert flat_zero(np.array([0.0, np.nan, 0.0])) and not flat_zero(np.array([0.0, 1e-9]))
    with MetricsWriter(tmp_path / "r" / "metrics.h5") as w:
        for step in range(4):
            w.log(step, {"rollout/reward_mean": 0.1 * step, "eval/accuracy_greedy": 0.5, "eval/pass_at_k": 0.75,
                         "eval/mean_at_k": 0.6, "eval/k": 4.0, "train/ppo_kl": 0.0, "train/loss": 0.1})  # fmt: skip
    report = build_report(tmp_path / "r", tmp_path / "out", smooth=0)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in report.markdown.splitlines()]
    assert ["after step", "greedy accuracy", "pass@4", "mean reward@4"] in rows
    assert ["1", "0.5", "0.75", "0.6"] in rows and ["4", "0.5", "0.75", "0.6"] in rows  # steps 1..4, as the console
    assert {p.name for p in report.plots} >= {"reward.png", "train.png", "eval.png"}


def test_checkpoints_named_by_the_old_index_load_sort_and_age_out(tmp_path: Path) -> None:
    import torch

    from hpcrl.store.checkpoint import checkpoint_file, list_checkpoints, load_latest_checkpoint, save_checkpoint

    # A run dir from before: index 4's checkpoint named step_00000004.h5.
    save_checkpoint(tmp_path, 4, {"w": torch.ones(2)}, {}).rename(tmp_path / "step_00000004.h5")
    assert checkpoint_file(tmp_path, 4) == tmp_path / "step_00000004.h5"
    latest = load_latest_checkpoint(tmp_path)
    assert latest is not None and latest.step == 4
    # Resumed from it: the next checkpoints are named by the steps done and sort after it; retention drops it.
    save_checkpoint(tmp_path, 5, {"w": torch.ones(2)}, {}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004.h5", "step_00000006.h5"]
    assert checkpoint_file(tmp_path, 5) == tmp_path / "step_00000006.h5"
    save_checkpoint(tmp_path, 6, {"w": torch.ones(2)}, {}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000006.h5", "step_00000007.h5"]
