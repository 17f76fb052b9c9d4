"""The weight-update process group that joins trainer rank 0 (rank 0) with engine ranks.

It is built directly on a TCPStore rather than `torch.distributed.init_process_group`, because both
sides already have (or may have) a default group of their own: the trainer's DDP group, the engine's
tensor-parallel group. The store keys are prefixed the way SGLang's `init_custom_process_group` does
(group name, then backend), so the trainer side also rendezvouses with a real SGLang server.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class WeightGroupError(RuntimeError):
    pass


def init_weight_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) the group; every rendezvous is bounded by timeout_s."""
    if backend not in ("gloo", "nccl"):
        raise WeightGroupError(f"backend {backend!r} is not supported for weight updates; use gloo or nccl")
    if not 0 <= rank < world_size:
        raise WeightGroupError(f"rank {rank} is outside world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
        prefixed = dist.PrefixStore(f"{backend}/", dist.PrefixStore(group_name, store))
        if backend == "gloo":
            # A bare backend: torch's stubs do not type it a ProcessGroup, though it has the calls used here.
            pg: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    except Exception as exc:  # noqa: BLE001 - torch raises several types for a failed rendezvous
        raise WeightGroupError(
            f"weight-update group {group_name!r} (rank {rank}/{world_size}, {backend}) could not form at "
            f"{master_address}:{master_port} within {timeout_s:.0f} s: {exc}"
        ) from exc
    return pg


def broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor, *, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait()


def broadcast_many(pg: Any, tensors: list[torch.Tensor], *, src: int = 0) -> None:
    """Broadcast tensors in order. On CUDA they go as one coalesced NCCL group: launched one by one,
    each broadcast costs tens of microseconds of host time, which for a model's few hundred tensors is
    several times the transfer itself. A peer that does not coalesce still matches: the order is the same."""
    if not tensors:
        return
    if not tensors[0].is_cuda:
        for t in tensors:
            broadcast(pg, t, src=src)
        return
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    try:  # a bare backend (what init_weight_group makes) takes no device; a ProcessGroup wrapper does
        pg._start_coalescing()
        with_device = False
    except TypeError:
        pg._start_coalescing(tensors[0].device)
        with_device = True
    for t in tensors:
        pg.broadcast([t], opts)
    (pg._end_coalescing(tensors[0].device) if with_device else pg._end_coalescing()).wait()
