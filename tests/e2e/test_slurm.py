"""Slurm jobs of a run: rendering and quoting (fast, no cluster), then real jobs on tools/slurm-dev's cluster.

    pytest tests/e2e/test_slurm.py                    # starts the cluster when it is not up (root)
    HPCRL_UPDATE_GOLDEN=1 pytest tests/e2e/test_slurm.py -k golden   # accept new golden scripts

The cluster tests replace `hpcrl role` by tests/e2e/stub_role.sh (same contract, milliseconds), so that
they test the job's shape, quoting and signal flow; `test_real_roles_*` run the real roles end to end.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpcrl.cli import main
from hpcrl.config import ConfigError, dump_yaml, from_dict, load_yaml
from hpcrl.run_config import RunConfig
from hpcrl.slurm.cli import render_sbatch, sbatch_command_line
from hpcrl.slurm.render import _config_heredoc, check_placement, directive_value, render_script
from tests.e2e.conftest import REPO, SlurmCluster

GOLDEN = REPO / "tests" / "golden"
STUB = str(REPO / "tests" / "e2e" / "stub_role.sh")
HOSTILE_NAME = "rl $(touch PWNED) `touch PWNED2` \"dq\" 'sq' #hash \\back\nHPCRL_CONFIG_EOF\n; rm -rf x"


def make_config(overrides: dict[str, Any] | None = None, *, model_path: str = "/models/tiny") -> RunConfig:
    """A RunConfig from a plain dict: the settings each test names, defaults for the rest."""
    data: dict[str, Any] = {"name": "t", "model": {"path": model_path}}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return from_dict(RunConfig, data)


GOLDEN_CONFIGS = {
    "disaggregated": {
        "name": "golden",
        "engine.num_engines": 4,
        "engine.device": "cuda",
        "train.device": "cuda",
        "slurm.partition": "gpu",
        "slurm.account": "rl-team",
        "slurm.qos": "high",
        "slurm.constraint": "h100&ib",
        "slurm.time_limit": "04:00:00",
        "slurm.signal_delay_s": 300,
        "slurm.engines": {"nodes": 2, "gpus_per_node": 4, "gpus_per_engine": 2, "cpus_per_task": 8, "mem_gb": 200},
        "slurm.engines.extra_sbatch": {"exclusive": ""},
        "slurm.trainer": {"nodes": 2, "tasks_per_node": 4, "gpus_per_task": 1, "cpus_per_task": 16, "mem_gb": 400},
        "slurm.extra_sbatch": {"mail_type": "END", "mail-user": "rl@example.org"},
        "slurm.python": "/opt/venvs/hpcrl/bin/python",
        "slurm.setup": ["module load cuda/12.4"],
        "slurm.env": {"NCCL_DEBUG": "WARN"},
    },
    "colocated": {
        "name": "golden-colocated",
        "engine.num_engines": 4,
        "engine.device": "cuda",
        "train.device": "cuda",
        "slurm.colocate": True,
        "slurm.requeue": False,
        "slurm.time_limit": "2-00:00:00",
        "slurm.engines.gpus_per_engine": 2,
        "slurm.engines.cpus_per_task": 4,
        "slurm.trainer": {"nodes": 1, "tasks_per_node": 8, "gpus_per_task": 1, "cpus_per_task": 12, "mem_gb": 1.5},
    },
}


def _mask_config(text: str) -> str:
    # The embedded config lists every component's fields: the goldens pin the job's shape, not those.
    return re.sub(
        r"(<<'HPCRL_CONFIG_EOF'[^\n]*\n).*?\n(HPCRL_CONFIG_EOF\n)",
        r"\1(the run's config.yaml: masked in the golden file)\n\2",
        text,
        flags=re.S,
    )


# --------------------------------------------------------------------------------------------------
# Fast: rendering, quoting, validation


@pytest.mark.parametrize("kind", sorted(GOLDEN_CONFIGS))
def test_golden_sbatch(kind: str) -> None:
    cfg = make_config(GOLDEN_CONFIGS[kind], model_path="/models/qwen3-8b")
    text = _mask_config(render_script(cfg, f"runs/{cfg.name}", command_line=["hpcrl", "sbatch", f"{kind}.yaml"]))
    path = GOLDEN / f"sbatch_{kind}.sbatch"
    if os.environ.get("HPCRL_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; create it: HPCRL_UPDATE_GOLDEN=1 pytest {__file__} -k golden"
    assert text == path.read_text(), (
        f"the rendered {kind} script differs from {path}; if the change is intended, refresh it: "
        f"HPCRL_UPDATE_GOLDEN=1 pytest tests/e2e/test_slurm.py -k golden (and review the diff)"
    )


def test_sbatch_dir_holds_every_experiment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the scripts name paths relative to the repository root, as users run them
    stale, experiments = [], sorted(Path("experiments").glob("*.yaml"))
    for config in experiments:
        out = f"sbatch/{config.stem}.sbatch"
        expected = render_sbatch(str(config), [], out, None)
        if not Path(out).exists() or Path(out).read_text() != expected:
            stale.append(shlex.join(sbatch_command_line(str(config), [], out, None)))
    orphans = sorted({p.stem for p in Path("sbatch").glob("*.sbatch")} - {c.stem for c in experiments})
    assert not stale, "sbatch/ is stale for some experiments; refresh with:\n  " + "\n  ".join(stale)
    assert not orphans, f"sbatch/ has scripts without an experiments/*.yaml: {orphans}; delete them"


def test_config_round_trips_through_the_script_and_values_stay_text(tmp_path: Path) -> None:
    cfg = dataclasses.replace(make_config(), name=HOSTILE_NAME)
    text = render_script(cfg, str(tmp_path / "run dir $(x)"), role_command=STUB)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    directive = next(line for line in text.splitlines() if line.startswith("#SBATCH --job-name="))
    assert "\n" not in directive and directive.endswith('"')
    # The body names RUN_DIR once, shell-quoted; the config is in a quoted heredoc.
    assert "RUN_DIR='" in text and "<<'HPCRL_CONFIG_EOF'" in text
    heredoc = text.split("<<'HPCRL_CONFIG_EOF' || exit 1\n", 1)[1].split("\nHPCRL_CONFIG_EOF\n", 1)[0]
    (tmp_path / "embedded.yaml").write_text("\n".join(line[1:] for line in heredoc.split("\n")))
    assert from_dict(RunConfig, load_yaml(tmp_path / "embedded.yaml")) == cfg


def test_embedded_config_has_no_empty_line_and_cannot_end_the_heredoc() -> None:
    # sbatch drops the empty lines of a het job's script (Slurm 22.05): a multi-line string would change.
    lines = _config_heredoc("name: 'a\n\n  HPCRL_CONFIG_EOF\n\n  b'\nseed: 0\n")
    body = lines[lines.index(next(line for line in lines if "<<'" in line)) + 1 : lines.index("HPCRL_CONFIG_EOF")]
    assert body == ["|name: 'a", "|", "|  HPCRL_CONFIG_EOF", "|", "|  b'", "|seed: 0"]


@pytest.mark.parametrize(
    ("value", "rendered"),
    [
        ("quickstart", "quickstart"),
        ("01:00:00", "01:00:00"),
        ("a b", '"a b"'),
        ('say "hi" #1', '"say \\"hi\\" #1"'),
        ("back\\slash", '"back\\\\slash"'),
        ("two\nlines", '"two lines"'),
    ],
)
def test_directive_values_are_quoted_for_sbatch(value: str, rendered: str) -> None:
    assert directive_value(value) == rendered


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"slurm.extra_sbatch": {"mial-type": "END"}}, "did you mean 'mail-type'"),
        ({"slurm.extra_sbatch": {"partition": "gpu"}}, "set slurm.partition instead"),
        ({"slurm.trainer.extra_sbatch": {"gpus-per-task": 1}}, "slurm.trainer.gpus_per_task"),
        ({"slurm.time_limit": "1h"}, "not a Slurm time"),
        ({"slurm.time_limit": "00:01:00", "slurm.signal_delay_s": 120}, "lower signal_delay_s"),
        ({"slurm.engines.gpus_per_node": 4, "slurm.engines.gpus_per_engine": 3}, "multiple of gpus_per_engine"),
        ({"slurm.partition": " "}, "partition is empty"),
        ({"slurm.env": {"1BAD": "x"}}, "not a variable name"),
    ],
)
def test_invalid_slurm_sections_name_the_fix(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(overrides)


def test_placement_checks() -> None:
    gpu = {"engine.device": "cuda", "train.device": "cuda", "slurm.trainer.gpus_per_task": 1}
    cfg = make_config(gpu | {"slurm.engines.gpus_per_node": 8, "slurm.engines.gpus_per_engine": 2})
    with pytest.raises(ConfigError, match=r"set engine.num_engines=4"):
        check_placement(cfg)
    assert check_placement(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, num_engines=4))) == []
    with pytest.raises(ConfigError, match="gpus_per_task=0"):
        check_placement(make_config({"train.device": "cuda"}))
    with pytest.raises(ConfigError, match="set slurm.engines.gpus_per_node"):
        check_placement(make_config({"engine.device": "cuda"}))
    notes = check_placement(make_config({"slurm.colocate": True, "slurm.engines.nodes": 3, "train.num_ranks": 2}))
    assert any("engines.nodes have no effect" in n for n in notes)
    assert any("train.num_ranks=2 has no effect" in n for n in notes)


def test_cli_sbatch_dry_run_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(REPO / "experiments" / "quickstart.yaml")
    assert main(["sbatch", config, "slurm.trainer.tasks_per_node=2", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash") and "#SBATCH hetjob" in out and "dry run: the script is valid" in err
    target = tmp_path / "sub" / "q.sbatch"
    assert main(["sbatch", config, "-o", str(target), "--run-dir", "runs/x"]) == 0
    assert target.stat().st_mode & 0o111 and "RUN_DIR=runs/x" in target.read_text()
    assert main(["sbatch", config, "slurm.extra_sbatch.nodez=1", "--dry-run"]) == 2
    assert "unknown sbatch option 'nodez'" in capsys.readouterr().err


def test_doctor_reports_and_passes_for_local_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--run-dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    for name in ("python", "torch", "run dir", "slurm", "mpi4py", "nvml", "sglang", "megatron-core"):
        assert re.search(rf"^  (ok  |miss|FAIL)  {re.escape(name)}\b", out, re.M), (name, out)
    assert "ready for local runs" in out


def test_doctor_fails_on_an_unwritable_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["doctor", "--run-dir", str(blocker / "runs")]) == 1
    assert "FAIL  run dir" in capsys.readouterr().out


def test_submit_refuses_a_run_dir_of_another_run(tmp_path: Path) -> None:
    from hpcrl.slurm.executor import write_run_config

    write_run_config(make_config(), tmp_path)
    # Extending a run and changing its Slurm shape are resumes of the same run.
    longer = make_config({"num_steps": 50, "slurm.time_limit": "12:00:00"})
    write_run_config(longer, tmp_path)
    assert from_dict(RunConfig, load_yaml(tmp_path / "config.yaml")) == longer
    with pytest.raises(ConfigError, match="holds a run with a different config"):
        write_run_config(make_config({"train.lr": 0.5}), tmp_path)


def test_watcher_reads_het_jobs_from_component_zero() -> None:
    from hpcrl.slurm.executor import HetSlurmInfoWatcher

    sacct = "JobID|State|NodeList\n12+0|RUNNING|n1\n12+0.batch|RUNNING|n1\n12+1|RUNNING|n2\n13|PENDING|None\n"
    info = HetSlurmInfoWatcher().read_info(sacct)
    assert info["12"]["State"] == "RUNNING" and info["13"]["State"] == "PENDING"


# --------------------------------------------------------------------------------------------------
# A real cluster: plain and het jobs, generated scripts with the stub roles


def sbatch(script: Path) -> str:
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, cwd=script.parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def records(run_dir: Path, role: str, job_id: str, restart: int = 0) -> list[str]:
    return [p.read_text() for p in sorted((run_dir / "stub").glob(f"{role}-{job_id}-{restart}-*.txt"))]


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
    _wait_for(lambda: set(slurm_cluster.states(job_id)) == components, 30, f"sacct to list {components}")
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
    assert job.watcher.get_state(job.job_id, mode="force") in ("COMPLETED", "COMPLETING", "RUNNING")
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
    _wait_for(lambda: len(records(run_dir, "trainer", job.job_id)) == 2, 30, "the trainer ranks to start")
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
    _wait_for(lambda: len(records(run_dir, "trainer", job.job_id)) == 1, 30, "the trainer to start")
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


def result(job: Any, cluster: SlurmCluster, timeout_s: float = 120) -> Any:
    """job.result(), after sacct says the job ended (submitit's own polling backs off to minutes)."""
    cluster.wait_done(job.job_id, timeout_s)
    job.done(force_check=True)
    return job.result()


def _wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------------
# The real roles (`hpcrl role engines|trainer`) end to end: issue 4's (a), (b), (d)


NUM_REAL_STEPS = 120
"""Enough steps (~0.05 s each once running) that the tests interrupt a run in its middle twice, not after its end."""


def real_config(model_dir: Path, **overrides: Any) -> RunConfig:
    """The quickstart, small: a tiny model, 20 SFT steps, NUM_REAL_STEPS GRPO steps, a checkpoint every step."""
    base: dict[str, Any] = {
        "name": "e2e-quickstart",
        "num_steps": NUM_REAL_STEPS,
        "data.digits": 1,
        "data.num_examples": 200,
        "data.prompts_per_step": 4,
        "sft": {"num_steps": 20, "batch_size": 16, "lr": 3e-3, "log_every_steps": 10},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 4},
        "reward.fn": "arithmetic_answer",
        "train": {"lr": 5e-4, "micro_batch_size": 16},
        "checkpoint.every_steps": 1,
        "slurm.python": sys.executable,
        "slurm.time_limit": "00:20:00",
    }
    return make_config(base | overrides, model_path=str(model_dir))


def _progress(run_dir: Path) -> int:
    """GRPO steps the run has logged (0 before the metrics file exists)."""
    from hpcrl.store import load_metrics
    from hpcrl.store.metrics import StoreError

    if not (run_dir / "metrics.h5").exists():
        return 0
    try:
        return len(load_metrics(run_dir / "metrics.h5").get("step", []))
    except (OSError, StoreError):  # the writer is creating it
        return 0


def _final_weights(run_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in sorted((run_dir / "model").glob("*.safetensors")):
        tensors |= load_file(path)
    assert tensors, f"no final model in {run_dir / 'model'}"
    return tensors


def _check_metrics(run_dir: Path, num_steps: int) -> list[dict[str, Any]]:
    from hpcrl.store import load_events, load_metrics

    steps = list(load_metrics(run_dir / "metrics.h5")["step"])
    assert steps == sorted(set(steps)) and len(steps) == num_steps, f"missing or duplicated rows: {steps}"
    return load_events(run_dir / "metrics.h5")


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
    events = _check_metrics(reference_run, NUM_REAL_STEPS)
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
    _check_metrics(run_dir, NUM_REAL_STEPS)
    reference, result_weights = _final_weights(reference_run), _final_weights(run_dir)
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
    _wait_for(lambda: _progress(run_dir) >= 2, 300, "step 2")
    subprocess.run(["scontrol", "requeue", job.job_id], check=True)
    _wait_for(lambda: slurm_cluster.restart_count(job.job_id) >= 1, 60, "the first requeue")
    resumed_at = _progress(run_dir)
    _wait_for(lambda: _progress(run_dir) >= resumed_at + 2, 300, "two steps after the first requeue")
    subprocess.run(["scancel", "--signal=USR2", "--batch", job.job_id], check=True)
    outcome = result(job, slurm_cluster, 300)
    assert outcome["restart_count"] == 2 and outcome["final_model"]
    events = _check_metrics(run_dir, NUM_REAL_STEPS)
    assert len([e for e in events if e["kind"] == "preempted"]) == 2, events
    reference, resumed = _final_weights(reference_run), _final_weights(run_dir)
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
    _wait_for(lambda: _progress(run_dir) >= 2, 300, "step 2")
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "-N", "3", "--exclusive", "-o", "/dev/null", "--wrap", "true"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert slurm_cluster.wait_done(urgent, 120) == "COMPLETED"
    outcome = result(job, slurm_cluster, 300)
    assert outcome["restart_count"] >= 1 and outcome["final_model"]
    events = _check_metrics(run_dir, NUM_REAL_STEPS)
    assert [e for e in events if e["kind"] == "preempted"], events
    reference, resumed = _final_weights(reference_run), _final_weights(run_dir)
    assert all(torch.equal(reference[k], resumed[k]) for k in reference), "final weights differ from the reference"
