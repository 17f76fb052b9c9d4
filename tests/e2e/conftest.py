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
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_DEV = REPO / "tools" / "slurm-dev"
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL")


@dataclass(frozen=True)
class SlurmCluster:
    prefix: Path
    conf: Path
    start_s: float
    """Seconds start.sh took (0 when the cluster was already up)."""

    def states(self, job_id: str) -> dict[str, str]:
        """{'12': 'RUNNING'} or, for a het job, {'12+0': ..., '12+1': ...}, from sacct (what submitit reads)."""
        out = subprocess.run(
            ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State"], capture_output=True, text=True, timeout=30
        )
        states = {}
        for line in out.stdout.splitlines():
            jid, _, state = line.partition("|")
            states[jid] = state.split()[0] if state else ""
        return states

    def wait_state(self, job_id: str, wanted: tuple[str, ...], timeout_s: float) -> str:
        """Poll until every component of the job is in one of `wanted`; the state, or fail with the job log."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.states(job_id)
            if states and all(s in wanted for s in states.values()):
                return next(iter(states.values()))
            time.sleep(0.5)
        show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        pytest.fail(f"job {job_id} not {wanted} after {timeout_s} s: {states}\n{show}")

    def wait_done(self, job_id: str, timeout_s: float = 60) -> str:
        return self.wait_state(job_id, TERMINAL_STATES, timeout_s)

    def restart_count(self, job_id: str) -> int:
        show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        for token in show.split():
            if token.startswith("Restarts="):
                return int(token.split("=", 1)[1])
        return 0


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("HPCRL_REQUIRE_SLURM") == "1":
        pytest.fail(f"HPCRL_REQUIRE_SLURM=1 but no Slurm cluster: {reason}")
    pytest.skip(reason)


def _installed() -> bool:
    return all(shutil.which(cmd) for cmd in ("slurmctld", "slurmd", "sbatch", "slurmdbd", "munged"))


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        _skip_or_fail("the test cluster needs root (tools/slurm-dev/start.sh starts daemons and edits /etc/hosts)")
    if not _installed() and shutil.which("apt-get") is None:
        _skip_or_fail("Slurm is not installed and there is no apt-get to install it (Debian: slurmctld slurmd ...)")
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
