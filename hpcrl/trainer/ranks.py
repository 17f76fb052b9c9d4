"""Trainer ranks beyond rank 0: how they start, and how rank 0 hands them each step's batch.

Rank 0 runs the driver (rollout, rewards, weight push) and broadcasts every train command with its
batch tensors over the trainer's default process group; ranks 1..N-1 loop on `follow`. Rendezvous
comes from the environment (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, set by the local launcher or
derived from Slurm's variables), bounded by a timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hpcrl.store.checkpoint import checkpoint_file, shards_dir
from hpcrl.store.shards import clear_pending
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.protocol import Trainer
from hpcrl.trainer.sharded_state import GatheredWeights
from hpcrl.trainer.torch_backend import TorchTrainer

CMD_STOP, CMD_GRPO, CMD_SFT, CMD_LOAD, CMD_WEIGHTS, CMD_STATE, CMD_EXPORT = 0, 1, 2, 3, 4, 5, 6
_KINDS = {
    "input_ids": torch.long,
    "prompt_lens": torch.long,
    "lengths": torch.long,
    "loss_mask": torch.bool,
    "advantages": torch.float32,
    "rollout_logprobs": torch.float32,
}


def init_trainer_group(
    *, rank: int, world_size: int, device: torch.device, timeout_s: float, listener: socket.socket | None = None
) -> None:
    """Join the trainer's default process group. `listener`: rank 0's socket for the group's store, taken by a local
    run on loopback before the other ranks learn its port, so the store listens there only (torch's own store
    listens on every interface, where another host could join in a rank's place). Without it the store comes from
    MASTER_ADDR/MASTER_PORT, as under Slurm, where the other nodes must reach it."""
    # The command channel broadcasts small CPU tensors; the trainer's collectives run on the GPU.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    try:
        # Every rank builds the store the same way (env:// would prefix its keys, an explicit store does not).
        if listener is not None:
            address, port = listener.getsockname()[:2]
            listen_fd: int | None = listener.fileno()
        else:
            address, port, listen_fd = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
        store = dist.TCPStore(
            address, port, world_size, rank == 0, timeout, multi_tenant=True, master_listen_fd=listen_fd
        )
        if listener is not None:
            listener.detach()  # the store's server owns the descriptor now
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except Exception as exc:
        raise RuntimeError(
            f"trainer rank {rank}/{world_size} could not join the trainer group at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within {timeout_s:.0f} s: {exc}"
        ) from exc


def _send(cmd: int, batch: TrainBatch | None, extra: int = 0) -> None:
    n, t = (len(batch), int(batch.input_ids.shape[1])) if batch is not None else (0, 0)
    # Sampling supports travel ragged (sizes per position + the ids back to back); -1: the batch has none.
    num_ids = -1 if batch is None or batch.support_ids is None else int(batch.support_ids.numel())
    per_token = int(batch is not None and batch.advantages.dim() == 2)  # per-token advantages: [n, t-1]
    dist.broadcast(torch.tensor([cmd, n, t, extra, num_ids, per_token], dtype=torch.long), src=0)
    if batch is not None:
        for name in _KINDS:
            dist.broadcast(getattr(batch, name).contiguous(), src=0)
        if batch.support_sizes is not None and batch.support_ids is not None:
            dist.broadcast(batch.support_sizes.to(torch.int32).contiguous(), src=0)
            dist.broadcast(batch.support_ids.to(torch.int32).contiguous(), src=0)


def _recv() -> tuple[int, TrainBatch | None, int]:
    header = torch.zeros(6, dtype=torch.long)
    dist.broadcast(header, src=0)
    cmd, n, t, extra, num_ids, per_token = (int(x) for x in header)
    if cmd not in (CMD_GRPO, CMD_SFT):
        return cmd, None, extra
    shapes = {
        "input_ids": (n, t),
        "prompt_lens": (n,),
        "lengths": (n,),
        "loss_mask": (n, t - 1),
        "advantages": (n, t - 1) if per_token else (n,),
        "rollout_logprobs": (n, t - 1),
    }
    tensors = {}
    for name, dtype in _KINDS.items():
        buf = torch.empty(shapes[name], dtype=dtype)
        dist.broadcast(buf, src=0)
        tensors[name] = buf
    if num_ids >= 0:
        tensors["support_sizes"] = torch.empty((n, t - 1), dtype=torch.int32)
        tensors["support_ids"] = torch.empty((num_ids,), dtype=torch.int32)
        dist.broadcast(tensors["support_sizes"], src=0)
        dist.broadcast(tensors["support_ids"], src=0)
    return cmd, TrainBatch(**tensors), extra


def build_trainer(cfg: TrainConfig, model_dir: str | Path, *, rank: int, world_size: int, sft_lr: float) -> Trainer:
    if cfg.backend == "megatron":
        from hpcrl.trainer.megatron.backend import MegatronTrainer

        trainer: Trainer = MegatronTrainer(cfg, model_dir, rank=rank, world_size=world_size, sft_lr=sft_lr)
        return trainer
    return TorchTrainer(cfg, model_dir, rank=rank, world_size=world_size, sft_lr=sft_lr)


class RankGroup:
    """Rank 0's view of all trainer ranks: the same calls as the trainer, fanned out.

    With the torch backend every rank holds the whole model, so rank 0 answers weight and state
    requests alone; the Megatron backend's are collective (TP shards, pipeline stages), so rank 0
    first tells the followers to take part."""

    def __init__(
        self, trainer: Trainer, followers: list[subprocess.Popen[bytes]], ckpt_dir: Path | None = None
    ) -> None:
        self.trainer = trainer
        self.followers = followers
        # The run's checkpoints folder: a sharded trainer's ranks write their shards of each checkpoint there.
        self.ckpt_dir = ckpt_dir

    def train_grpo(self, batch: TrainBatch) -> dict[str, float]:
        self._check_followers()
        if self.trainer.world_size > 1:
            _send(CMD_GRPO, batch)
        return self.trainer.train_grpo(batch)

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        self._check_followers()
        if self.trainer.world_size > 1:
            _send(CMD_SFT, batch)
        return self.trainer.train_sft(batch)

    def push_weights(self, *, full: bool = False) -> list[tuple[str, Tensor]]:
        if isinstance(self.trainer, TorchTrainer) and self.trainer.collective:
            # FSDP2: the weights are gathered as they are read, so the followers join every pass over them.
            weights = self.trainer.push_weights(full=full)
            assert isinstance(weights, GatheredWeights)
            weights.before_pass = lambda: self._announce(CMD_WEIGHTS, extra=int(full))
            return weights
        # Megatron gathers its tensor-parallel shards inside the call: the followers must be in it first.
        self._announce(CMD_WEIGHTS, extra=int(full))
        return self.trainer.push_weights(full=full)

    def export_weights(self) -> list[tuple[str, Tensor]]:
        self._announce(CMD_EXPORT)
        return self.trainer.export_weights()

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        self._announce(CMD_STATE)
        return self.trainer.state()

    def export(self, out_dir: Path) -> Path:
        self._announce(CMD_EXPORT)
        return self.trainer.export(out_dir)

    def _announce(self, cmd: int, extra: int = 0) -> None:
        if self.trainer.world_size > 1 and self.trainer.collective:
            self._check_followers()
            _send(cmd, None, extra=extra)

    # ----- a part of the run's checkpointed state (hpcrl/store/run_state.py) -----
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        if isinstance(self.trainer, TorchTrainer) and self.trainer.collective and self.ckpt_dir is not None:
            # Sharded: every rank writes its own shard file for the checkpoint being saved (hpcrl/store/shards.py).
            clear_pending(self.ckpt_dir)
            self._announce(CMD_STATE, extra=1)
            return self.trainer.state(shards_to=self.ckpt_dir)
        return self.state()

    def load_state_dict(self, tensors: dict[str, Tensor], state: dict[str, Any], *, step: int) -> None:
        """Rank 0 loads what it is given; the followers read the checkpoint of `step` themselves."""
        if isinstance(self.trainer, TorchTrainer) and self.ckpt_dir is not None:
            shards = shards_dir(checkpoint_file(self.ckpt_dir, step))
            self.trainer.load_state(tensors, state, shards=shards if shards.is_dir() else None)
        else:
            self.trainer.load_state(tensors, state)
        if self.trainer.world_size > 1:
            _send(CMD_LOAD, None, extra=step)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.followers]

    def _check_followers(self) -> None:
        for i, p in enumerate(self.followers, start=1):
            if p.poll() is not None:
                raise RuntimeError(f"trainer rank {i} exited with code {p.returncode}; see its log in run_dir/logs/")

    def close(self) -> None:
        if self.trainer.world_size > 1:
            try:
                _send(CMD_STOP, None)
            finally:
                for p in self.followers:
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                dist.destroy_process_group()


def spawn_followers(run_dir: Path, world_size: int, master_port: int, *, entry: str) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..N-1 as `python -m ENTRY RUN_DIR` (the caller's module, which calls `follow`)."""
    from hpcrl.store.run_dir import make_subdir, open_no_follow

    procs = []
    logs = make_subdir(run_dir / "logs")
    for rank in range(1, world_size):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
        }
        # Never through a link planted at the log's name; the child owns the file.
        log = os.fdopen(
            open_no_follow(logs / f"trainer-rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), "ab"
        )
        procs.append(subprocess.Popen([sys.executable, "-m", entry, str(run_dir)], env=env, stdout=log, stderr=log))
    return procs


def follow(run_dir: Path, train: TrainConfig, *, model_path: str | Path, sft_lr: float, group_timeout_s: float) -> int:
    """Ranks 1..N-1: build the trainer as rank 0 does (the settings of run_dir/config.yaml) and obey rank 0."""
    import signal

    from hpcrl.store.checkpoint import load_checkpoint

    # Slurm signals every task on preemption; rank 0 alone decides when to stop (it checkpoints first
    # and then sends STOP), so a follower must not die of TERM/USR2 in the middle of a collective.
    for sig in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(train.device)
    init_trainer_group(rank=rank, world_size=world, device=device, timeout_s=group_timeout_s)
    trainer = build_trainer(train, model_path, rank=rank, world_size=world, sft_lr=sft_lr)
    while True:
        cmd, batch, extra = _recv()
        if cmd == CMD_STOP:
            break
        if cmd == CMD_LOAD:
            ckpt = load_checkpoint(checkpoint_file(run_dir / "checkpoints", extra))
            if isinstance(trainer, TorchTrainer):
                trainer.load_state(ckpt.tensors, ckpt.state["trainer"], shards=ckpt.shards)
            else:
                trainer.load_state(ckpt.tensors, ckpt.state["trainer"])
        elif cmd == CMD_WEIGHTS:
            for _ in trainer.push_weights(full=bool(extra)):  # gathered as iterated, with rank 0's pass
                pass
        elif cmd == CMD_EXPORT:
            trainer.export_weights()
        elif cmd == CMD_STATE:
            if isinstance(trainer, TorchTrainer) and extra:
                trainer.state(shards_to=run_dir / "checkpoints")
            else:
                trainer.state()
        elif cmd == CMD_SFT:
            assert batch is not None
            trainer.train_sft(batch)
        elif cmd == CMD_GRPO:
            assert batch is not None
            trainer.train_grpo(batch)
    dist.destroy_process_group()
    return 0
