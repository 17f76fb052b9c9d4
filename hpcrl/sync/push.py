"""Push the trainer's weights into the engines, as one versioned push (the order: sync/publisher.py).

The bytes go through a transport (sync/transport.py: the protocol and the registry of transports by name);
the calls around them (pause, version stamp, continue, check) are the same for every transport and stay here.
A failure at any point raises with the engine's URL; nothing retries a weight call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hpcrl.engine.client import EngineClient
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.errors import WeightSyncError
from hpcrl.sync.transport import Transport, TransportContext, make_transport
from hpcrl.weightwire.buckets import bucket_bytes, buckets

__all__ = ["WeightSync", "WeightSyncError"]


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
        apply_strategy: str = "replace",
        run_dir: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.transport_name = cfg.transport
        if self.transport_name == "auto":
            self.transport_name = "tensor" if colocated and device.type == "cuda" else "distributed"
        self.engines = list(engines)
        self.device = device
        self.engine_kind = engine_kind
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.engines)), thread_name_prefix="hpcrl-sync")
        # Same-host handover speaks each engine's own format: hpcrl's JSON (the embedded engine never
        # unpickles) or SGLang's pickled flattened bucket (a stock server exits on anything else).
        ctx = TransportContext(
            cfg=cfg,
            engines=self.engines,
            device=device,
            pool=self._pool,
            each=lambda fn, what: self._each(fn, what=what),
            engine_kind=engine_kind,
            engine_tp_size=engine_tp_size,
            apply_strategy=apply_strategy,
            run_dir=run_dir,
        )
        self.transport: Transport = make_transport(self.transport_name, ctx)
        self.last_metrics: dict[str, float] = {}

    def _each(self, fn, *, what: str) -> list[Any]:
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
        self.transport.connect()

    def reconnect(self, engines: Sequence[EngineClient]) -> None:
        """Re-form the transport over `engines` (after a restart: a group's membership is fixed)."""
        self.engines = list(engines)
        self.transport.reconnect(self.engines)

    def push(self, named: Sequence[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Every weight in `named` to every engine as weight version `version`, which the engines then report."""
        t0 = time.perf_counter()
        self._each(lambda e: e.pause_generation(self.cfg.pause_mode), what="pause_generation")
        flushed = self._flush_prefix_caches()
        t_paused = time.perf_counter()
        total = 0
        num_buckets = 0
        self.transport.begin(version)
        for bucket in buckets(named, int(self.cfg.bucket_mb * 2**20)):
            total += bucket_bytes(bucket)
            num_buckets += 1
            self.transport.send(bucket)
        self.transport.finish(version)
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
        } | self.transport.metrics()
        if flushed is not None:
            self.last_metrics["sync/prefix_cache_flushed"] = flushed
        return self.last_metrics

    def _flush_prefix_caches(self) -> float | None:
        """Empty SGLang's prefix (radix) cache before the weights change; the share of engines that did.

        SGLang keeps the K/V of finished requests across a weight update unless asked to drop it, and a later
        prompt that shares a prefix with one of them (the chat template, a group's prompt, the next epoch's) is
        then served from K/V the old weights computed. SGLang flushes only when no request runs or waits: in
        async mode the requests `retract` moved back to the queue block it, and an engine left unflushed is
        counted, not failed (its sampled log-probs are still those it sampled with). `in_place` keeps the paused
        requests' K/V by design and is not flushed. The embedded engine keeps no prefix cache (None: nothing
        to count)."""
        if self.engine_kind != "sglang" or self.cfg.pause_mode == "in_place":
            return None
        done = self._each(lambda e: e.flush_cache(), what="flush_cache")
        return sum(done) / len(done) if done else None

    def close(self) -> None:
        self.transport.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
