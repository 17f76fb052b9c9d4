"""`hpcrl submit`: the run as one Slurm job, submitted, watched and cancelled through submitit.

    hpcrl submit experiments/quickstart.yaml [key=value ...] [--run-dir DIR]

submitit has no heterogeneous jobs (facebookincubator/submitit#1741), so `HetSlurmExecutor` extends its
SlurmExecutor in the two places that need it and keeps the rest (pickle, sbatch call, job id, sacct
watcher, logs, cancel, result):
- the submission text: hpcrl's `#SBATCH` components (with `#SBATCH hetjob` between them, quoted for
  sbatch's parser, which submitit's shlex.quote is not) and hpcrl's batch body, then submitit's command;
- the watcher: sacct names a het job's components `<id>+0`, `<id>+1`; submitit looks for `<id>`.

The batch body (hpcrl/slurm/render.py, the same as in a standalone script) starts the role steps from
the batch shell, which is where Slurm's `--signal=B:USR2` lands and the only process that can start
steps in both het groups. submitit's own command runs last, in the batch shell (no srun): the pickled
`job_outcome` records the finished run, so `job.result()` returns once the run is done and raises when
the trainer failed (the body then exits before it, and sacct says FAILED).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from submitit.core import utils as submitit_utils
from submitit.slurm import slurm as submitit_slurm

from hpcrl.config import ConfigError, dump_yaml, from_dict, load_yaml
from hpcrl.run_config import RunConfig
from hpcrl.slurm.config import SlurmConfig
from hpcrl.slurm.render import (
    SbatchValue,
    batch_body,
    check_mpi_launch,
    check_placement,
    directive_lines,
    job_components,
    job_log_dir,
)

_HET_LEADER_RE = re.compile(r"(\d+)\+0")


class HetSlurmInfoWatcher(submitit_slurm.SlurmInfoWatcher):
    """Reads a het job's state from its component 0 (`<id>+0` in sacct)."""

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        info = super().read_info(string)
        for key in list(info):
            match = _HET_LEADER_RE.fullmatch(key)
            if match:
                info[match.group(1)] = info[key]
        return info


class HetSlurmJob(submitit_slurm.SlurmJob):
    watcher = HetSlurmInfoWatcher(delay_s=600)


class HetSlurmExecutor(submitit_slurm.SlurmExecutor):
    """A SlurmExecutor whose job has the given sbatch components and runs `body` before submitit's command."""

    job_class = HetSlurmJob

    def __init__(
        self,
        folder: str | Path,
        *,
        components: Sequence[Mapping[str, SbatchValue]],
        body: Sequence[str],
        python: str | None = None,
    ) -> None:
        super().__init__(folder, python=python)
        if not components:
            raise ValueError("a job needs at least one component")
        self.components = [dict(c) for c in components]
        self.body = list(body)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        # submitit's log name (<id>_0_log.out), so that job.stdout() finds it; stderr goes to the same file.
        log = str(submitit_utils.JobPaths(folder=self.folder).stdout).replace("%t", "0")
        components = [dict(self.components[0], output=log), *self.components[1:]]
        lines = ["#!/bin/bash", *directive_lines(components), "", *self.body, ""]
        lines += ["# ---- submitit: record the outcome for job.result()", "export SUBMITIT_EXECUTOR=slurm", command, ""]
        return "\n".join(lines)

    def _num_tasks(self) -> int:
        # submitit's command runs once, in the batch shell.
        return 1

    def _internal_process_submissions(self, delayed_submissions: list[submitit_utils.DelayedSubmission]) -> list[Any]:
        if len(delayed_submissions) > 1:
            raise ValueError("Slurm has no job arrays of heterogeneous jobs: submit one run at a time")
        return super()._internal_process_submissions(delayed_submissions)


def job_outcome(run_dir: str) -> dict[str, Any]:
    """Runs in the batch shell after the trainer step ended well: what `job.result()` returns."""
    return {
        "run_dir": run_dir,
        "job_id": os.environ.get("SLURM_JOB_ID", ""),
        "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        "final_model": (Path(run_dir) / "model").is_dir(),
    }


def write_run_config(cfg: RunConfig, run_dir: Path) -> None:
    """RUN_DIR/config.yaml, atomically; refuses a run dir that holds a different run (the job would fail)."""

    def comparable(c: RunConfig) -> str:
        # num_steps may grow (extending a run) and the slurm section may change (a longer time limit).
        return dump_yaml(dataclasses.replace(c, num_steps=0, slurm=SlurmConfig()))

    path = run_dir / "config.yaml"
    if path.exists():
        try:
            old = from_dict(RunConfig, load_yaml(path))
        except (ConfigError, TypeError) as exc:
            raise ConfigError(f"{path} is unreadable ({exc}); move the run directory aside or use --run-dir") from exc
        if comparable(old) != comparable(cfg):
            raise ConfigError(
                f"{run_dir} holds a run with a different config ({path}); resume it with the same config and "
                "overrides (num_steps and the slurm section may change), or start a new run with --run-dir"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".config.yaml.{os.getpid()}.tmp")
    tmp.write_text(dump_yaml(cfg))
    os.replace(tmp, path)


def submit_run(
    cfg: RunConfig,
    run_dir: str | Path,
    *,
    python: str | None = None,
    role_command: str | None = None,
) -> HetSlurmJob:
    """Write RUN_DIR/config.yaml and submit the run's job; the submitit job (state, logs, cancel, result).

    python: the nodes' interpreter (default: slurm.python, else this interpreter). role_command: replaces
    `python -m hpcrl.cli role` in the job (tests).
    """
    run_dir = Path(run_dir).absolute()
    check_placement(cfg)
    python = python or cfg.slurm.python or sys.executable
    if role_command is None:  # sync.transport=mpi: mpi4py on the nodes, srun's MPI plugin
        for note in check_mpi_launch(cfg, None if python.endswith("/activate") else python):
            warnings.warn(note, stacklevel=2)
    write_run_config(cfg, run_dir)
    log_dir = job_log_dir(cfg, os.getcwd())  # slurm.log_dir: submitit's folder (job log, pickles)
    executor = HetSlurmExecutor(
        Path(log_dir) if log_dir is not None else run_dir / "slurm",
        components=job_components(cfg),
        body=batch_body(cfg, str(run_dir), python=python, role_command=role_command),
        python=shlex.quote(python) if not python.endswith("/activate") else "python",
    )
    job = executor.submit(job_outcome, str(run_dir))
    assert isinstance(job, HetSlurmJob)  # HetSlurmExecutor.job_class
    return job
