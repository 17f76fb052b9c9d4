"""Slurm jobs of a run on tools/slurm-dev's cluster (rendering, quoting and goldens without a cluster:
tests/unit/test_slurm_render.py).

    pytest tests/e2e/test_slurm.py                    # starts the cluster when it is not up (root)

The cluster tests replace `hpcrl role` by tests/e2e/stub_role.sh (same contract, milliseconds), so that
they test the job's shape, quoting and signal flow; `test_real_roles_*` run the real roles end to end.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest

from hpcrl.cli import main
from hpcrl.config import dump_yaml, from_dict, load_yaml
from hpcrl.run_config import RunConfig
from hpcrl.slurm.render import render_script
from tests.support import (
    HOSTILE_NAME,
    NUM_REAL_STEPS,
    STUB,
    SlurmCluster,
    check_metrics,
    final_weights,
    make_config,
    progress,
    progress_now,
    real_config,
    records,
    result,
    sbatch,
    wait_for,
)

pytestmark = pytest.mark.slurm

# --------------------------------------------------------------------------------------------------
# A real cluster: plain and het jobs, generated scripts with the stub roles


def stub_script(tmp_path: Path, cfg: RunConfig) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(cfg, str(run_dir), role_command=STUB))
    return script, run_dir


def test_cluster_runs_a_plain_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    print(f"cluster start took {slurm_cluster.start_s:.1f} s")
    out = subprocess.run(
        ["sbatch", "--parsable", "-o", str(tmp_path / "out"), "--wrap", "hostname"],
        capture_output=True,
        text=True,
    )
    job_id = out.stdout.strip()
    assert slurm_cluster.wait_done(job_id, 30) == "COMPLETED"
    assert (tmp_path / "out").read_text().strip() == os.uname().nodename


def test_cluster_runs_a_het_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "het.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH -o het.out\n#SBATCH -N 1 -n 1\n#SBATCH hetjob\n#SBATCH -N 1 -n 1\n"
        "srun --het-group=0 bash -c 'echo g0 $SLURMD_NODENAME' &\n"
        "srun --het-group=1 bash -c 'echo g1 $SLURMD_NODENAME' &\nwait\n"
    )
    job_id = sbatch(script)
    assert slurm_cluster.wait_done(job_id, 30) == "COMPLETED"
    # Accounting learns that it was a het job a moment after the end (sacct first shows a plain id).
    components = {f"{job_id}+0", f"{job_id}+1"}
    wait_for(lambda: set(slurm_cluster.states(job_id)) == components, 30, f"sacct to list {components}")
    lines = sorted((tmp_path / "het.out").read_text().split("\n"))
    groups = dict(line.split() for line in lines if line)
    assert set(groups) == {"g0", "g1"} and groups["g0"] != groups["g1"], "het components never share a node"


def test_generated_script_runs_with_plain_sbatch(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cfg = make_config(
        {
            "engine.num_engines": 2,
            "slurm.engines": {"gpus_per_node": 2, "gpus_per_engine": 1, "cpus_per_task": 2},
            "slurm.trainer": {"tasks_per_node": 2, "cpus_per_task": 1},
        }
    )
    script, run_dir = stub_script(tmp_path, cfg)
    job_id = sbatch(script)
    assert slurm_cluster.wait_done(job_id) == "COMPLETED", (tmp_path / f"slurm-{job_id}.out").read_text()
    (engines,) = records(run_dir, "engines", job_id)
    trainers = records(run_dir, "trainer", job_id)
    assert "omp=2" in engines and "nvls=0/1/1" in engines and "gpus=0,1" in engines and "DONE" in engines
    assert len(trainers) == 2 and all("omp=1" in t and "ntasks=2" in t for t in trainers)
    engine_node = re.search(r"node=(\S+)", engines).group(1)  # type: ignore[union-attr]
    assert all(f"node={engine_node} " not in t for t in trainers), "het groups run on their own nodes"
    assert (run_dir / "config.yaml").read_text() == dump_yaml(cfg)


def test_hostile_values_stay_text_in_a_real_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cfg = dataclasses.replace(make_config(), name=HOSTILE_NAME)
    script, run_dir = stub_script(tmp_path, cfg)
    job_id = sbatch(script)
    assert slurm_cluster.wait_done(job_id) == "COMPLETED", (tmp_path / f"slurm-{job_id}.out").read_text()
    (engines,) = records(run_dir, "engines", job_id)
    # Slurm cannot carry a newline in a job name: the directive has spaces there, nothing else changed.
    assert f"name={HOSTILE_NAME.replace(chr(10), ' ')}\n" in engines
    assert not list(tmp_path.rglob("PWNED*")), "a config value was executed"
    assert from_dict(RunConfig, load_yaml(run_dir / "config.yaml")).name == HOSTILE_NAME


def test_colocated_script_runs_both_roles_on_the_same_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cfg = make_config(
        {
            "slurm.colocate": True,
            "engine.num_engines": 2,
            "engine.device": "cuda",
            "train.device": "cuda",
            "slurm.trainer": {"tasks_per_node": 2, "gpus_per_task": 1, "cpus_per_task": 1},
        }
    )
    script, run_dir = stub_script(tmp_path, cfg)
    job_id = sbatch(script)
    assert slurm_cluster.wait_done(job_id) == "COMPLETED", (tmp_path / f"slurm-{job_id}.out").read_text()
    (engines,) = records(run_dir, "engines", job_id)
    trainers = records(run_dir, "trainer", job_id)
    node = re.search(r"node=(\S+)", engines).group(1)  # type: ignore[union-attr]
    assert len(trainers) == 2 and all(f"node={node} " in t and "gpus=0,1" in t for t in trainers)
    show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert "HetJobId" not in show, "colocated is one component"


def test_submit_through_submitit(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    from hpcrl.slurm.executor import submit_run

    cfg = make_config({"slurm.trainer.tasks_per_node": 2})
    job = submit_run(cfg, tmp_path / "run", role_command=STUB)
    outcome = job.result()
    assert outcome["run_dir"] == str(tmp_path / "run") and outcome["restart_count"] == 0
    # Not read at once: under load slurmdbd records the start late, and sacct said PENDING for a job whose
    # result was already back. What a user relies on is the state once the job is done.
    slurm_cluster.wait_done(job.job_id)
    assert job.watcher.get_state(job.job_id, mode="force") == "COMPLETED", "the watcher reads <id>+0"
    log = job.stdout() or ""
    assert "trainer step ended with status 0" in log and "Job completed successfully" in log
    assert len(records(tmp_path / "run", "trainer", job.job_id)) == 2


def test_submit_reports_a_failed_trainer_and_cancel_works(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    import submitit

    from hpcrl.slurm.executor import submit_run

    failing = submit_run(make_config({"slurm.env": {"STUB_TRAINER": "fail"}}), tmp_path / "a", role_command=STUB)
    blocking = submit_run(make_config({"slurm.env": {"STUB_TRAINER": "block"}}), tmp_path / "b", role_command=STUB)
    with pytest.raises(submitit.core.utils.UncompletedJobError, match="FAILED"):
        result(failing, slurm_cluster)
    (engines,) = records(tmp_path / "a", "engines", failing.job_id)
    assert "DONE" in engines, "the engines stop when the trainer failed"
    slurm_cluster.wait_state(blocking.job_id, ("RUNNING",), 30)
    blocking.cancel()
    assert slurm_cluster.wait_done(blocking.job_id) == "CANCELLED"


@pytest.mark.slow
def test_usr2_reaches_the_trainer_and_the_job_resumes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    from hpcrl.slurm.executor import submit_run

    cfg = make_config({"slurm.env": {"STUB_TRAINER": "preemptible"}, "slurm.trainer.tasks_per_node": 2})
    run_dir = tmp_path / "run"
    job = submit_run(cfg, run_dir, role_command=STUB)
    wait_for(lambda: len(records(run_dir, "trainer", job.job_id)) == 2, 30, "the trainer ranks to start")
    # What Slurm's --signal=B:USR2@N does at the time limit: a USR2 to the batch shell only.
    subprocess.run(["scancel", "--signal=USR2", "--batch", job.job_id], check=True)
    outcome = result(job, slurm_cluster)
    assert outcome["restart_count"] == 1
    first = records(run_dir, "trainer", job.job_id, 0)
    assert all("USR2" in r for r in first) and "REQUEUED" in first[0], first
    assert len(records(run_dir, "trainer", job.job_id, 1)) == 2
    assert "got SIGUSR2, forwarding it to the trainer step" in (job.stdout() or "")


@pytest.mark.slow
def test_partition_preemption_reaches_the_trainer_and_the_job_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    from hpcrl.slurm.executor import submit_run

    cfg = make_config({"slurm.env": {"STUB_TRAINER": "preemptible"}})
    run_dir = tmp_path / "run"
    job = submit_run(cfg, run_dir, role_command=STUB)
    wait_for(lambda: len(records(run_dir, "trainer", job.job_id)) == 1, 30, "the trainer to start")
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "-N", "3", "--exclusive", "-o", "/dev/null", "--wrap", "true"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert slurm_cluster.wait_done(urgent, 90) == "COMPLETED"
    outcome = result(job, slurm_cluster)
    assert outcome["restart_count"] >= 1
    assert "USR2" in records(run_dir, "trainer", job.job_id, 0)[0]


# --------------------------------------------------------------------------------------------------
# The real roles (`hpcrl role engines|trainer`) end to end


@pytest.fixture(scope="module")
def reference_run(slurm_cluster: SlurmCluster, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """(a) the quickstart as a het job, uninterrupted: engines on one node, the trainer on another."""
    from hpcrl.slurm.executor import submit_run

    run_dir = tmp_path_factory.mktemp("slurm-real") / "reference"
    job = submit_run(real_config(tiny_model_dir), run_dir)
    try:
        outcome = result(job, slurm_cluster, 300)
    except Exception:
        pytest.fail(f"the reference job failed:\n{job.stdout()}")
    assert outcome["final_model"]
    return run_dir


@pytest.mark.slow
def test_real_roles_quickstart_het_job_completes(reference_run: Path) -> None:
    events = check_metrics(reference_run, NUM_REAL_STEPS)
    assert not [e for e in events if e["kind"] == "preempted"]


@pytest.mark.slow
def test_real_roles_generated_script_runs_with_plain_sbatch(
    slurm_cluster: SlurmCluster, tiny_model_dir: Path, reference_run: Path, tmp_path: Path
) -> None:
    """(c) `hpcrl sbatch` -> plain `sbatch`: the script alone (no pickle, no config file) runs the quickstart."""
    import torch

    config = tmp_path / "e2e.yaml"
    config.write_text(dump_yaml(real_config(tiny_model_dir)))
    script, run_dir = tmp_path / "e2e.sbatch", tmp_path / "run"
    assert main(["sbatch", str(config), "-o", str(script), "--run-dir", str(run_dir)]) == 0
    config.unlink()
    job_id = sbatch(script)
    assert slurm_cluster.wait_done(job_id, 300) == "COMPLETED", (tmp_path / f"slurm-{job_id}.out").read_text()
    check_metrics(run_dir, NUM_REAL_STEPS)
    reference, result_weights = final_weights(reference_run), final_weights(run_dir)
    assert all(torch.equal(reference[k], result_weights[k]) for k in reference)


@pytest.mark.slow
def test_real_roles_requeued_twice_matches_the_uninterrupted_run(
    slurm_cluster: SlurmCluster, tiny_model_dir: Path, reference_run: Path, tmp_path: Path
) -> None:
    """(b) `scontrol requeue`, then a USR2 to the batch shell: same final weights, every row once."""
    import torch

    from hpcrl.slurm.executor import submit_run

    run_dir = tmp_path / "requeued"
    job = submit_run(real_config(tiny_model_dir), run_dir)
    wait_for(lambda: progress(run_dir) >= 2, 300, "step 2")
    subprocess.run(["scontrol", "requeue", job.job_id], check=True)
    wait_for(lambda: slurm_cluster.restart_count(job.job_id) >= 1, 60, "the first requeue")
    resumed_at = progress_now(run_dir)
    wait_for(lambda: progress(run_dir) >= resumed_at + 2, 300, "two steps after the first requeue")
    subprocess.run(["scancel", "--signal=USR2", "--batch", job.job_id], check=True)
    outcome = result(job, slurm_cluster, 300)
    assert outcome["restart_count"] == 2 and outcome["final_model"]
    events = check_metrics(run_dir, NUM_REAL_STEPS)
    assert len([e for e in events if e["kind"] == "preempted"]) == 2, events
    reference, resumed = final_weights(reference_run), final_weights(run_dir)
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference), "final weights differ from the reference"


@pytest.mark.slow
def test_real_roles_partition_preemption_requeues_and_resumes(
    slurm_cluster: SlurmCluster, tiny_model_dir: Path, reference_run: Path, tmp_path: Path
) -> None:
    """(d) a job in the higher-priority partition takes the nodes; the run comes back and finishes."""
    import torch

    from hpcrl.slurm.executor import submit_run

    run_dir = tmp_path / "preempted"
    job = submit_run(real_config(tiny_model_dir), run_dir)
    wait_for(lambda: progress(run_dir) >= 2, 300, "step 2")
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "-N", "3", "--exclusive", "-o", "/dev/null", "--wrap", "true"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert slurm_cluster.wait_done(urgent, 120) == "COMPLETED"
    outcome = result(job, slurm_cluster, 300)
    assert outcome["restart_count"] >= 1 and outcome["final_model"]
    events = check_metrics(run_dir, NUM_REAL_STEPS)
    assert [e for e in events if e["kind"] == "preempted"], events
    reference, resumed = final_weights(reference_run), final_weights(run_dir)
    assert all(torch.equal(reference[k], resumed[k]) for k in reference), "final weights differ from the reference"


@pytest.mark.slow
def test_real_roles_async_requeued_at_random_points_keeps_the_prompt_ledger(
    slurm_cluster: SlurmCluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An async run (engines generating while the trainer trains) requeued twice at random steps;
    every prompt drawn is trained exactly once or dropped with a recorded reason (docs/async.md)."""
    import json
    import random

    from hpcrl.rollout.ledger import ledger_problems
    from hpcrl.slurm.executor import submit_run

    run_dir = tmp_path / "async"
    cfg = real_config(tiny_model_dir, **{"rollout.mode": "async", "buffer.max_staleness": 2})
    job = submit_run(cfg, run_dir)
    rng = random.Random()
    running = lambda: slurm_cluster.job_state(job.job_id) == "RUNNING"  # noqa: E731
    for restart in (1, 2):
        # A requeued job's dying incarnation can log steps while Slurm holds the job pending, and Slurm refuses to
        # requeue a pending job ("Job is pending execution"): count steps from, and requeue, a running one.
        wait_for(running, 300, f"the job running before requeue {restart}")
        at = progress_now(run_dir) + rng.randint(1, 20)
        wait_for(lambda at=at: progress(run_dir) >= at, 300, f"step {at}")
        wait_for(running, 120, f"the job running at requeue {restart}")
        subprocess.run(["scontrol", "requeue", job.job_id], check=True)
        wait_for(lambda r=restart: slurm_cluster.restart_count(job.job_id) >= r, 60, f"requeue {restart}")
    outcome = result(job, slurm_cluster, 300)
    assert outcome["restart_count"] == 2 and outcome["final_model"]
    check_metrics(run_dir, NUM_REAL_STEPS)
    ledger = json.loads((run_dir / "prompt_ledger.json").read_text())
    assert ledger_problems(ledger, num_drawn=ledger["next_position"], prompts_per_step=4) == []
    assert sorted({s for s in ledger["step"] if s is not None}) == list(range(NUM_REAL_STEPS))
