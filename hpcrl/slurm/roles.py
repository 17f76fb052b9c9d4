"""What each task of a Slurm job runs: `hpcrl role engines` (het group 0) and `hpcrl role trainer` (het group 1).

    srun --het-group=0 --ntasks-per-node=1 hpcrl role engines --run-dir RUN_DIR &
    srun --het-group=1 hpcrl role trainer --run-dir RUN_DIR

Both read RUN_DIR/config.yaml (written at submission). The engines role starts its node's share of
the run's engines and lives until the driver writes the done marker of this job incarnation (or a
signal arrives). Trainer rank 0 runs the driver; other ranks follow it. Rendezvous: engines through
files in RUN_DIR/engines/, trainer ranks through MASTER_ADDR/MASTER_PORT derived from the step's first
node and the job id; both bounded by timeouts in the config.

With sync.transport=mpi the engines come from `hpcrl role mpi-agent` instead, in one MPI step with the
trainer ranks (they broadcast the weights to each other):

    srun --mpi=pmix --het-group=0 --ntasks-per-node=1 ... role mpi-agent : --het-group=1 ... role trainer
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from hpcrl import preemption
from hpcrl.engine.joined import SharedCheck
from hpcrl.engine.local import Incarnation, LocalEngines, done_marker
from hpcrl.model.prepare import prepare_model_dir
from hpcrl.run_config import RunConfig, load_run_config
from hpcrl.slurm.env import LaunchEnv
from hpcrl.weightwire.delta import DeltaDirNotShared


class RoleError(RuntimeError):
    pass


class Drive(Protocol):
    """The driver loop of trainer rank 0 (hpcrl/driver.py `run`)."""

    def __call__(self, cfg: RunConfig, run_dir: Path, *, slurm: LaunchEnv) -> int: ...


def _slurm_env() -> LaunchEnv:
    env = LaunchEnv.from_environ()
    if env is None:
        raise RoleError("`hpcrl role` runs inside a Slurm job step (srun); for a local run use `hpcrl run CONFIG`")
    return env


def _config(run_dir: Path) -> RunConfig:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise RoleError(f"{path} not found: submit with `hpcrl submit` or run the script from `hpcrl sbatch`")
    cfg = load_run_config(path)
    prepare_model_dir(Path(cfg.model.path), cfg.model.init_tiny)
    return cfg


def engines_role(run_dir: Path, *, poll_s: float = 1.0) -> int:
    started = time.time()
    env = _slurm_env()
    cfg = _config(run_dir)
    num_nodes = max(1, len(env.step_nodes))
    node_index = env.rank  # one task per node (--ntasks-per-node=1)
    per_node = math.ceil(cfg.engine.num_engines / num_nodes)
    first = node_index * per_node
    count = max(0, min(per_node, cfg.engine.num_engines - first))
    incarnation = Incarnation(env.job_id, env.restart_count)
    preemption.watch()  # already done by the CLI; repeated for callers that come another way
    # TERM (requeue, preemption) reaches every step at once; the driver then still needs the engines to
    # finish its step and checkpoint. So after a TERM the engines serve on until the done marker, for at
    # most term_grace_s; Slurm's KILL after its grace time ends everything regardless.
    term_grace_s = 120.0
    if count == 0:
        print(f"node {env.node_name}: no engine slots for this node (num_engines={cfg.engine.num_engines})", flush=True)
        return 0
    host = socket.gethostbyname(env.node_name)
    engines = LocalEngines(
        cfg.engine, cfg.model.path, run_dir, seed=cfg.seed, first_index=first, count=count,
        bind_host=host, advertise_host=host, incarnation=incarnation, ignore_sigterm=True,
        delta_agent=cfg.sync.transport == "disk_delta",
    )  # fmt: skip
    engines.start()
    print(f"node {env.node_name}: engines {first}..{first + count - 1} ready at {host}", flush=True)
    marker = done_marker(run_dir, incarnation)
    # The engines read the weight versions the trainer writes: this node must see its weight directory.
    # The driver announces the run after these engines are up; older announcements (minus clock skew) are stale.
    shared = SharedCheck(run_dir, newer_than=started - 10.0) if cfg.sync.transport == "disk_delta" else None
    try:
        signalled_at: float | None = None
        while not marker.exists():
            try:
                if shared is not None and shared.poll():
                    shared = None
            except DeltaDirNotShared as exc:
                print(f"node {env.node_name}: {exc}", file=sys.stderr, flush=True)
                return 1
            if preemption.received() and signalled_at is None:
                signalled_at = time.monotonic()
                sig = preemption.received()
                print(f"node {env.node_name}: signal {sig}; serving until the driver is done", flush=True)
            if signalled_at is not None and time.monotonic() - signalled_at > term_grace_s:
                break
            dead = engines.exited()
            if dead:
                print(f"node {env.node_name}: engine(s) {dead} exited; see run_dir/logs/", file=sys.stderr, flush=True)
                return 1
            time.sleep(poll_s)
    finally:
        engines.stop()
    return 0


def mpi_agent_role(run_dir: Path, *, config_timeout_s: float = 120.0) -> int:
    """MPI ranks 1..N: start this node's engines, then load the buckets that rank 0 broadcasts."""
    from hpcrl.sync.mpi import mpi_world, run_agent

    comm = mpi_world("agent")
    slurm = LaunchEnv.from_environ()
    if slurm is not None:
        # Under Slurm the agents share the driver's step, so the batch shell's USR2 (forwarded to that step)
        # reaches them and their engines: it is the driver's to act on. Ignored here, and inherited as
        # ignored by the engines; TERM is noted (preemption.watch) and the engines ignore it
        # (ignore_sigterm): the driver still needs them to finish its step, then sends STOP.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    deadline = time.monotonic() + config_timeout_s
    while not (run_dir / "config.yaml").is_file():  # rank 0 writes it when the run starts
        if time.monotonic() > deadline:
            raise RoleError(f"{run_dir}/config.yaml did not appear within {config_timeout_s:.0f} s")
        time.sleep(0.2)
    cfg = _config(run_dir)
    num_agents = comm.size - 1
    per_agent = math.ceil(cfg.engine.num_engines / num_agents)
    first = (comm.rank - 1) * per_agent
    count = max(0, min(per_agent, cfg.engine.num_engines - first))
    incarnation = (
        Incarnation(slurm.job_id, slurm.restart_count)
        if slurm
        else Incarnation(os.environ.get("PMIX_NAMESPACE", "mpi"), 0)
    )
    host = socket.gethostbyname(slurm.node_name) if slurm else "127.0.0.1"
    engines = LocalEngines(
        cfg.engine, cfg.model.path, run_dir, seed=cfg.seed, first_index=first, count=count,
        bind_host=host, advertise_host=host, incarnation=incarnation, ignore_sigterm=slurm is not None,
    )  # fmt: skip
    clients = engines.start() if count else []
    print(f"mpi agent {comm.rank}: engines {first}..{first + count - 1} ready", flush=True)
    try:
        return run_agent(clients, comm, engine_kind=cfg.engine.kind, tp_size=cfg.engine.tp_size)
    finally:
        engines.stop()


def trainer_role(
    run_dir: Path,
    *,
    drive: Drive,
    follow: Callable[[Path, RunConfig], int],
) -> int:
    """Trainer rank 0 runs `drive` (the driver loop), the other ranks `follow` it; the caller passes both in, so
    this entry point of every role imports nothing of the run above it."""
    # srun (Slurm) or an MPI launcher (mpiexec, outside Slurm) started this task.
    env = LaunchEnv.from_environ() or LaunchEnv.from_mpi()
    if env is None:
        raise RoleError(
            "`hpcrl role trainer` runs under srun or an MPI launcher (mpiexec -n N); for a local run use `hpcrl run`"
        )
    cfg = _config(run_dir)
    if cfg.sync.transport == "mpi":
        # MPI_Init and the transport's communicator are collective over the launch: every trainer rank joins
        # (rank 0 as the driver) before anything else, followers then leave it to the agents and the driver.
        from hpcrl.sync.mpi import mpi_world

        mpi_world("driver" if env.rank == 0 else "follower")
    os.environ.update(
        {
            "MASTER_ADDR": socket.gethostbyname(env.master_addr),
            "MASTER_PORT": str(env.master_port()),
            "RANK": str(env.rank),
            "WORLD_SIZE": str(env.world_size),
        }
    )
    if env.rank == 0:
        print(f"trainer rank 0 on {env.node_name}: job {env.job_id} restart {env.restart_count}", flush=True)
        if cfg.sync.transport != "mpi":
            return drive(cfg, run_dir, slurm=env)
        from hpcrl.sync.mpi import shutdown_agents

        try:
            return drive(cfg, run_dir, slurm=env)
        finally:
            shutdown_agents()  # however the run ended, the agents must not wait for buckets forever
    from hpcrl.sync.mpi import finalize

    rc = follow(run_dir, cfg)
    finalize()  # when an MPI launcher started the ranks or sync.transport=mpi
    # Rank 0 said STOP: nothing is left to write. Leave without the interpreter's teardown, where torch's gloo
    # worker threads, still holding tensors, can abort the process ("terminate called without an active
    # exception", seen in the MPI step, where srun then fails the job of a finished run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
