"""The `slurm` section of a run config: where the engines and the trainer run when submitted to Slurm.

A run is one Slurm job: het group 0 holds the engines, het group 1 the trainer ranks, so that both get
nodes of their own shape under one job id; with `colocate: true` it is one component whose nodes run
both (the `trainer` group sizes it). `hpcrl submit` and `hpcrl sbatch` render it (hpcrl/slurm/render.py).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, fields

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
    "output": "nothing: hpcrl names the job log itself (hpcrl submit prints where)",
    "error": "nothing: hpcrl names the job log itself (hpcrl submit prints where)",
    "open-mode": "nothing: the job log is appended to, so a requeued job keeps the earlier attempts' lines",
    "array": "nothing: Slurm has no arrays of heterogeneous jobs; submit one job per run",
}

_TIME_FORMS = "M, M:S, H:M:S, D-H, D-H:M or D-H:M:S (e.g. 90, 01:30:00, 2-00:00:00)"
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MPI_PLUGIN_RE = re.compile(r"^[A-Za-z0-9_]+$")


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
class SlurmConfig:
    """How `hpcrl submit` / `hpcrl sbatch` ask Slurm for the run's nodes."""

    job_name: str = ""
    """Empty: the run's `name`."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
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
    """Shell lines run in the batch shell before the steps start (e.g. `module load cuda/12.4`). These are
    shell code on purpose, unlike every other value here, which the script quotes."""
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
        for name in ("partition", "account", "qos", "constraint"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name} is empty; leave it out (null) for the cluster's default")
        normalize_sbatch_options(self.extra_sbatch, "extra_sbatch")
        if not _MPI_PLUGIN_RE.match(self.mpi):
            raise ValueError(f"mpi {self.mpi!r} is not an srun MPI plugin name (`srun --mpi=list`), e.g. pmix")
        for name in self.env:
            if not _ENV_NAME_RE.match(name):
                raise ValueError(
                    f"env: {name!r} is not a variable name (letters, digits, _; not starting with a digit)"
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
