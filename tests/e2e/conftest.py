"""A real Slurm cluster on this host for the e2e tests (tools/slurm-dev/start.sh), started once per session.

It is skipped only where it cannot exist: not root, or Slurm not installed and no apt-get to install it.
HPCRL_REQUIRE_SLURM=1 (CI) turns that skip into a failure. A cluster that was already up (CI starts it
before pytest) is used and left running; one this session started is stopped at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import (
    REPO,
    SlurmCluster,
    skip_or_fail,
)

SLURM_DEV = REPO / "tools" / "slurm-dev"


def _installed() -> bool:
    return all(shutil.which(cmd) for cmd in ("slurmctld", "slurmd", "sbatch", "slurmdbd", "munged"))


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        skip_or_fail("the test cluster needs root (tools/slurm-dev/start.sh starts daemons and edits /etc/hosts)")
    if not _installed() and shutil.which("apt-get") is None:
        skip_or_fail("Slurm is not installed and there is no apt-get to install it (Debian: slurmctld slurmd ...)")
    prefix = Path(os.environ.get("SLURM_PREFIX") or Path(os.environ.get("TMPDIR", "/tmp")) / "hpcrl-slurm")
    conf = prefix / "etc" / "slurm.conf"
    os.environ["SLURM_CONF"] = str(conf)  # for sbatch/sacct here and in submitit, and the jobs' own srun
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True) if _installed() else None
    already_up = ping is not None and ping.returncode == 0 and "UP" in ping.stdout
    t0 = time.monotonic()
    out = subprocess.run([str(SLURM_DEV / "start.sh")], capture_output=True, text=True, timeout=600)
    start_s = 0.0 if already_up else time.monotonic() - t0
    if out.returncode != 0:
        pytest.fail(f"tools/slurm-dev/start.sh failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    print(out.stdout.strip().splitlines()[-1])
    yield SlurmCluster(prefix=prefix, conf=conf, start_s=start_s)
    if not already_up:
        subprocess.run([str(SLURM_DEV / "stop.sh")], capture_output=True, text=True, timeout=120)
