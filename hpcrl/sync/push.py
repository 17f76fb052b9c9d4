"""Push the trainer's weights into the engines, as a versioned session.

Ordering contract (what every engine sees, per push):
  1. pause_generation(mode)            every engine, before any weight moves
  2. for each bucket (<= bucket_mb):   update_weights_from_distributed | update_weights_from_tensor
                                       (+ the matching broadcasts from trainer rank 0)
  3. update_weight_version(v, abort_all_requests=False)   never aborting in-flight requests
  4. continue_generation
  5. check: every engine reports version v (model_info)
A failure at any point raises with the engine's URL; nothing retries a weight call.

One module per transport: sync/distributed.py (a torch.distributed group), sync/tensor_handover.py (same-host
handover, in each engine kind's format), sync/mpi.py (MPI broadcast to one agent per engine node).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from hpcrl.engine.client import EngineClient
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.errors import WeightSyncError
from hpcrl.sync.tensor_handover import TensorSender


def buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of one dtype, each at most bucket_bytes (a bigger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class WeightSync:
    def __init__(
        self,
        cfg: SyncConfig,
        engines: Sequence[EngineClient],
        *,
        device: torch.device,
        colocated: bool = False,
        engine_kind: str = "embedded",
        engine_tp_size: int = 1,
    ) -> None:
        self.cfg = cfg
        # Same-host handover speaks each engine's own format: hpcrl's JSON (the embedded engine never
        # unpickles) or SGLang's pickled flattened bucket (a stock server exits on anything else).
        self.engine_kind = engine_kind
        self.engine_tp_size = engine_tp_size
        self.transport = cfg.transport
        if self.transport == "auto":
            self.transport = "tensor" if colocated and device.type == "cuda" else "distributed"
        self.engines = list(engines)
        self.device = device
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.engines)), thread_name_prefix="hpcrl-sync")
        self.sender: Sender
        if self.transport == "distributed":
            from hpcrl.sync.distributed import DistributedTransport

            self.sender = DistributedTransport(cfg, self.engines, device=device, pool=self._pool)
        elif self.transport == "mpi":
            from hpcrl.sync.mpi import MpiWeightSender

            self.sender = MpiWeightSender()
        else:
            self.sender = TensorSender(
                lambda fn, what: self._each(fn, what=what), engine_kind=engine_kind, tp_size=engine_tp_size
            )
        self.last_metrics: dict[str, float] = {}

    def _each(self, fn, *, what: str) -> list:
        futures = [self._pool.submit(fn, e) for e in self.engines]
        out = []
        for engine, fut in zip(self.engines, futures, strict=True):
            try:
                out.append(fut.result())
            except Exception as exc:
                raise WeightSyncError(f"{what} failed on engine {engine.url}: {exc}") from exc
        return out

    def connect(self) -> None:
        """Form the transport's group, where it has one (distributed: engine i joins as rank 1 + i)."""
        self.sender.connect()

    def reconnect(self, engines: Sequence[EngineClient]) -> None:
        """Re-form the transport over `engines` (after a restart: a group's membership is fixed)."""
        self.engines = list(engines)
        self.sender.reconnect(self.engines)

    def push(self, named: Sequence[tuple[str, torch.Tensor]], version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        self._each(lambda e: e.pause_generation(self.cfg.pause_mode), what="pause_generation")
        t_paused = time.perf_counter()
        total = 0
        num_buckets = 0
        for bucket in buckets(named, int(self.cfg.bucket_mb * 2**20)):
            total += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
            self.sender.send(bucket)
        t_sent = time.perf_counter()
        self._each(lambda e: e.update_weight_version(version, abort_all_requests=False), what="update_weight_version")
        self._each(lambda e: e.continue_generation(), what="continue_generation")
        versions = self._each(lambda e: e.weight_version(), what="model_info")
        stale = [e.url for e, v in zip(self.engines, versions, strict=True) if v != version]
        if stale:
            raise WeightSyncError(f"engines {stale} do not report weight version {version} after the push")
        t_end = time.perf_counter()
        # The phases show whether a slow push is the session's control calls or the bytes.
        self.last_metrics = {
            "sync/seconds": t_end - t0,
            "timing/sync_pause_s": t_paused - t0,
            "timing/sync_send_s": t_sent - t_paused,
            "timing/sync_commit_s": t_end - t_sent,
            "sync/bytes": float(total),
            "sync/num_buckets": float(num_buckets),
        }
        return self.last_metrics

    def close(self) -> None:
        self.sender.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class Sender(Protocol):
    """What a transport does for the push: the session of calls around it stays in WeightSync."""

    def connect(self) -> None: ...

    def reconnect(self, engines: Sequence[EngineClient]) -> None: ...

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None: ...

    def close(self) -> None: ...
