"""The embedded engine's scheduler: continuous batching over a static KV cache, in one thread.

`run` is the scheduler loop; the server runs it on the process's main thread (the HTTP event loop has
a thread of its own), because torch's OpenMP CPU ops driven from any other thread ran 2-3x slower here
with two threads: libgomp throttles its workers' spin-waiting once a second thread owns a team.
All model work and every state change (weights, memory, pause) happen on the scheduler thread, between
decode steps, so nothing races with a forward pass. The HTTP layer talks to it only through
`submit`, `abort` and `call` (run a function on the scheduler thread and wait for its result).

Running sequences occupy the contiguous cache slots 0..R-1; a finished sequence's slot is refilled by
moving the last one down, so that every forward reads a slice of the cache, never a gather.

Decode steps run through `runner.DecodeRunner`, which keeps each slot's next token, position and
sampling state on the device. On CUDA the scheduler looks one step ahead: it launches step t+1 before
it reads step t's tokens, so the host's bookkeeping overlaps the GPU's work. A sequence that finished
at step t has then been decoded once more; that extra token is dropped. Whenever the set of running
sequences changes (a finish, an admission, an abort, a control call) the look-ahead step is drained
first, so every state change still happens between forward passes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from hpcrl.engine.embedded.control import Control
from hpcrl.engine.embedded.detokenize import CHUNK_TOKENS, TextDecoder
from hpcrl.engine.embedded.kernels import launch
from hpcrl.engine.embedded.requests import PauseMode, SeqRequest
from hpcrl.engine.embedded.runner import DecodeRunner
from hpcrl.engine.embedded.scheduler_config import SchedulerConfig, resolve_decode_mode
from hpcrl.engine.embedded.scheduler_state import Pending
from hpcrl.model import invariant_kernels
from hpcrl.model.qwen3 import CausalLM, KVCache

log = logging.getLogger(__name__)


class Scheduler(Control):
    def __init__(self, model: CausalLM, cfg: SchedulerConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        # Set by the server once its tokenizer is loaded; None: no text is decoded on this thread.
        self.text_decoder: TextDecoder | None = None
        self.cfg = cfg
        launch.configure(cfg.engine.kernels)  # process-wide, like the CUDA graphs that capture the kernels
        invariant_kernels.configure(cfg.engine.kernels.invariant())  # the trainer's tiles (RunConfig checks)
        self.device = device
        self.dtype = dtype
        self.eos_ids = frozenset(model.args.eos_token_ids)
        self.cache: KVCache | None = KVCache.allocate(
            model.args, cfg.max_running_requests, cfg.context_length, cfg.kv_cache_dtype or dtype, device
        )
        self.runner = DecodeRunner(
            model,
            self.cache,
            max_batch=cfg.max_running_requests,
            device=device,
            mode=resolve_decode_mode(cfg.decode_mode, model, device, dtype, batch_invariant=cfg.batch_invariant),
            profile=cfg.profile,
        )
        if self.cache.k[0].element_size() == 1 and self.runner.mode not in ("graph", "triton"):
            # EngineConfig checked the settings; this is a GPU or build without the fused kernels (no Triton).
            raise ValueError(
                f"an 8-bit K/V cache needs the fused CUDA decode path (graph or triton), but this engine's decode "
                f"path is {self.decode_path} (Triton missing, or the model's head_dim unsupported): leave "
                "kv_cache_dtype at auto"
            )
        self.overlap = cfg.overlap if cfg.overlap is not None else device.type == "cuda"
        self.weights_released = False
        self._weight_shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._weight_backup: dict[str, torch.Tensor] = {}
        self.weight_version = "default"
        self.waiting: deque[SeqRequest] = deque()
        self.running: list[SeqRequest] = []
        self.paused: PauseMode | None = None
        self._lock = threading.Condition()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._stop = False
        self._inflight: Pending | None = None
        self._rows_dirty = True  # the runner's slot buffers must be rewritten before the next step
        # Decode launches until every running row has reached its length limit (max_new_tokens or the context),
        # counted from the last time the rows changed; the step that would only run past it is not launched.
        self._launches_left = 0
        self._torch_sampler = False  # some running row needs top-k/top-p/min-p or its sampling support
        self._want_support = False
        self._want_routes = False  # some running row asked for its routed experts (return_routed_experts)
        self.num_decode_steps = 0
        self.num_prefill_forwards = 0
        self.num_generated_tokens = 0
        # answer_*: the HTTP layer's time turning finished requests into an answer (it adds to them): wall, the
        # answering thread's CPU, and from the last request's finish to the answer's start. intake_s: its time from
        # a /generate's arrival to the requests' submission (reading, parsing and checking the body).
        self.host_stats: dict[str, float] = {
            "launch_s": 0.0,
            "wait_s": 0.0,
            "process_s": 0.0,
            "prefill_s": 0.0,
            "intake_s": 0.0,
            "answer_s": 0.0,
            "answer_cpu_s": 0.0,
            "answer_queue_s": 0.0,
        }

    @property
    def decode_path(self) -> str:
        return {
            "graph": "cuda_graph",
            "triton": "triton_eager",
            "eager": "eager",
            "compile": "cpu_compiled",
            "invariant": "batch_invariant",
        }[self.runner.mode]

    def profile_summary(self) -> dict[str, Any] | None:
        if not self.cfg.profile:
            return None
        steps = max(1, self.num_decode_steps)
        r = self.runner.stats
        timed = max(1.0, r["steps"])
        return {
            "decode_steps": self.num_decode_steps,
            "gpu_forward_ms_per_step": r["forward_ms"] / timed,
            "gpu_sample_ms_per_step": r["sample_ms"] / timed,
            # The device's time between a step's end and the next one's start, where the next was already queued.
            "gpu_between_steps_ms_per_step": r["between_steps_ms"] / timed,
            "host_launch_ms_per_step": self.host_stats["launch_s"] * 1e3 / steps,
            "host_wait_ms_per_step": self.host_stats["wait_s"] * 1e3 / steps,
            "host_process_ms_per_step": self.host_stats["process_s"] * 1e3 / steps,
            "prefill_s_total": self.host_stats["prefill_s"],
            "intake_s_total": self.host_stats["intake_s"],
            "answer_s_total": self.host_stats["answer_s"],
            "answer_cpu_s_total": self.host_stats["answer_cpu_s"],
            "answer_queue_s_total": self.host_stats["answer_queue_s"],
            "graph_captures": r["graph_captures"],
            "overlap": self.overlap,
        }

    # ----- interface for the HTTP layer (any thread) -----
    def stop(self) -> None:
        """Make `run` fail what is left and return; safe from a signal handler on the scheduler thread
        (the lock is re-entrant)."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()

    def submit(self, reqs: list[SeqRequest]) -> None:
        with self._lock:
            self.waiting.extend(reqs)
            self._lock.notify_all()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run fn on the scheduler thread at the next safe point (between forward passes)."""
        fut: Future[Any] = Future()
        with self._lock:
            self._calls.append((fn, fut))
            self._lock.notify_all()
        return fut

    def load(self) -> dict[str, int]:
        with self._lock:
            return {"num_reqs": len(self.running), "num_waiting_reqs": len(self.waiting)}

    # ----- scheduler thread -----
    def run(self) -> None:
        """The scheduler loop, on the calling thread, until `stop`."""
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._calls and (self.paused or not (self.waiting or self.running)):
                    self._lock.wait(timeout=0.5)
                if self._stop:
                    break
                calls = list(self._calls)
                self._calls.clear()
            if calls:
                self._safe_drain()  # control work sees every launched step finished and accounted
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller gets the exception
                    fut.set_exception(exc)
            if self.paused:
                continue
            try:
                self._step()
            except Exception as exc:
                log.exception("scheduler step failed")
                self._inflight = None
                self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
        self._safe_drain()
        self._fail_all("engine is shutting down")

    def _safe_drain(self) -> None:
        try:
            self._drain()
        except Exception as exc:
            log.exception("scheduler drain failed")
            self._inflight = None
            self._fail_all(f"engine error: {type(exc).__name__}: {exc}")

    def _step(self) -> None:
        if self.weights_released or self.cache is None:
            self._drain()
            if self.waiting or self.running:
                self._fail_all("memory is released (release_memory_occupation); call resume_memory_occupation first")
            return
        if self._can_admit():
            self._drain()
            # Every waiting prompt that fits is prefilled before the next decode step, a max_prefill_tokens chunk per
            # forward (prefill first, as SGLang schedules): with a decode step after each chunk, the first chunk's
            # rows ran ahead of the last's, and a pass ended that many steps later on a shrinking batch. Each round
            # takes at least one waiting request, so the loop ends.
            while self._can_admit():
                self._admit()
                self._compact()
        if not self.running:
            return
        self._launch()
        if not self.overlap:
            self._drain()
            return
        self._advance_answers()

    def _advance_answers(self) -> None:
        """Advance the answer of one row in CHUNK_TOKENS a step (its text, and its packed log-prob column when the
        request asked for one) while the device computes the step just launched: each row's answer then moves a
        chunk at a time, and the host work a step stays small and the same from step to step. Only with overlap:
        without it the host has no device time to hide the work behind, and decoding in chunks with their context
        costs about three times the tokens of one decode at the end."""
        decoder = self.text_decoder
        for r in self.running[self.num_decode_steps % CHUNK_TOKENS :: CHUNK_TOKENS]:
            if r.finish_reason is None:
                if decoder is not None:
                    decoder.advance(r.text, r.output_ids)
                if r.packed_column is not None:
                    r.packed_column.advance(r.reported_logprobs)

    def _launch(self) -> None:
        """Launch the next decode step; with overlap, read the previous step's tokens meanwhile."""
        if self._rows_dirty:
            self.runner.write_rows([r.row_state() for r in self.running])
            self._rows_dirty = False
            in_flight = 1 if self._inflight is not None else 0
            self._launches_left = max(self._length_limit(r) - len(r.output_ids) for r in self.running) - in_flight
        if self._inflight is not None and self._launches_left <= 0:
            # The step in flight brings every row to its length limit. With overlap, the next step would be
            # launched before reading that one, computed in full (a whole step of GPU time at batch 256), and
            # its tokens dropped; reading the step in flight finishes the rows instead.
            self._drain()
            return
        self._launches_left -= 1
        t0 = time.perf_counter()
        handle = self.runner.decode(
            len(self.running), torch_sampler=self._torch_sampler, want_support=self._want_support
        )
        self.host_stats["launch_s"] += time.perf_counter() - t0
        self.num_decode_steps += 1
        routes = self.runner.routes(len(self.running), 1) if self._want_routes else None
        previous, self._inflight = self._inflight, Pending(rows=list(self.running), handle=handle, routes=routes)
        if previous is not None and self._process(previous, advance=True):
            self._drain()  # a row finished: settle the look-ahead step before the slots change

    def _length_limit(self, r: SeqRequest) -> int:
        """The output length at which `r` finishes whatever it samples (_append_tokens' length test)."""
        return min(r.max_new_tokens, self.cfg.context_length - len(r.prompt_ids))

    def _drain(self) -> None:
        """Read the launched step, if any, then remove finished rows from their slots."""
        pending, self._inflight = self._inflight, None
        if pending is not None:
            self._process(pending, advance=True)
        self._compact()

    def _process(self, pending: Pending, *, advance: bool) -> bool:
        """Append a step's tokens to its rows; True when a row finished."""
        t0 = time.perf_counter()
        out = pending.handle.result()
        if pending.routes is not None:
            # Before the tokens are appended: cached_len is still each row's input position in this step.
            host = pending.routes.cpu().numpy()
            for i, r in enumerate(pending.rows):
                if r.return_routed_experts and r.finish_reason is None:
                    r.add_routes(host[i], r.cached_len)
        t1 = time.perf_counter()
        finished = self._append_tokens(pending.rows, out, advance=advance)
        self.host_stats["wait_s"] += t1 - t0
        self.host_stats["process_s"] += time.perf_counter() - t1
        return finished
