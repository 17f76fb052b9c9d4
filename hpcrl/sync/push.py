"""Push the trainer's weights into the engines, as a versioned session.

Ordering contract (what every engine sees, per push):
  1. pause_generation(mode)            every engine, before any weight moves
  2. for each bucket (<= bucket_mb):   update_weights_from_distributed | update_weights_from_tensor
                                       (+ the matching broadcasts from trainer rank 0)
  3. update_weight_version(v, abort_all_requests=False)   never aborting in-flight requests
  4. continue_generation
  5. check: every engine reports version v (model_info)
A failure at any point raises with the engine's URL; nothing retries a weight call.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from hpcrl.engine.client import EngineClient
from hpcrl.engine.protocol import InitWeightsUpdateGroup, UpdateWeightsFromDistributed
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.group import broadcast, broadcast_many, destroy_weight_group, init_weight_group
from hpcrl.sync.sglang_payload import flatten_bucket
from hpcrl.sync.tensor_handover import tensor_update_request

GROUP_NAME = "hpcrl_weights"


class WeightSyncError(RuntimeError):
    pass


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


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
        self.group: dist.ProcessGroup | None = None
        # Torch refuses a group name twice in one process: each (re)connect forms a newly named group.
        self.num_groups = 0
        self._name_token = secrets.token_hex(3)
        self.group_name = GROUP_NAME
        self.mpi = None
        if self.transport == "mpi":
            from hpcrl.sync.mpi import MpiWeightSender

            self.mpi = MpiWeightSender()
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.engines)), thread_name_prefix="hpcrl-sync")
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
        """Form the weight group: trainer rank 0 hosts it, engine i joins as rank 1 + i."""
        if self.transport != "distributed" or self.group is not None:
            return
        port = self.cfg.master_port or _free_port()
        self.num_groups += 1
        # A name of this driver's own: an engine that outlived a crashed driver may still hold its groups.
        self.group_name = f"{GROUP_NAME}_{self._name_token}_{self.num_groups}"
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        world = 1 + len(self.engines)
        futures = [
            self._pool.submit(
                e.init_weights_update_group,
                InitWeightsUpdateGroup(
                    master_address=self.cfg.master_address,
                    master_port=port,
                    rank_offset=1 + i,
                    world_size=world,
                    group_name=self.group_name,
                    backend=backend,
                ),
                timeout_s=self.cfg.group_timeout_s + 10,
            )
            for i, e in enumerate(self.engines)
        ]
        self.group = init_weight_group(
            master_address=self.cfg.master_address,
            master_port=port,
            rank=0,
            world_size=world,
            group_name=self.group_name,
            backend=backend,
            timeout_s=self.cfg.group_timeout_s,
        )
        for engine, fut in zip(self.engines, futures, strict=True):
            try:
                fut.result(timeout=self.cfg.group_timeout_s + 20)
            except Exception as exc:
                raise WeightSyncError(f"engine {engine.url} could not join the weight group: {exc}") from exc

    def reconnect(self, engines: Sequence[EngineClient]) -> None:
        """Re-form the weight group over `engines` (after a restart: a group's membership is fixed)."""
        if self.group is not None:
            # A peer that died mid-broadcast can leave NCCL kernels waiting on this GPU, with the compute
            # stream behind them: abort the communicator so they end now, not at the watchdog's timeout
            # (which would also take this process down).
            try:
                self.group.abort()
            except Exception:  # noqa: BLE001 - an already broken group may refuse; it is dropped anyway
                pass
            for e in self.engines:
                try:
                    e.destroy_weights_update_group(self.group_name, timeout_s=5)
                except Exception:  # noqa: BLE001 - the dead engine cannot answer
                    pass
            destroy_weight_group(self.group)
            self.group = None
        self.engines = list(engines)
        self.connect()

    def push(self, named: Sequence[tuple[str, torch.Tensor]], version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        self._each(lambda e: e.pause_generation(self.cfg.pause_mode), what="pause_generation")
        t_paused = time.perf_counter()
        total = 0
        num_buckets = 0
        for bucket in buckets(named, int(self.cfg.bucket_mb * 2**20)):
            total += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
            if self.transport == "distributed":
                self._send_distributed(bucket)
            elif self.mpi is not None:
                self.mpi.send_bucket(bucket)
            else:
                self._send_tensor(bucket)
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

    def _send_distributed(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        assert self.group is not None, "connect() first"
        flattened = self.cfg.flattened
        request = UpdateWeightsFromDistributed(
            names=tuple(n for n, _ in bucket),
            dtypes=tuple(str(t.dtype).removeprefix("torch.") for _, t in bucket),
            shapes=tuple(tuple(t.shape) for _, t in bucket),
            group_name=self.group_name,
            flush_cache=False,
            load_format="flattened_bucket" if flattened else None,
        )
        calls = [
            self._pool.submit(e.update_weights_from_distributed, request, timeout_s=self.cfg.group_timeout_s)
            for e in self.engines
        ]
        try:
            if flattened:
                # SGLang's layout: one uint8 buffer of the tensors' bytes (what 0.5.16 allocates to receive).
                broadcast(self.group, flatten_bucket(bucket)[0].to(self.device))
            else:
                broadcast_many(self.group, [t.contiguous().to(self.device) for _, t in bucket])
        except RuntimeError as exc:
            # A peer that dies mid-broadcast resets the connection (gloo) or trips the group timeout (nccl):
            # a failed push the caller can heal (restart, re-form the group, push everything again).
            raise WeightSyncError(f"weight broadcast failed: {exc}") from exc
        for engine, fut in zip(self.engines, calls, strict=True):
            try:
                fut.result(timeout=self.cfg.group_timeout_s)
            except Exception as exc:
                raise WeightSyncError(f"update_weights_from_distributed failed on {engine.url}: {exc}") from exc

    def _send_tensor(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        with tensor_update_request(bucket, engine_kind=self.engine_kind, tp_size=self.engine_tp_size) as request:
            self._each(lambda e: e.update_weights_from_tensor(request), what="update_weights_from_tensor")

    def close(self) -> None:
        if self.mpi is not None:
            self.mpi.stop()
            self.mpi = None
        if self.group is not None:
            for e in self.engines:
                try:
                    e.destroy_weights_update_group(self.group_name, timeout_s=10)
                except Exception:  # noqa: BLE001 - engines may already be gone at shutdown
                    pass
            destroy_weight_group(self.group)
            self.group = None
        self._pool.shutdown(wait=False, cancel_futures=True)
