"""sync.transport=mpi in the Slurm job: one `srun --mpi=pmix` step over both het groups.

    pytest tests/e2e/test_slurm_mpi.py          # starts tools/slurm-dev's cluster when it is not up (root)

Without a cluster (tests/unit/test_slurm_mpi_render.py): the rendered step and the checks that refuse a
job that cannot form its MPI world. Here: srun's MPI plugins, and on the cluster the step's shape with
the stub roles (one MPI world: PMIx ranks over both components, each task told its component), a failing
agent that ends the job instead of hanging it, and the shortened quickstart with the
real roles, whose training must equal a local run's with the distributed transport.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.cli import main
from hpcrl.config import ConfigError, dump_yaml
from hpcrl.slurm.render import check_mpi_launch
from tests.support import (
    MPI_LAYOUT,
    STUB,
    SlurmCluster,
    check_metrics,
    final_weights,
    make_config,
    real_config,
    records,
    result,
    sbatch,
    skip_or_fail,
)

pytestmark = pytest.mark.slurm

# --------------------------------------------------------------------------------------------------
# srun: its MPI plugins


def test_mpi_plugin_that_this_slurm_lacks_fails_at_render() -> None:
    from hpcrl.slurm.doctor import srun_mpi_plugins

    if srun_mpi_plugins() is None:
        skip_or_fail("no srun here: Slurm's MPI plugins are checked where srun is")
    with pytest.raises(ConfigError, match=r"srun --mpi=pmi9 \(slurm.mpi\).*srun --mpi=list"):
        check_mpi_launch(make_config({"sync.transport": "mpi", "slurm.mpi": "pmi9"}), None)


# --------------------------------------------------------------------------------------------------
# The dev cluster: the step's shape with the stub roles


def test_mpi_step_spans_both_het_groups_on_the_cluster(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    from hpcrl.slurm.executor import submit_run

    job = submit_run(make_config(MPI_LAYOUT), tmp_path / "run", role_command=STUB)
    outcome = result(job, slurm_cluster, 60)
    assert outcome["restart_count"] == 0
    agents = records(tmp_path / "run", "mpi-agent", job.job_id)
    trainers = records(tmp_path / "run", "trainer", job.job_id)
    assert len(agents) == 2 and len(trainers) == 2, (agents, trainers, job.stdout())
    # One MPI world of 4 (srun --mpi=pmix gives every task a PMIx rank), agents first, each told its component.
    ranks = sorted(int(re.search(r"pmix_rank=(\d+)", r).group(1)) for r in agents + trainers)  # type: ignore[union-attr]
    assert ranks == [0, 1, 2, 3]
    assert all("het_group=0 step_tasks=4" in a for a in agents) and all("het_group=1" in t for t in trainers)
    agent_nodes = {re.search(r"node=(\S+)", a).group(1) for a in agents}  # type: ignore[union-attr]
    trainer_nodes = {re.search(r"node=(\S+)", t).group(1) for t in trainers}  # type: ignore[union-attr]
    assert len(agent_nodes) == 2 and len(trainer_nodes) == 1 and not agent_nodes & trainer_nodes


def test_a_failing_mpi_agent_ends_the_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The trainer would wait for it in a collective: --kill-on-bad-exit ends the step, the job fails.
    Slurm 22.05's srun sometimes hangs after that (mpi/pmix: pmixp_abort_agent_stop); the script's
    watchdog then ends srun once it has outlived every step by SRUN_OUTLIVES_STEPS_S."""
    from hpcrl.slurm.executor import submit_run
    from hpcrl.slurm.render import SRUN_OUTLIVES_STEPS_S

    env = {"STUB_AGENT": "fail", "STUB_TRAINER": "block"}  # the stub trainer would otherwise wait 120 s
    job = submit_run(make_config(MPI_LAYOUT | {"slurm.env": env}), tmp_path / "run", role_command=STUB)
    assert slurm_cluster.wait_done(job.job_id, SRUN_OUTLIVES_STEPS_S + 60) == "FAILED"
    if "srun outlived every step" in (job.stdout() or ""):
        print(f"job {job.job_id}: srun hung after the failed step; the watchdog ended it")


# --------------------------------------------------------------------------------------------------
# The dev cluster: the quickstart with the real roles


MPI_STEPS = 8


@pytest.mark.slow
def test_quickstart_with_mpi_transport_as_a_het_job(
    slurm_cluster: SlurmCluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`hpcrl sbatch` + plain `sbatch`: trainer rank 0 broadcasts every push to an agent per engine node.

    The engines start from the initial weights; only the pushes can give them the SFT'd and then the
    trained ones. So: the trainer's log-probs of what the engines sampled equal the engines' own at every
    step (a stale engine is off by far more), one load per push on every agent, and the run trains
    exactly like a local run whose engines get the weights by the distributed transport.
    """
    import torch

    from hpcrl.store import load_metrics

    cfg = real_config(tiny_model_dir, **MPI_LAYOUT, num_steps=MPI_STEPS, **{"checkpoint.every_steps": 4})
    config = tmp_path / "mpi.yaml"
    config.write_text(dump_yaml(cfg))
    script, run_dir = tmp_path / "mpi.sbatch", tmp_path / "run"
    # --base-dir: the job runs (and writes its slurm-JOBID.out) in tmp_path, not in the repository.
    assert main(["sbatch", str(config), "-o", str(script), "--run-dir", str(run_dir), "--base-dir", str(tmp_path)]) == 0
    job_id = sbatch(script)
    state = slurm_cluster.wait_done(job_id, 420)  # a het job of 6 Python processes: minutes on 2 loaded cores
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", log
    assert "mpi agent 1: engines 0..0 ready" in log and "mpi agent 2: engines 1..1 ready" in log, log
    for agent in (1, 2):  # one push after SFT, then one per step
        assert len(re.findall(rf"^mpi agent {agent}: .* bucket loaded", log, re.M)) == MPI_STEPS + 1, log
    check_metrics(run_dir, MPI_STEPS)
    metrics = load_metrics(run_dir / "metrics.h5")
    assert all(metrics["sync/num_buckets"] >= 1) and all(metrics["sync/bytes"] > 0)
    gap = metrics["train/train_rollout_logprob_max_abs_diff"]
    assert gap.max() < 1e-4, f"an engine sampled with weights other than the trainer's: {gap}"

    # The same run locally (engines and trainer ranks spawned by `hpcrl run`, the distributed transport).
    local = tmp_path / "local.yaml"
    local.write_text(dump_yaml(real_config(tiny_model_dir, **(MPI_LAYOUT | {"sync.transport": "distributed"}),
                                           num_steps=MPI_STEPS, **{"checkpoint.every_steps": 4})))  # fmt: skip
    ref = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", str(local), "--run-dir", str(tmp_path / "ref")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert ref.returncode == 0, ref.stdout + ref.stderr
    reference = load_metrics(tmp_path / "ref" / "metrics.h5")
    for key in ("rollout/reward_mean", "train/loss", "train/grad_norm"):
        assert list(metrics[key]) == list(reference[key]), key
    mpi_weights, ref_weights = final_weights(run_dir), final_weights(tmp_path / "ref")
    assert mpi_weights.keys() == ref_weights.keys()
    assert all(torch.equal(mpi_weights[k], ref_weights[k]) for k in ref_weights), "final weights differ"
