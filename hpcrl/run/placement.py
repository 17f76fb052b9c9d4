"""What runs where, seen from the driver (trainer rank 0): the one place that knows Slurm from MPI from local.

- local (`hpcrl run`): this process starts the other trainer ranks and the engines as child processes;
- Slurm (`hpcrl role trainer` under srun): srun started the trainer ranks; the engines come from the engine
  het group and announce themselves through run_dir/engines/*.json;
- MPI (`sync.transport=mpi`): the engines come from MPI agents of the same launch.
Everything else (rollout, push, checkpoints) sees only the trainer ranks and the engine clients.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import torch

from hpcrl.engine.client import EngineClient
from hpcrl.engine.local import Incarnation, LocalEngines, done_marker, wait_for_rendezvous
from hpcrl.run.errors import RunError
from hpcrl.run_config import RunConfig
from hpcrl.slurm.env import LaunchEnv
from hpcrl.store.progress import Progress
from hpcrl.sync.config import SyncConfig
from hpcrl.trainer.ranks import RankGroup, build_trainer, init_trainer_group, spawn_followers
from hpcrl.weightwire.group import listen


class Placement:
    def __init__(self, cfg: RunConfig, run_dir: Path, *, slurm: LaunchEnv | None, progress: Progress) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.slurm = slurm
        self.progress = progress
        self.mpi = cfg.sync.transport == "mpi"
        if slurm:
            self.incarnation = Incarnation(slurm.job_id, slurm.restart_count)
        elif self.mpi:
            # Agents and driver come from one mpiexec launch; its namespace names this incarnation.
            self.incarnation = Incarnation(os.environ.get("PMIX_NAMESPACE", "mpi"), 0)
        else:
            self.incarnation = Incarnation()
        # Engines this process starts (and may restart); None when another task started them.
        self.launcher: LocalEngines | None = None

    @property
    def engines_elsewhere(self) -> bool:
        return bool(self.slurm and self.slurm.engines_elsewhere) or self.mpi

    @property
    def engines_here(self) -> bool:
        return not self.slurm and not self.mpi

    @property
    def colocated(self) -> bool:
        """Trainer and engines on one device of this node: the same-host handover applies."""
        return self.engines_here and torch.device(self.cfg.engine.device) == torch.device(self.cfg.train.device)

    def start_trainer(self, model_dir: Path) -> RankGroup:
        world, device = self.cfg.train.num_ranks, torch.device(self.cfg.train.device)
        followers = []
        if self.slurm and self.slurm.world_size != world:
            raise RunError(
                f"the trainer step has {self.slurm.world_size} tasks but train.num_ranks={world}; "
                "make the trainer het group's nodes x tasks per node equal train.num_ranks"
            )
        if world > 1:
            listener = None
            if not self.slurm:
                # Taken before the followers learn the port: no other process can take it in between.
                listener = listen("127.0.0.1")
                port = int(listener.getsockname()[1])
                os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
                followers = spawn_followers(self.run_dir, world, port, entry="hpcrl.run.follower")
            init_trainer_group(
                rank=0, world_size=world, device=device, timeout_s=self.cfg.sync.group_timeout_s, listener=listener
            )
        trainer = build_trainer(self.cfg.train, model_dir, rank=0, world_size=world, sft_lr=self.cfg.sft.lr)
        return RankGroup(trainer, followers, ckpt_dir=self.run_dir / "checkpoints")

    def start_engines(self, model_dir: Path) -> list[EngineClient]:
        n, engine = self.cfg.engine.num_engines, self.cfg.engine
        if self.mpi:
            from hpcrl.sync.mpi import mpi_world

            mpi_world()  # MPI_Init is collective with the agents: join it before waiting on them
        if self.engines_elsewhere:
            job = self.incarnation.job_id
            self.progress.say(f"waiting for {n} {engine.kind} engine(s) of job {job} to write run_dir/engines/*.json")
            return wait_for_rendezvous(self.run_dir, n, self.incarnation, timeout_s=engine.start_timeout_s)
        self.launcher = LocalEngines(
            engine, model_dir, self.run_dir, seed=self.cfg.seed, say=self.progress.say,
            delta_agent=self.cfg.sync.transport == "disk_delta",
        )  # fmt: skip
        self.progress.say(f"starting {n} {engine.kind} engine(s) on {engine.device}")
        return self.launcher.start()

    def sync_config(self) -> SyncConfig:
        if self.slurm:
            # Engines on other nodes must reach the weight group's store on this node.
            return dataclasses.replace(self.cfg.sync, master_address=socket.gethostbyname(self.slurm.node_name))
        return self.cfg.sync

    def local_engine_pids(self) -> list[int]:
        return self.launcher.pids() if self.launcher else []

    def stop_engines(self) -> None:
        """Stop the engines this process started; tell engines elsewhere that the run is over."""
        if self.launcher is not None:
            self.launcher.stop()
        if self.engines_elsewhere:
            done_marker(self.run_dir, self.incarnation).touch()
