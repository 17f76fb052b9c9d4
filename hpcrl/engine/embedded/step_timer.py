"""The decode step's profile (engine.profile): device time of the forward and of the sampler per step, and the
device's idle time between steps, summed into `stats`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch


class StepTimer:
    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda
        self.stats: dict[str, float] = {
            "steps": 0,
            "forward_ms": 0.0,
            "sample_ms": 0.0,
            "between_steps_ms": 0.0,
            "graph_captures": 0,
        }
        self._last_end: Any = None  # the profiled step's last event: the next step's gap is measured from it

    def events(self) -> list[Any]:
        if self.is_cuda:
            ev: list[Any] = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            # The device's time between the last step's end and this one's start (the output copies, the
            # launches) counts only while that step is still queued or running: otherwise the gap is the host's.
            last = self._last_end
            ev.append(last if last is not None and not last.query() else None)
            ev[0].record()
            return ev
        return [time.perf_counter(), 0.0, 0.0, None]

    def mark(self, timing: list[Any], i: int) -> None:
        if self.is_cuda:
            timing[i].record()
            if i == 2:
                self._last_end = timing[2]
        else:
            timing[i] = time.perf_counter()

    def record(self, timing: Sequence[Any]) -> None:
        if self.is_cuda:
            fwd, smp = timing[0].elapsed_time(timing[1]), timing[1].elapsed_time(timing[2])
            if timing[3] is not None:
                self.stats["between_steps_ms"] += timing[3].elapsed_time(timing[0])
        else:
            fwd, smp = (timing[1] - timing[0]) * 1e3, (timing[2] - timing[1]) * 1e3
        self.stats["steps"] += 1
        self.stats["forward_ms"] += fwd
        self.stats["sample_ms"] += smp
