"""The state the scheduler's parts share (`Scheduler` sets it up; admission, results and control read and change it),
declared once so that each part's methods are typed."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from hpcrl.engine.embedded.detokenize import TextDecoder
from hpcrl.engine.embedded.requests import PauseMode, SeqRequest
from hpcrl.engine.embedded.runner import DecodeRunner
from hpcrl.engine.embedded.scheduler_config import SchedulerConfig
from hpcrl.engine.embedded.step_output import StepHandle
from hpcrl.model.qwen3 import CausalLM, KVCache


@dataclass
class Pending:
    """A launched decode step whose tokens the host has not read yet."""

    rows: list[SeqRequest]
    handle: StepHandle
    routes: torch.Tensor | None = None  # [rows, 1, layers, k]: the experts each row's input token was routed to


class SchedulerState:
    model: CausalLM
    text_decoder: TextDecoder | None
    cfg: SchedulerConfig
    device: torch.device
    dtype: torch.dtype
    eos_ids: frozenset[int]
    cache: KVCache | None
    runner: DecodeRunner
    overlap: bool
    weights_released: bool
    _weight_shapes: dict[str, tuple[torch.Size, torch.dtype]]
    _weight_backup: dict[str, torch.Tensor]
    weight_version: str
    waiting: deque[SeqRequest]
    running: list[SeqRequest]
    paused: PauseMode | None
    _lock: threading.Condition
    _calls: deque[tuple[Callable[[], Any], Future[Any]]]
    _stop: bool
    _inflight: Pending | None
    _rows_dirty: bool  # the runner's slot buffers must be rewritten before the next step
    _launches_left: int
    _torch_sampler: bool  # some running row needs top-k/top-p/min-p or its sampling support
    _want_support: bool
    _want_routes: bool
    num_decode_steps: int
    num_prefill_forwards: int
    num_generated_tokens: int
    host_stats: dict[str, float]
