"""`hpcrl role engines|trainer` as srun starts them: each task sees the variables Slurm sets for its step.

The real-Slurm end-to-end tests (tests/e2e) submit these through a cluster; here the same processes
run with the step environment set by hand, to test the rendezvous logic quickly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hpcrl.config import dump_yaml
from hpcrl.run_config import load_run_config
from hpcrl.store import load_events, load_metrics

REPO = Path(__file__).resolve().parents[2]


def step_env(rank: int, ntasks: int, job_id: str = "4242", restart: int = 0) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SLURM_JOB_ID": job_id,
        "SLURM_PROCID": str(rank),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_NODELIST": "localhost",
        "SLURMD_NODENAME": "localhost",
        "SLURM_RESTART_COUNT": str(restart),
    }


def role(name: str, run_dir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "role", name, "--run-dir", str(run_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_engine_and_trainer_roles_rendezvous_and_finish(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = load_run_config(
        REPO / "experiments" / "quickstart.yaml",
        [
            f"model.path={tiny_model_dir}", "num_steps=3", "sft.num_steps=0", "data.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4", "engine.num_engines=2", "train.num_ranks=2",
        ],
    )  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    engines = role("engines", run_dir, step_env(0, 1))
    ranks = [role("trainer", run_dir, step_env(r, 2)) for r in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    assert "waiting for 2 embedded engine(s) of job 4242" in outs[0] and "step    3/3" in outs[0]
    engine_out = engines.communicate(timeout=60)[0]
    assert engines.returncode == 0, engine_out
    assert "engines 0..1 ready" in engine_out
    assert list(load_metrics(run_dir / "metrics.h5")["step"]) == [0, 1, 2]
    assert load_events(run_dir / "metrics.h5")[-1]["kind"] == "finished"
    # Rendezvous files are removed on the way out; the done marker names the job incarnation.
    assert not list((run_dir / "engines").glob("engine-*.json"))
    assert (run_dir / "engines" / "DONE-4242-0").exists()


def test_stale_rendezvous_of_a_previous_incarnation_is_ignored(tmp_path: Path) -> None:
    from hpcrl.engine.local import EngineStartError, Incarnation, wait_for_rendezvous

    (tmp_path / "engines").mkdir()
    record = {"id": "engine-0", "url": "http://127.0.0.1:1", "token": "t", "job_id": "7", "restart_count": 0}
    (tmp_path / "engines" / "engine-0.json").write_text(json.dumps(record))
    try:
        wait_for_rendezvous(tmp_path, 1, Incarnation("7", 1), timeout_s=0.6)
    except EngineStartError as exc:
        assert "restart 1" in str(exc) and "[0]" in str(exc)
    else:
        raise AssertionError("a file from restart 0 was taken for restart 1")
    assert len(wait_for_rendezvous(tmp_path, 1, Incarnation("7", 0), timeout_s=1)) == 1
