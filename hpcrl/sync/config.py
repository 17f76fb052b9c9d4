"""Weight push settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpcrl.sync.transport import TRANSPORTS


@dataclass(kw_only=True, frozen=True)
class SyncConfig:
    """The weight push: how the trainer's new weights reach the engines after a step."""

    transport: str = "auto"
    """A name in hpcrl/sync/transport.py's TRANSPORTS, or `auto`. `distributed`: a torch.distributed group from
    trainer rank 0 to the engines (gloo on CPU, nccl on GPU); `tensor`: same-host handover of one flat buffer
    (shared memory / CUDA IPC) for colocated runs; `auto`: `tensor` when trainer and engines share one CUDA
    device (colocated), else `distributed`; `mpi`: MPI broadcast to one agent per engine node
    (`hpcrl role mpi-agent`), see hpcrl/sync/mpi.py; `disk_delta`: each version's changed bits as files on a
    shared file system that every engine patches its weights from (no network path between trainer and engines
    needed; a SGLang engine through an agent process beside it), see hpcrl/sync/disk_delta.py."""
    bucket_mb: float = 512.0
    """Upper bound on the bytes of one bucket (one HTTP call + its broadcasts)."""
    flattened: bool = True
    """Send each bucket as one flat buffer (one collective) instead of one broadcast per tensor."""
    pause_mode: Literal["retract", "in_place", "abort"] = "retract"
    """How engines pause generation for a push: `retract` puts running requests back in the queue (their K/V is
    recomputed after the push), `in_place` holds them where they are, `abort` ends them (sync mode only)."""
    every_steps: int = 1
    """Push new weights after every N-th trainer step (rollout.mode: async only; the synchronous loop pushes
    after every step)."""
    group_timeout_s: float = 300.0
    """Bound on forming the weight group and on every broadcast (with disk_delta: on each engine's load of a
    version); longer than any allowed thermal pause."""
    master_address: str = "127.0.0.1"
    """Address of the weight-update group's store, on the trainer's node; under Slurm the node's own address is
    used instead."""
    master_port: int = 0
    """0 picks a free port."""
    delta_dir: str = ""
    """sync.transport disk_delta: the directory of the weight versions, on a file system every engine node mounts;
    empty means RUN_DIR/weights."""
    snapshot_every: int = 20
    """sync.transport disk_delta: write a full snapshot of the weights every N versions (and with the first push);
    an engine that joins, restarts or finds a delta corrupt starts from the newest snapshot."""
    keep_snapshots: int = 2
    """sync.transport disk_delta: how many snapshots to keep; older ones, and the deltas up to the oldest kept
    snapshot, are removed."""

    def __post_init__(self) -> None:
        if self.transport != "auto" and self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not one of {['auto', *TRANSPORTS]}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        if self.group_timeout_s <= 0:
            raise ValueError("group_timeout_s must be > 0")
        if self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        if self.keep_snapshots < 1:
            raise ValueError(
                "keep_snapshots must be >= 1 (the newest snapshot is what engines rebuild from), "
                f"got {self.keep_snapshots}"
            )
        if self.transport != "disk_delta":
            set_here = [
                key for key, default in (("delta_dir", ""), ("snapshot_every", 20), ("keep_snapshots", 2))
                if getattr(self, key) != default
            ]  # fmt: skip
            if set_here:
                raise ValueError(
                    f"sync.{', sync.'.join(set_here)} only apply to sync.transport disk_delta (this run uses "
                    f"{self.transport!r}): set sync.transport=disk_delta, or remove them"
                )
        if not 0 <= self.master_port <= 65535:
            raise ValueError(
                f"master_port must be a TCP port (1 to 65535), or 0 to pick a free one; got {self.master_port}"
            )
