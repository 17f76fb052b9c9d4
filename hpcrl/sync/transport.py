"""How a push's bytes reach the engines: the transport protocol and the registry of transports by name.

A transport is one module that implements `Transport` and one line in TRANSPORTS (`sync.transport` accepts the
registry's names, plus `auto`). The push around it (pause, version stamp, continue, check) is not its business:
WeightSync makes those calls in the order sync/publisher.py states, and per push calls
    begin(version)  once, before any bucket
    send(bucket)    per bucket, in order (consecutive tensors of one dtype, at most sync.bucket_mb)
    finish(version) once, after the last bucket; when it returns, every engine holds the new weights
    metrics()       after finish: the transport's own figures of the push (sync/...), merged into the push's
A transport that owns a whole push (a manifest written last, a delta against the previous version) does its work
in begin and finish; one that streams buckets (a broadcast, a handover) leaves them empty. Any failure raises
(WeightSyncError or the transport's own error, naming the engine): the publisher heals and pushes everything again.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the config imports the registry, and a config loads without torch
    import torch

    from hpcrl.engine.client import EngineClient
    from hpcrl.sync.config import SyncConfig
    from hpcrl.weightwire.buckets import Bucket

TRANSPORTS: dict[str, str] = {
    "distributed": "hpcrl.sync.distributed:DistributedTransport",
    "tensor": "hpcrl.sync.tensor_handover:TensorSender",
    "mpi": "hpcrl.sync.mpi:MpiWeightSender",
    "disk_delta": "hpcrl.sync.disk_delta:DiskDeltaTransport",
}
"""Name (`sync.transport`) -> `module:Class`, imported only when that transport is used."""

EachFn = Callable[[Callable[["EngineClient"], Any], str], list[Any]]


@dataclass(frozen=True)
class TransportContext:
    """What the push gives a transport when it makes one."""

    cfg: SyncConfig
    engines: Sequence[EngineClient]  # at the start; reconnect() brings the new list after a restart
    device: torch.device  # where the trainer's weights live
    pool: ThreadPoolExecutor  # the push's threads (one per engine)
    each: EachFn  # each(fn, what): fn(engine) on every engine in parallel; a failure raises naming the engine
    engine_kind: str  # "embedded" | "sglang": the request format an engine reads
    engine_tp_size: int
    apply_strategy: str = "replace"  # how the engines write the tensors (hpcrl/engine/embedded/apply.py)
    run_dir: Path | None = None  # the run directory (files a transport writes by default; SGLang's delta agents)


class Transport(Protocol):
    """A transport's hooks. Subclass it to inherit the empty ones; `send` is the one every transport has."""

    def connect(self) -> None:
        """Form what the transport needs before its first push (a process group); nothing by default."""

    def reconnect(self, engines: Sequence[EngineClient]) -> None:
        """Re-form it over `engines` after a restart (a group's membership is fixed); nothing by default."""

    def begin(self, version: int) -> None:
        """A push of weight version `version` starts; nothing by default."""

    def send(self, bucket: Bucket) -> None: ...

    def finish(self, version: int) -> None:
        """The last bucket of `version` was sent; nothing by default."""

    def close(self) -> None:
        """Release what connect formed; nothing by default."""

    def metrics(self) -> dict[str, float]:
        """The transport's own figures of the last push (merged into the push's metrics); none by default."""
        return {}


def transport_names() -> list[str]:
    return list(TRANSPORTS)


def make_transport(name: str, ctx: TransportContext) -> Transport:
    """The transport registered as `name`, made for this push; ValueError naming the registered ones."""
    target = TRANSPORTS.get(name)
    if target is None:
        raise ValueError(f"sync.transport {name!r} is not one of {transport_names()} (or auto)")
    module, attr = target.split(":")
    cls: Callable[[TransportContext], Transport] = getattr(importlib.import_module(module), attr)
    return cls(ctx)
