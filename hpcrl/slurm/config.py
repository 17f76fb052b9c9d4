"""The `slurm` section of a run config: where the engines and the trainer run when submitted to Slurm.

A run is one Slurm job: het group 0 holds the engines, het group 1 the trainer ranks, so that both get
nodes of their own shape under one job id; with `colocate: true` it is one component whose nodes run
both (the `trainer` group sizes it). `hpcrl submit` and `hpcrl sbatch` render it (hpcrl/slurm/render.py).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, fields
from typing import Literal

# sbatch 22.05's long options (`sbatch --help` plus the ones only in its man page). extra_sbatch keys are
# checked against them so that a typo fails at submission with the close match, not in the queue.
KNOWN_SBATCH_OPTIONS = frozenset(
    """account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint container
    contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency
    distribution error exclude exclusive export export-file extra-node-info get-user-env gid gpu-bind gpu-freq gpus
    gpus-per-node gpus-per-socket gpus-per-task gres gres-flags hint hold ignore-pbs input job-name
    kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus network
    nice no-kill no-requeue nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node
    ntasks-per-socket open-mode output overcommit oversubscribe partition power priority profile propagate qos
    reboot requeue reservation signal sockets-per-node spread-job switches thread-spec threads-per-core time time-min
    tmp uid use-min-nodes wait-all-nodes wckey""".split()
)

# Options hpcrl sets itself: in extra_sbatch they would contradict a typed field, so they point at it.
OWNED_SBATCH_OPTIONS = {
    "job-name": "slurm.job_name",
    "partition": "slurm.partition",
    "account": "slurm.account",
    "qos": "slurm.qos",
    "constraint": "slurm.constraint",
    "reservation": "slurm.reservation",
    "gres": "slurm.gpu_type (with slurm.engines.gpus_per_node / slurm.trainer.gpus_per_task)",
    "chdir": "nothing: the job runs in the directory the script was rendered in (hpcrl sbatch --base-dir)",
    "time": "slurm.time_limit",
    "signal": "slurm.signal_delay_s",
    "requeue": "slurm.requeue",
    "no-requeue": "slurm.requeue",
    "nodes": "slurm.engines.nodes / slurm.trainer.nodes",
    "ntasks": "slurm.trainer.nodes and slurm.trainer.tasks_per_node",
    "ntasks-per-node": "slurm.trainer.tasks_per_node",
    "cpus-per-task": "slurm.engines.cpus_per_task / slurm.trainer.cpus_per_task",
    "gpus": "slurm.engines.gpus_per_node / slurm.trainer.gpus_per_task",
    "gpus-per-node": "slurm.engines.gpus_per_node / slurm.trainer.gpus_per_task",
    "gpus-per-task": "slurm.trainer.gpus_per_task",
    "mem": "slurm.engines.mem_gb / slurm.trainer.mem_gb",
    "output": "slurm.log_dir (the job log is LOG_DIR/<job name>-<job id>.out)",
    "error": "slurm.log_dir (the job log holds stdout and stderr)",
    "open-mode": "nothing: the job log is appended to, so a requeued job keeps the earlier attempts' lines",
    "array": "nothing: Slurm has no arrays of heterogeneous jobs; submit one job per run",
}

_TIME_FORMS = "M, M:S, H:M:S, D-H, D-H:M or D-H:M:S (e.g. 90, 01:30:00, 2-00:00:00)"
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MPI_PLUGIN_RE = re.compile(r"^[A-Za-z0-9_]+$")
_GPU_TYPE_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_MODULE_RE = re.compile(r"^[A-Za-z0-9_.+/@:-]+$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def time_limit_seconds(text: str) -> int:
    """Seconds of a Slurm time limit (`--time` syntax); ValueError naming the accepted forms otherwise."""
    match = _TIME_RE.match(text.strip())
    if not match:
        raise ValueError(f"time_limit {text!r} is not a Slurm time; use {_TIME_FORMS}")
    days, first, second, third = match.groups()
    if days is not None:
        # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        total = ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    elif third is not None:
        total = (int(first) * 60 + int(second)) * 60 + int(third)  # H:M:S
    elif second is not None:
        total = int(first) * 60 + int(second)  # M:S
    else:
        total = int(first) * 60  # M
    if total <= 0:
        raise ValueError(f"time_limit {text!r} must be longer than 0; use {_TIME_FORMS}")
    return total


def normalize_sbatch_options(options: dict[str, str | int], where: str) -> dict[str, str]:
    """Check extra sbatch options (`mail_type` or `mail-type`) and return them as `{"mail-type": "END"}`."""
    result: dict[str, str] = {}
    for raw_key, value in options.items():
        key = raw_key.lstrip("-").replace("_", "-")
        if key in OWNED_SBATCH_OPTIONS:
            raise ValueError(f"{where}: '{raw_key}' is set by hpcrl; set {OWNED_SBATCH_OPTIONS[key]} instead")
        if key not in KNOWN_SBATCH_OPTIONS:
            close = difflib.get_close_matches(key, sorted(KNOWN_SBATCH_OPTIONS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(
                f"{where}: unknown sbatch option '{raw_key}'{hint}; use a long option of `sbatch --help` "
                "without its dashes, e.g. mail-type: END, or '' for a flag without a value"
            )
        result[key] = str(value)
    return result


@dataclass(kw_only=True, frozen=True)
class SlurmGroupConfig:
    """What one het group asks of Slurm per node and per task."""

    nodes: int = 1
    """Nodes of this het group."""
    cpus_per_task: int = 1
    """CPUs per task; also the OMP_NUM_THREADS of the group's processes."""
    mem_gb: float | None = None
    """Memory per node (`--mem`); null: the partition's default."""
    extra_sbatch: dict[str, str | int] = field(default_factory=dict)
    """More sbatch options for this het component only, e.g. {exclusive: '', nodelist: 'gpu[01-04]'}."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.cpus_per_task < 1:
            raise ValueError(f"cpus_per_task must be >= 1, got {self.cpus_per_task}")
        if self.mem_gb is not None and not self.mem_gb > 0:
            raise ValueError(f"mem_gb must be > 0 (or null for the partition's default), got {self.mem_gb}")
        normalize_sbatch_options(self.extra_sbatch, "extra_sbatch")


@dataclass(kw_only=True, frozen=True)
class EnginesGroupConfig(SlurmGroupConfig):
    """Het group 0: one task per node, which starts that node's engines."""

    gpus_per_node: int = 0
    """GPUs per engine node; 0 runs the engines on CPUs."""
    gpus_per_engine: int = 1
    """GPUs of one engine (its tensor-parallel size): a node runs gpus_per_node / gpus_per_engine engines."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0, got {self.gpus_per_node}")
        if self.gpus_per_engine < 1:
            raise ValueError(f"gpus_per_engine must be >= 1, got {self.gpus_per_engine}")
        if self.gpus_per_node and self.gpus_per_node % self.gpus_per_engine:
            raise ValueError(
                f"gpus_per_node={self.gpus_per_node} is not a multiple of gpus_per_engine={self.gpus_per_engine}: "
                "GPUs would sit idle; make gpus_per_node a multiple of gpus_per_engine"
            )


@dataclass(kw_only=True, frozen=True)
class TrainerGroupConfig(SlurmGroupConfig):
    """Het group 1: one task per trainer rank; rank 0 also drives the run."""

    tasks_per_node: int = 1
    """Trainer ranks per node."""
    gpus_per_task: int = 0
    """GPUs per rank. The node asks for tasks_per_node x gpus_per_task GPUs and every rank sees all of
    them (rank r uses its share from SLURM_LOCALID): NCCL's peer-to-peer paths need the GPUs visible, and
    colocated engines share them."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tasks_per_node < 1:
            raise ValueError(f"tasks_per_node must be >= 1, got {self.tasks_per_node}")
        if self.gpus_per_task < 0:
            raise ValueError(f"gpus_per_task must be >= 0, got {self.gpus_per_task}")

    @property
    def num_ranks(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def gpus_per_node(self) -> int:
        return self.tasks_per_node * self.gpus_per_task


@dataclass(kw_only=True, frozen=True)
class ContainerConfig:
    """The image every step runs in: Apptainer/Singularity (`apptainer exec`) or enroot through pyxis
    (`srun --container-image`). hpcrl must be installed in the image."""

    image: str
    """apptainer/singularity: a .sif file, or a docker://, oras:// or library:// reference; pyxis: a registry
    reference (nvcr.io#nvidia/pytorch:25.01-py3) or a .sqsh file. A file must exist when the script is rendered."""
    runtime: Literal["apptainer", "singularity", "pyxis"] = "apptainer"
    """`apptainer`/`singularity`: each step's command runs under `RUNTIME exec`; `pyxis`: each srun step gets
    `--container-image` (Slurm's pyxis plugin with enroot)."""
    binds: tuple[str, ...] = ()
    """More host paths to see in the container, `SRC[:DST[:ro]]` (apptainer --bind, pyxis --container-mounts).
    The run dir, the directory the script runs in and sync.delta_dir are bound without being listed."""

    def __post_init__(self) -> None:
        if not self.image.strip() or _CONTROL_RE.search(self.image):
            raise ValueError(
                f"image {self.image!r} is empty or has control characters; name the image file or reference"
            )
        for bind in self.binds:
            if not bind or "," in bind or _CONTROL_RE.search(bind) or bind.startswith(":"):
                raise ValueError(
                    f"binds: {bind!r} is not SRC[:DST[:ro]] (one path per entry, no commas), e.g. /scratch or "
                    "/data:/data:ro"
                )

    @property
    def is_file(self) -> bool:
        """Whether `image` names a file on this machine (not a registry reference)."""
        if self.runtime == "pyxis":
            return self.image.startswith(("/", "./", "../", "~")) or self.image.endswith(".sqsh")
        return "://" not in self.image


@dataclass(kw_only=True, frozen=True)
class SlurmConfig:
    """How `hpcrl submit` / `hpcrl sbatch` ask Slurm for the run's nodes."""

    job_name: str = ""
    """Empty: the run's `name`."""
    partition: str | None = None
    """The partition the job runs in (`--partition`); null: the cluster's default."""
    account: str | None = None
    """The account charged (`--account`); null: the user's default."""
    qos: str | None = None
    """The quality of service (`--qos`); null: the default."""
    constraint: str | None = None
    """Node features the job needs (`--constraint`, e.g. `a100&ib`); null: none."""
    reservation: str | None = None
    """A reservation the job runs in (`--reservation`); null: none."""
    exclusive: bool = False
    """`--exclusive` for every component: no other job shares the nodes."""
    gpu_type: str | None = None
    """A GPU type of the cluster's gres (`sinfo -o %G`, e.g. h100): GPUs are asked for as `--gres=gpu:TYPE:N`;
    null: `--gpus-per-node=N`, any type."""
    log_dir: str = ""
    """Directory of the job log (`LOG_DIR/<job name>-<job id>.out`: the batch shell and every step); relative paths
    start at the directory the script is rendered in, and `hpcrl sbatch`/`hpcrl submit` create it. Empty: `hpcrl
    sbatch`: Slurm's slurm-<job id>.out in that directory; `hpcrl submit`: RUN_DIR/slurm."""
    container: ContainerConfig | None = None
    """Run every step in this container image; null: on the nodes' own environment."""
    modules: tuple[str, ...] = ()
    """Environment modules loaded (`module load`) before anything else, the Python environment included."""
    time_limit: str = "01:00:00"
    """Slurm `--time`: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S."""
    signal_delay_s: int = 120
    """USR2 reaches the job this long before its time limit: the driver checkpoints and requeues."""
    requeue: bool = True
    """Ask for `--requeue`: a preempted job (or one whose time runs out) comes back and resumes."""
    colocate: bool = False
    """One component whose nodes run engines and trainer (sized by `trainer`); false: two het groups."""
    engines: EnginesGroupConfig = field(default_factory=EnginesGroupConfig)
    trainer: TrainerGroupConfig = field(default_factory=TrainerGroupConfig)
    extra_sbatch: dict[str, str | int] = field(default_factory=dict)
    """More sbatch options for the whole job (they go to the first component, where Slurm reads the
    job-wide ones), e.g. {mail-type: END, reservation: rl}. Unknown options are errors."""
    python: str = ""
    """The Python that runs hpcrl on the nodes: an interpreter path, or a venv's `bin/activate` to source.
    Empty: `hpcrl submit` uses the interpreter it runs in; a script of `hpcrl sbatch` uses the venv active
    when it is submitted ($VIRTUAL_ENV), else ./.venv, else python3."""
    setup: tuple[str, ...] = ()
    """Shell lines run in the batch shell after `modules` and before the Python environment is activated (e.g.
    `source /etc/profile.d/lmod.sh`). These are shell code on purpose, unlike every other value here, which the
    script quotes."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables exported to every step (values are quoted, never expanded)."""
    mpi: str = "pmix"
    """With sync.transport=mpi: srun's MPI plugin (`srun --mpi=NAME`) for the one step that runs the
    agents and the trainer ranks as one MPI world; `srun --mpi=list` shows the cluster's (pmix, pmix_v4,
    pmi2, ...). It must match the MPI that mpi4py uses (Open MPI 5: pmix)."""

    def __post_init__(self) -> None:
        limit_s = time_limit_seconds(self.time_limit)
        if not 1 <= self.signal_delay_s <= 65535:
            raise ValueError(f"signal_delay_s must be in [1, 65535] (Slurm's range), got {self.signal_delay_s}")
        if self.signal_delay_s >= limit_s:
            raise ValueError(
                f"signal_delay_s={self.signal_delay_s} is not shorter than time_limit={self.time_limit} "
                f"({limit_s} s): the USR2 would come at the start; lower signal_delay_s or raise time_limit"
            )
        for name in ("partition", "account", "qos", "constraint", "reservation"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name} is empty; leave it out (null) for the cluster's default")
        if self.gpu_type is not None and not _GPU_TYPE_RE.match(self.gpu_type):
            raise ValueError(
                f"gpu_type {self.gpu_type!r} is not a gres type name (letters, digits, _ . -; `sinfo -o %G` lists "
                "them, e.g. h100), or null for any GPU"
            )
        if _CONTROL_RE.search(self.log_dir):
            raise ValueError(f"log_dir {self.log_dir!r} has control characters (a newline?); use a plain path")
        for module in self.modules:
            if not _MODULE_RE.match(module):
                raise ValueError(
                    f"modules: {module!r} is not a module name (e.g. cuda/12.4 or gcc@13); one module per entry, "
                    "shell code goes in slurm.setup"
                )
        if self.container is not None and self.python.endswith("/activate"):
            raise ValueError(
                f"python={self.python!r} is an activate script, which the batch shell cannot source inside "
                f"a {self.container.runtime} container; name the container's interpreter (e.g. /opt/venv/bin/python), "
                "or leave it empty for the image's python3"
            )
        normalize_sbatch_options(self.extra_sbatch, "extra_sbatch")
        if not _MPI_PLUGIN_RE.match(self.mpi):
            raise ValueError(f"mpi {self.mpi!r} is not an srun MPI plugin name (`srun --mpi=list`), e.g. pmix")
        for name in self.env:
            if not _ENV_NAME_RE.match(name):
                raise ValueError(
                    f"env: {name!r} is not a variable name (letters, digits, _; not starting with a digit)"
                )
            if name == "HPCRL_ENGINE_API_KEY":
                # The values are written into the job script, which others can read; the run makes its engines'
                # keys itself.
                raise ValueError(
                    "env: HPCRL_ENGINE_API_KEY would be written into the job script, where other users can read "
                    "it; remove it: the run gives each engine a random key of its own"
                )

    @property
    def time_limit_s(self) -> int:
        return time_limit_seconds(self.time_limit)

    def ignored_engine_fields(self) -> list[str]:
        """The `engines` fields that have no effect because the run is colocated (for a warning)."""
        if not self.colocate:
            return []
        default = EnginesGroupConfig()
        used = {"cpus_per_task", "gpus_per_engine"}
        return [
            f"engines.{f.name}"
            for f in fields(EnginesGroupConfig)
            if f.name not in used and getattr(self.engines, f.name) != getattr(default, f.name)
        ]
