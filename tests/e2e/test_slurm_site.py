"""A site's Slurm settings in a real job on tools/slurm-dev's cluster: the job log where slurm.log_dir says, the
modules loaded before the Python environment, a script submitted from another directory.

The cluster has no environment modules: a `module` command on PATH stands in for Lmod's shell function (sbatch
exports the submitting shell's PATH to the job) and records what it was asked to load.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpcrl.slurm.render import render_script
from tests.support import STUB, SlurmCluster, make_config, records

pytestmark = pytest.mark.slurm

MODULE_STUB = """#!/bin/bash
# `module load A B`: records the call; a module named `missing` is not found, as Lmod says it.
echo "module $*" >> "$MODULE_RECORD"
if [ "$1" = load ]; then
  for name in "${@:2}"; do
    if [ "$name" = missing ]; then
      echo "Lmod has detected the following error: The module missing is unknown" >&2
      exit 1
    fi
  done
fi
"""


def submit_from_elsewhere(tmp_path: Path, overrides: dict[str, object]) -> tuple[str, Path, Path]:
    """Render into tmp_path/base (the job's directory), submit from /: (job id, run dir, job log dir)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "module").write_text(MODULE_STUB)
    (bin_dir / "module").chmod(0o755)
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    cfg = make_config({"slurm.log_dir": "job-logs", **overrides})
    (base / "job-logs").mkdir(exist_ok=True)  # what hpcrl sbatch does: Slurm does not create it
    script = tmp_path / "scripts" / "job.sbatch"
    script.parent.mkdir(exist_ok=True)
    script.write_text(render_script(cfg, "run", base_dir=str(base), role_command=STUB))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MODULE_RECORD": str(tmp_path / "modules.txt")}
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, cwd="/", env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0], base / "run", base / "job-logs"


def test_job_log_in_log_dir_and_modules_before_the_environment(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    setup = 'echo "setup after modules: $(tr "\\n" " " < "$MODULE_RECORD")"'
    job_id, run_dir, log_dir = submit_from_elsewhere(
        tmp_path, {"slurm.modules": ["cuda/12.4", "gcc/13"], "slurm.setup": [setup], "slurm.job_name": "site"}
    )
    state = slurm_cluster.wait_done(job_id)
    log = log_dir / f"site-{job_id}.out"
    assert log.is_file(), f"no job log in {log_dir}: {sorted(p.name for p in log_dir.iterdir())}"
    text = log.read_text()
    assert state == "COMPLETED", text
    assert "setup after modules: module load cuda/12.4 gcc/13" in text
    assert f"run dir {run_dir}" in text  # the script's paths are absolute: submitted from /, it ran in base/
    (engines,) = records(run_dir, "engines", job_id)
    assert "DONE" in engines
    assert not Path(f"/slurm-{job_id}.out").exists()


def test_a_module_that_does_not_load_stops_the_job_with_the_reason(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id, run_dir, log_dir = submit_from_elsewhere(
        tmp_path, {"slurm.modules": ["missing"], "slurm.job_name": "nomod"}
    )
    assert slurm_cluster.wait_done(job_id) == "FAILED"
    text = (log_dir / f"nomod-{job_id}.out").read_text()
    assert "The module missing is unknown" in text and "hpcrl: module load missing failed" in text
    assert not (run_dir / "stub").exists(), "no step starts after a module failed to load"
