"""What every group of the embedded engine's routes shares: the settings, the model and its scheduler, the weight
receiver, the tokenizer, and the thread pools that keep blocking work (a rendezvous, a weight receive, tokenizing
a long text) off the event loop."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hpcrl.engine.embedded.detokenize import TextDecoder
from hpcrl.engine.embedded.scheduler import Scheduler, SchedulerConfig
from hpcrl.engine.embedded.server_config import ServerConfig
from hpcrl.engine.embedded.weights import WeightReceiver
from hpcrl.model.hf import load_model, parse_dtype
from hpcrl.model.qwen3 import ModelArgs

log = logging.getLogger("hpcrl.engine")


class EngineCore:
    """The engine's parts, built once at start-up; the route classes (generate_routes.py, control_routes.py,
    weight_routes.py) add the handlers, and `EmbeddedEngine` (server.py) joins them into one aiohttp app."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        engine = cfg.engine
        torch.set_num_threads(engine.num_threads)
        self.device = torch.device(engine.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches on the current device: an engine on cuda:1 must make it current.
            torch.cuda.set_device(self.device)
        self.dtype = parse_dtype(engine.dtype)
        max_positions = ModelArgs.from_dir(cfg.model).max_position_embeddings
        if engine.context_length is not None and engine.context_length > max_positions:
            # Positions past the model's table have rotary angles it never saw in training.
            raise ValueError(
                f"context_length {engine.context_length} is above the model's max_position_embeddings "
                f"{max_positions} ({cfg.model}/config.json); use at most {max_positions}"
            )
        self.model = load_model(cfg.model, dtype=self.dtype, device=self.device)
        self.scheduler = Scheduler(
            self.model,
            SchedulerConfig(engine=engine, context_length=engine.context_length or max_positions),
            device=self.device,
            dtype=self.dtype,
        )
        self.scheduler.weight_version = cfg.weight_version
        self.weights = WeightReceiver(self.scheduler, group_timeout_s=engine.group_timeout_s)
        self.tokenizer = _load_tokenizer(cfg.model)
        self.scheduler.text_decoder = TextDecoder(self.tokenizer) if self.tokenizer is not None else None
        self._seed_rng = secrets.SystemRandom() if cfg.random_seed < 0 else None
        self._request_counter = 0
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hpcrl-engine-ctl")
        self._control: set[Future[Any]] = set()
        self._waiters: set[asyncio.Future[Any]] = set()
        # Text prompts are tokenized here, off the event loop: one 5 MB text took ~19 s, with /health unanswered.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcrl-engine-tokenize")
        self.started_s = time.time()

    async def _run(self, fn: Callable[[], Any]) -> Any:
        work = self._pool.submit(fn)
        self._control.add(work)
        work.add_done_callback(self._control.discard)
        waiter = asyncio.wrap_future(work)
        self._waiters.add(waiter)
        try:
            return await waiter
        finally:
            self._waiters.discard(waiter)

    def control_busy(self) -> bool:
        """Whether control work (a rendezvous, a receive) still runs: it cannot be interrupted, only outlived."""
        return any(not w.done() for w in list(self._control))

    async def _on_scheduler(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))


def _load_tokenizer(model_dir: str) -> Any:
    if not (Path(model_dir) / "tokenizer.json").is_file() and not (Path(model_dir) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
