"""The embedded engine's scheduler: continuous batching over a static KV cache, in one thread.

All model work and every state change (weights, memory, pause) happen on the scheduler thread, between
decode steps, so nothing races with a forward pass. The HTTP layer talks to it only through
`submit`, `abort` and `call` (run a function on the scheduler thread and wait for its result).

Running sequences occupy the contiguous cache slots 0..R-1; a finished sequence's slot is refilled by
moving the last one down, so that every forward reads a slice of the cache, never a gather.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hpcrl.engine.embedded.sampling import RowParams, sample
from hpcrl.model.qwen3 import CausalLM, KVCache, token_logprobs_of_sequence

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]


class EngineStateError(RuntimeError):
    """A request that the engine's current state forbids (maps to HTTP 400)."""


@dataclass
class SeqRequest:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    return_logprob: bool
    return_sampling_mask: bool
    on_done: Callable[[SeqRequest], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    scaled_logprobs: list[float] = field(default_factory=list)
    support_logprobs: list[float] = field(default_factory=list)
    support_ids: list[list[int]] = field(default_factory=list)
    version_spans: list[list[Any]] = field(default_factory=list)  # [version, start, end)
    finish_reason: dict[str, Any] | None = None
    num_retractions: int = 0
    created_s: float = field(default_factory=time.monotonic)
    finished_s: float | None = None
    cached_len: int = 0  # tokens of prompt+output whose K/V are in the cache

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_running_requests: int = 64
    context_length: int = 1024
    max_prefill_tokens: int = 4096
    deterministic: bool = False
    onpolicy_logprobs: bool = False


class Scheduler:
    def __init__(self, model: CausalLM, cfg: SchedulerConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.eos_ids = frozenset(model.args.eos_token_ids)
        self.cache: KVCache | None = KVCache.allocate(
            model.args, cfg.max_running_requests, cfg.context_length, dtype, device
        )
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
        self.num_decode_steps = 0
        self.num_generated_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="hpcrl-scheduler", daemon=True)

    # ----- interface for the HTTP layer (any thread) -----
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=30)

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
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                while not self._stop and not self._calls and (self.paused or not (self.waiting or self.running)):
                    self._lock.wait(timeout=0.5)
                if self._stop:
                    break
                calls = list(self._calls)
                self._calls.clear()
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
                self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
        self._fail_all("engine is shutting down")

    def _step(self) -> None:
        if self.weights_released or self.cache is None:
            if self.waiting or self.running:
                self._fail_all("memory is released (release_memory_occupation); call resume_memory_occupation first")
            return
        self._admit()
        if self.running:
            self._decode()

    def _take_waiting(self) -> list[SeqRequest]:
        free = self.cfg.max_running_requests - len(self.running)
        if free <= 0:
            return []
        # Deterministic mode forms batches only from an idle engine, so one /generate call on an
        # idle engine always meets the same batch composition and gives bit-identical results.
        if self.cfg.deterministic and self.running:
            return []
        taken: list[SeqRequest] = []
        budget = self.cfg.max_prefill_tokens
        with self._lock:
            while self.waiting and len(taken) < free:
                need = len(self.waiting[0].all_ids)
                if taken and need > budget:
                    break
                budget -= need
                taken.append(self.waiting.popleft())
        return taken

    def _admit(self) -> None:
        new = self._take_waiting()
        if not new:
            return
        ready = [r for r in new if not self._finish_if_done(r, before_first_token=True)]
        if not ready:
            return
        first_slot = len(self.running)
        self.running.extend(ready)
        lengths = [len(r.all_ids) for r in ready]
        width = max(lengths)
        ids = torch.zeros(len(ready), width, dtype=torch.long)
        for i, r in enumerate(ready):
            ids[i, : lengths[i]] = torch.tensor(r.all_ids)
        ids = ids.to(self.device)
        start = torch.zeros(len(ready), dtype=torch.long, device=self.device)
        last = torch.tensor(lengths, device=self.device) - 1
        assert self.cache is not None
        logits = self.model.forward_cached(ids, self.cache, first_slot, start, last)
        for r, n in zip(ready, lengths, strict=True):
            r.cached_len = n
        self._append_tokens(ready, logits)

    def _decode(self) -> None:
        rows = self.running
        ids = torch.tensor([[r.all_ids[-1]] for r in rows], device=self.device)
        start = torch.tensor([r.cached_len for r in rows], device=self.device)
        last = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        assert self.cache is not None
        logits = self.model.forward_cached(ids, self.cache, 0, start, last)
        for r in rows:
            r.cached_len += 1
        self.num_decode_steps += 1
        self._append_tokens(list(rows), logits)

    def _append_tokens(self, rows: list[SeqRequest], logits: torch.Tensor) -> None:
        dev = self.device
        params = RowParams(
            temperature=torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=dev),
            top_k=torch.tensor([r.top_k for r in rows], dtype=torch.int64, device=dev),
            top_p=torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev),
            min_p=torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=dev),
            seeds=torch.tensor([r.seed for r in rows], dtype=torch.int64, device=dev),
            steps=torch.tensor([len(r.output_ids) for r in rows], dtype=torch.int64, device=dev),
        )
        want_support = any(r.return_sampling_mask for r in rows)
        out = sample(logits, params, want_support=want_support)
        tokens = out.token_ids.tolist()
        lps = out.logprobs.tolist()
        scaled = out.scaled_logprobs.tolist()
        support_lps = out.support_logprobs.tolist() if out.support_logprobs is not None else None
        done: list[SeqRequest] = []
        for i, r in enumerate(rows):
            r.output_ids.append(tokens[i])
            r.logprobs.append(lps[i])
            r.scaled_logprobs.append(scaled[i])
            if r.return_sampling_mask:
                assert support_lps is not None
                r.support_logprobs.append(support_lps[i])
                if out.support_mask is not None:
                    r.support_ids.append(out.support_mask[i].nonzero()[:, 0].tolist())
                else:
                    r.support_ids.append([])  # empty = the whole vocabulary (no filtering)
            self._stamp_version(r)
            self.num_generated_tokens += 1
            if self._finish_if_done(r):
                done.append(r)
        for r in done:
            self._release_slot(r)
            self._complete(r)

    def _stamp_version(self, r: SeqRequest) -> None:
        n = len(r.output_ids)
        if r.version_spans and r.version_spans[-1][0] == self.weight_version and r.version_spans[-1][2] == n - 1:
            r.version_spans[-1][2] = n
        else:
            r.version_spans.append([self.weight_version, n - 1, n])

    def _finish_if_done(self, r: SeqRequest, *, before_first_token: bool = False) -> bool:
        if before_first_token:
            if r.max_new_tokens == 0 or len(r.output_ids) >= r.max_new_tokens:
                r.finish_reason = {"type": "length", "length": r.max_new_tokens}
                self._complete(r)
                return True
            return False
        tok = r.output_ids[-1]
        if tok in r.stop_token_ids or (not r.ignore_eos and tok in self.eos_ids):
            r.finish_reason = {"type": "stop", "matched": tok}
        elif len(r.output_ids) >= r.max_new_tokens or len(r.all_ids) >= self.cfg.context_length:
            r.finish_reason = {"type": "length", "length": len(r.output_ids)}
        else:
            return False
        return True

    def _release_slot(self, r: SeqRequest) -> None:
        i = self.running.index(r)
        last = len(self.running) - 1
        if i != last and self.cache is not None:
            self.cache.move_slot(last, i)
            self.running[i] = self.running[last]
        self.running.pop()

    def _complete(self, r: SeqRequest) -> None:
        r.finished_s = time.monotonic()
        if self.cfg.onpolicy_logprobs and r.output_ids and r.return_logprob and not self.weights_released:
            # Score the finished sequence exactly as the trainer does (one unpadded sequence through
            # the same forward), so the train/rollout log-prob gap is zero, not merely small.
            ids = torch.tensor(r.all_ids, device=self.device)
            r.logprobs = token_logprobs_of_sequence(self.model, ids, len(r.prompt_ids)).tolist()
        try:
            r.on_done(r)
        except Exception:  # noqa: BLE001 - a broken callback must not kill the scheduler
            log.exception("completion callback failed for %s", r.rid)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            victims = self.running + list(self.waiting)
            self.running = []
            self.waiting.clear()
        for r in victims:
            r.finish_reason = {"type": "abort", "message": message, "status_code": 500}
            self._complete(r)

    # ----- control operations: run on the scheduler thread through `call` -----
    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort requests whose id starts with rid (SGLang matches by prefix); returns how many."""

        def match(r: SeqRequest) -> bool:
            return abort_all or (rid != "" and r.rid.startswith(rid))

        with self._lock:
            waiting = [r for r in self.waiting if match(r)]
            self.waiting = deque(r for r in self.waiting if not match(r))
        running = [r for r in self.running if match(r)]
        for r in running:
            self._release_slot(r)
        for r in waiting + running:
            r.finish_reason = {"type": "abort", "message": "Abort request " + ("(all)" if abort_all else rid)}
            self._complete(r)
        return len(waiting) + len(running)

    def pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self.abort(abort_all=True)
        elif mode == "retract":
            # Running requests go back to the front of the queue with what they generated so far;
            # after continue they prefill prompt + partial output again (under the weights of then).
            with self._lock:
                for r in reversed(self.running):
                    r.num_retractions += 1
                    r.cached_len = 0
                    self.waiting.appendleft(r)
            self.running = []
        self.paused = mode

    def resume_generation(self) -> None:
        self.paused = None

    def flush_cache(self) -> None:
        if self.running or self.waiting:
            raise EngineStateError(
                f"cannot flush the cache while {len(self.running)} requests run and {len(self.waiting)} wait"
            )

    def set_weight_version(self, version: str, abort_all_requests: bool) -> None:
        if abort_all_requests:
            self.abort(abort_all=True)
        self.weight_version = version

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def release_memory(self, tags: list[str], *, weights_cpu_backup: bool) -> dict[str, int]:
        if self.running or self.waiting:
            raise EngineStateError(
                f"release_memory_occupation needs an idle engine, but {len(self.running)} requests run and "
                f"{len(self.waiting)} wait: pause_generation(mode='abort') or wait for them first"
            )
        freed: dict[str, int] = {}
        if "kv_cache" in tags and self.cache is not None:
            freed["kv_cache"] = self.cache.nbytes()
            self.cache = None
        if "weights" in tags and not self.weights_released:
            total = 0
            for name, p in self.model.named_parameters():
                self._weight_shapes[name] = (p.shape, p.dtype)
                if weights_cpu_backup:
                    self._weight_backup[name] = p.detach().to("cpu", copy=True)
                total += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.weights_released = True
            freed["weights"] = total
        if "cuda_graph" in tags:
            freed["cuda_graph"] = 0  # the embedded engine captures no CUDA graphs yet
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def resume_memory(self, tags: list[str]) -> dict[str, int]:
        restored: dict[str, int] = {}
        if "weights" in tags and self.weights_released:
            total = 0
            for name, p in self.model.named_parameters():
                shape, dtype = self._weight_shapes[name]
                backup = self._weight_backup.pop(name, None)
                # Without a backup the contents are undefined, as with SGLang's memory saver: the
                # trainer pushes weights next. Zeros keep that state deterministic.
                p.data = (
                    backup.to(self.device)
                    if backup is not None
                    else torch.zeros(shape, dtype=dtype, device=self.device)
                )
                total += p.numel() * p.element_size()
            self.weights_released = False
            restored["weights"] = total
        if "kv_cache" in tags and self.cache is None:
            self.cache = KVCache.allocate(
                self.model.args, self.cfg.max_running_requests, self.cfg.context_length, self.dtype, self.device
            )
            restored["kv_cache"] = self.cache.nbytes()
        if "cuda_graph" in tags:
            restored["cuda_graph"] = 0
        return restored
