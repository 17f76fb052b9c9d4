"""The CUDA graphs of the decode step: one per batch-size bucket, captured on first use into one memory pool."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """CUDA-graph batch sizes: 1, 2, 4, 8, then every 16 (every 64 past 512); a step pads to the next."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    step = 16
    s = 16
    while s < max_batch:
        sizes.append(s)
        if s >= 512:
            step = 64
        s += step
    sizes.append(max_batch)
    return sizes


class GraphCache:
    """Captured decode steps by batch bucket; a step of n rows replays the smallest bucket >= n (padding rows are
    computed and ignored)."""

    def __init__(self, max_batch: int, stats: dict[str, float]) -> None:
        self.max_batch = max_batch
        self.buckets = batch_buckets(max_batch)
        self.stats = stats  # the runner's: counts graph_captures
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None

    def __contains__(self, nb: int) -> bool:
        return nb in self._graphs

    def clear(self) -> None:
        """Forget captured graphs (they hold raw addresses of the cache and the weights)."""
        self._graphs.clear()
        self._pool = None

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        return self.max_batch

    def captured(
        self, nb: int, forward: Callable[[int], torch.Tensor], what: str
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        hit = self._graphs.get(nb)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Warm-up outside capture (Triton compiles, cuBLAS picks kernels, tables are built). A step only
        # rewrites the K/V of each row's current token at its current position, so running it again is harmless.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward(nb)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the HTTP and weight-receiving threads may touch CUDA while this thread captures.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = forward(nb)
        self._graphs[nb] = (graph, out)
        self.stats["graph_captures"] += 1
        log.info("captured %s for batch %d in %.2f s", what, nb, time.perf_counter() - t0)
        return graph, out
