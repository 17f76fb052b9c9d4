"""The weight-update process group that joins trainer rank 0 (rank 0) with engine ranks.

Both sides may already have a default group of their own (the trainer's DDP group, the engine's tensor-
parallel group), so it is not `init_process_group`. It is formed exactly as SGLang 0.5.16's
`init_custom_process_group` forms it (sglang/srt/utils/common.py:2424, called from weight_updater.py:81):
a `tcp://` rendezvous, a `PrefixStore(group_name)`, then torch's `_new_process_group_helper`, which adds
its own `group_name/` and per-device prefixes. Copying only the outer prefixes is not enough: on the H200,
a group keyed "group/gloo/" waited 120 s for a real SGLang server that had joined under torch's keys.
The group name must be new in each process (torch refuses a name twice), so the pusher numbers them.

Rank 0 does not let torch open the store's socket: torch's TCPStore server listens on every interface, so on a
shared node any host that reaches it could join the group in an engine's place. Rank 0 listens on
`master_address` only (127.0.0.1 in a local run, the node's own address under Slurm) and hands the socket to
the store.
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist


class WeightGroupError(RuntimeError):
    pass


def free_port(host: str = "") -> int:
    """A port that is free now, for a group's rendezvous store (`host` "": every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Ports whose store server this process hosts: torch keeps one server per port (multi-tenant), which a second
# group on the same port shares instead of listening again.
_hosted_ports: set[int] = set()


def listen(address: str, port: int = 0) -> socket.socket:
    """A socket listening on `address` only (port 0: a free one), for rank 0's store; the caller learns the
    port before the peers are told it, so no other process can take it in between."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise WeightGroupError(
            f"sync.master_address {address!r} does not resolve ({exc}); set it to an address of this node"
        ) from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise WeightGroupError(
                f"the weight-update group's store cannot listen on {address}:{port}: the port is in use; "
                "set sync.master_port=0 to pick a free port"
            ) from exc
        raise WeightGroupError(
            f"the weight-update group's store cannot listen on {address}:{port}: {exc}; "
            "set sync.master_address to an address of this node"
        ) from exc
    return sock


def _host_store(address: str, port: int, world_size: int, timeout: timedelta, listener: socket.socket | None) -> Any:
    """Rank 0's store, served from `listener` (or a new socket on `address`), never from every interface."""
    if listener is None:
        try:
            listener = listen(address, port)
        except WeightGroupError as exc:
            if port not in _hosted_ports or not isinstance(exc.__cause__, OSError):
                raise
            if exc.__cause__.errno != errno.EADDRINUSE:
                raise
            # This process's own server holds the port: torch hands the new store that server.
            return dist.TCPStore(address, port, world_size, True, timeout, multi_tenant=True)
    port = int(listener.getsockname()[1])
    try:
        store = dist.TCPStore(
            address, port, world_size, True, timeout, multi_tenant=True, master_listen_fd=listener.fileno()
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the descriptor now and closes it when it stops
    _hosted_ports.add(port)
    return store


def init_weight_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    listener: socket.socket | None = None,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) the group; every rendezvous is bounded by timeout_s. Rank 0 serves the
    store from `listener` (from `listen`) when given, else listens on master_address:master_port itself."""
    if backend not in ("gloo", "nccl"):
        raise WeightGroupError(f"backend {backend!r} is not supported for weight updates; use gloo or nccl")
    if not 0 <= rank < world_size:
        raise WeightGroupError(f"rank {rank} is outside world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    host = f"[{master_address}]" if ":" in master_address else master_address
    try:
        if rank == 0:
            store = _host_store(master_address, master_port, world_size, timeout, listener)
        else:
            store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=cast(Any, group_name),
            backend_options=None, timeout=timeout,
        )  # fmt: skip
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    except WeightGroupError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises several types for a failed rendezvous
        raise WeightGroupError(
            f"weight-update group {group_name!r} (rank {rank}/{world_size}, {backend}) could not form at "
            f"{master_address}:{master_port} within {timeout_s:.0f} s: {exc}"
        ) from exc
    return pg


def destroy_weight_group(pg: Any) -> None:
    """Unregister and shut the group down (best effort: a group whose peer died may refuse)."""
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - it is dropped either way
        pass


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
