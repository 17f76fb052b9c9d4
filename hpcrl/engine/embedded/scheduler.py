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

import gc
import logging
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.embedded import kernels
from hpcrl.engine.embedded.detokenize import CHUNK_TOKENS, RowText, TextDecoder
from hpcrl.engine.embedded.runner import DecodeRunner, RowState, StepHandle, StepOutput
from hpcrl.engine.protocol.answers import GrowingPackedColumn
from hpcrl.model import invariant
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
    on_done: Callable[[SeqRequest], object]
    logprob_scaled: bool = False  # report the temperature-scaled log-probs (return_scaled_logprob)
    output_ids: list[int] = field(default_factory=list)
    # Doubles stored inline, not float objects: a row's log-probs arrive one a step, between every other row's, so
    # as list items they lie scattered over the heap and the answer that walks them waits on memory. H200 host,
    # 256 x 512 answer: 125 ms of CPU a pass with lists, 57 ms with arrays.
    logprobs: array[float] = field(default_factory=lambda: array("d"))
    scaled_logprobs: array[float] = field(default_factory=lambda: array("d"))
    support_logprobs: list[float] = field(default_factory=list)
    support_ids: list[list[int]] = field(default_factory=list)
    version_spans: list[list[Any]] = field(default_factory=list)  # [version, start, end)
    finish_reason: dict[str, Any] | None = None
    num_retractions: int = 0
    created_s: float = field(default_factory=time.monotonic)
    finished_s: float | None = None
    answered_s: float | None = None  # handed to on_done: after any re-score, which finished_s precedes
    cached_len: int = 0  # tokens of prompt+output whose K/V are in the cache
    sampled_logprobs: list[float] | None = None  # the sampled log-probs, when `logprobs` holds a re-score
    text: RowText = field(default_factory=RowText)  # the output's text so far (the scheduler's TextDecoder)
    # The reported log-prob column packed so far, when the request asked for the packed wire (None: not asked).
    packed_column: GrowingPackedColumn | None = None

    @property
    def reported_logprobs(self) -> array[float]:
        """The log-prob column the answer reports: the temperature-scaled one for return_scaled_logprob."""
        return self.scaled_logprobs if self.logprob_scaled else self.logprobs

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def row_state(self) -> RowState:
        return RowState(
            token=self.output_ids[-1] if self.output_ids else self.prompt_ids[-1],
            position=self.cached_len,
            seed=self.seed,
            step=len(self.output_ids),
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
        )


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The scheduler's view of the engine section: its settings as `EngineConfig` declares, defaults and checks
    them, plus the one thing only the loaded model decides, the context length."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    context_length: int
    """engine.context_length, or the model's max_position_embeddings where that is null."""

    @property
    def max_running_requests(self) -> int:
        return self.engine.max_running_requests

    @property
    def max_prefill_tokens(self) -> int:
        return self.engine.max_prefill_tokens

    @property
    def deterministic(self) -> bool:
        return self.engine.deterministic

    @property
    def logprobs(self) -> str:
        """`sampled`, or `recompute`: re-score finished sequences (see _complete)."""
        return self.engine.logprobs

    @property
    def batch_invariant(self) -> bool:
        """The "invariant" decode mode (hpcrl.model.invariant)."""
        return self.engine.batch_invariant

    @property
    def kv_cache_dtype(self) -> torch.dtype | None:
        """None: the model's dtype."""
        return torch.float8_e4m3fn if self.engine.kv_cache_dtype == "fp8_e4m3" else None

    @property
    def decode_mode(self) -> str:
        return self.engine.decode_mode

    @property
    def overlap(self) -> bool | None:
        """Launch step t+1 before reading step t (None: on for CUDA, where launches are asynchronous)."""
        return {"auto": None, "on": True, "off": False}[self.engine.decode_overlap]

    @property
    def profile(self) -> bool:
        return self.engine.decode_profile


def resolve_decode_mode(
    requested: str, model: CausalLM, device: torch.device, dtype: torch.dtype, *, batch_invariant: bool = False
) -> str:
    if batch_invariant:
        reason = invariant.supported_reason(device, dtype) or invariant.unsupported_model(model.args)
        if reason is not None:
            raise ValueError(f"--batch-invariant: {reason}")
        if requested not in ("auto", "eager"):
            raise ValueError(f"--batch-invariant runs its own decode step; --decode-mode {requested} cannot apply")
        invariant.pin_backend_numerics(device)
        return "invariant"
    if requested not in ("auto", "eager", "triton", "graph", "compile"):
        raise ValueError(f"decode mode must be auto, eager, triton, graph or compile, got {requested!r}")
    if requested == "compile":
        if device.type == "cpu":
            return "compile"  # torch.compile of the CPU step (opt-in: it compiles for seconds)
        log.warning("decode mode compile is for the CPU; using the default mode for %s", device.type)
        requested = "auto"
    if device.type != "cuda":
        return "eager"  # the fused kernels are Triton GPU code
    reason = kernels.supported(model.args.head_dim, dtype)
    if reason is not None:
        if requested in ("triton", "graph"):
            log.warning("decode mode %s is unavailable (%s); using the eager model", requested, reason)
        return "eager"
    return "graph" if requested == "auto" else requested


@dataclass
class _Pending:
    """A launched decode step whose tokens the host has not read yet."""

    rows: list[SeqRequest]
    handle: StepHandle


class Scheduler:
    def __init__(self, model: CausalLM, cfg: SchedulerConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        # Set by the server once its tokenizer is loaded; None: no text is decoded on this thread.
        self.text_decoder: TextDecoder | None = None
        self.cfg = cfg
        kernels.configure(cfg.engine.kernels)  # process-wide, like the CUDA graphs that capture the kernels
        self.device = device
        self.dtype = dtype
        self.eos_ids = frozenset(model.args.eos_token_ids)
        window = model.args.min_window
        if window is not None and cfg.context_length > window:
            # The decode kernels attend to the whole cache; up to the window that is what the model computes.
            raise ValueError(
                f"this model attends within a sliding window of {window} tokens, which the embedded engine's "
                f"attention does not compute; set engine.context_length to at most {window} "
                f"(it is {cfg.context_length}), or serve the model with SGLang (engine.kind: sglang)"
            )
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
        self._inflight: _Pending | None = None
        self._rows_dirty = True  # the runner's slot buffers must be rewritten before the next step
        # Decode launches until every running row has reached its length limit (max_new_tokens or the context),
        # counted from the last time the rows changed; the step that would only run past it is not launched.
        self._launches_left = 0
        self._torch_sampler = False  # some running row needs top-k/top-p/min-p or its sampling support
        self._want_support = False
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
        previous, self._inflight = self._inflight, _Pending(rows=list(self.running), handle=handle)
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

    def _process(self, pending: _Pending, *, advance: bool) -> bool:
        """Append a step's tokens to its rows; True when a row finished."""
        t0 = time.perf_counter()
        out = pending.handle.result()
        t1 = time.perf_counter()
        finished = self._append_tokens(pending.rows, out, advance=advance)
        self.host_stats["wait_s"] += t1 - t0
        self.host_stats["process_s"] += time.perf_counter() - t1
        return finished

    def _can_admit(self) -> bool:
        if not self.waiting or len(self.running) >= self.cfg.max_running_requests:
            return False
        # Deterministic mode forms batches only from an idle engine, so one /generate call on an
        # idle engine always meets the same batch composition and gives bit-identical results.
        return not (self.cfg.deterministic and self.running)

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
        prompts: set[tuple[int, ...]] = set()
        with self._lock:
            while self.waiting and len(taken) < free:
                # A sequence already taken (a group's other samples) is copied from its prefill, not recomputed:
                # it costs no budget, and a group is not split over two forwards that would each run its prompt.
                ids = tuple(self.waiting[0].all_ids)
                need = 0 if ids in prompts else len(ids)
                if taken and need > budget:
                    break
                budget -= need
                prompts.add(ids)
                taken.append(self.waiting.popleft())
        return taken

    def _admit(self) -> None:
        new = self._take_waiting()
        if not new:
            return
        ready = [r for r in new if not self._finish_if_done(r, before_first_token=True)]
        if not ready:
            return
        t0 = time.perf_counter()
        # The samples of one prompt (a group's n) share its prefill: the first of each distinct sequence
        # runs it, the others get a copy of its K/V rows and its logits row. Slots: the prefilled rows
        # first, then the copies.
        owner: dict[tuple[int, ...], int] = {}
        lead_of = [owner.setdefault(tuple(r.all_ids), k) for k, r in enumerate(ready)]
        leads = [k for k, o in enumerate(lead_of) if o == k]
        copies = [k for k, o in enumerate(lead_of) if o != k]
        ready = [ready[k] for k in leads + copies]
        first_slot = len(self.running)
        self.running.extend(ready)
        self._rows_dirty = True
        heads = ready[: len(leads)]
        lengths = [r.num_tokens for r in heads]
        width = max(lengths)
        # One flat array, not torch.tensor of nested lists: that walks every int in Python (4-6 ms for 256 x 128
        # on a 2-core CPU, against ~1.4 ms).
        flat = array("q")
        for r, n in zip(heads, lengths, strict=True):
            flat.extend(r.prompt_ids)
            flat.extend(r.output_ids)
            flat.frombytes(bytes(8 * (width - n)))  # zero padding: 8 bytes an id
        ids = torch.frombuffer(flat, dtype=torch.int64).view(len(heads), width)
        last = torch.tensor(lengths) - 1
        logits = self.runner.prefill(ids.to(self.device), first_slot, last.to(self.device))
        self.num_prefill_forwards += 1
        if copies:
            assert self.cache is not None
            row_of_lead = {k: row for row, k in enumerate(leads)}
            sources = [row_of_lead[lead_of[k]] for k in copies]
            copy_slots = range(first_slot + len(leads), first_slot + len(ready))
            self.cache.copy_prefix([first_slot + row for row in sources], list(copy_slots), width)
            logits = logits[torch.tensor(list(range(len(leads))) + sources, device=logits.device)]
        for r in ready:
            r.cached_len = r.num_tokens
        self._refresh_sampler_flags()
        out = self.runner.sample_prefill(
            logits,
            [r.row_state() for r in ready],
            torch_sampler=any(r.filtered or r.return_sampling_mask for r in ready),
            want_support=any(r.return_sampling_mask for r in ready),
        )
        self._append_tokens(ready, out, advance=False)
        self.host_stats["prefill_s"] += time.perf_counter() - t0

    def _refresh_sampler_flags(self) -> None:
        self._want_support = any(r.return_sampling_mask for r in self.running)
        self._torch_sampler = self._want_support or any(r.filtered for r in self.running)

    def _append_tokens(self, rows: list[SeqRequest], out: StepOutput, *, advance: bool) -> bool:
        """Record one sampled token per row; `advance` moves cached_len past the step's input token.

        This runs for every row of every step, so the version stamp and the finish test are inlined.
        """
        finished = False
        mask = out.support_mask
        version = self.weight_version
        context_length = self.cfg.context_length
        appended = 0
        for i, r in enumerate(rows):
            if r.finish_reason is not None:
                continue  # finished (or aborted) before this look-ahead step: its token is dropped
            tok = out.tokens[i]
            outputs = r.output_ids
            outputs.append(tok)
            r.logprobs.append(out.logprobs[i])
            r.scaled_logprobs.append(out.scaled_logprobs[i])
            if advance:
                r.cached_len += 1
            if r.return_sampling_mask:
                assert out.support_logprobs is not None
                r.support_logprobs.append(out.support_logprobs[i])
                # empty = the whole vocabulary (no filtering)
                r.support_ids.append(mask[i].nonzero()[:, 0].tolist() if mask is not None else [])
            n = len(outputs)
            spans = r.version_spans
            if spans and spans[-1][0] == version and spans[-1][2] == n - 1:
                spans[-1][2] = n
            else:
                spans.append([version, n - 1, n])
            appended += 1
            if (
                n >= r.max_new_tokens
                or tok in r.stop_token_ids
                or tok in self.eos_ids
                or len(r.prompt_ids) + n >= context_length
            ) and self._finish_if_done(r):
                finished = True
        self.num_generated_tokens += appended
        return finished

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
        elif len(r.output_ids) >= r.max_new_tokens or r.num_tokens >= self.cfg.context_length:
            r.finish_reason = {"type": "length", "length": len(r.output_ids)}
        else:
            return False
        return True

    def _compact(self) -> None:
        """Complete rows that have a finish reason and close the gaps they leave in slots 0..R-1."""
        done = [r for r in self.running if r.finish_reason is not None]
        if not done:
            return
        keep = len(self.running) - len(done)
        holes = [i for i in range(keep) if self.running[i].finish_reason is not None]
        movers = [i for i in range(keep, len(self.running)) if self.running[i].finish_reason is None]
        for dst, src in zip(holes, movers, strict=True):
            if self.cache is not None:
                self.cache.move_slot(src, dst)
            self.running[dst] = self.running[src]
        del self.running[keep:]
        self._rows_dirty = True
        self._refresh_sampler_flags()
        for r in done:
            self._complete(r)

    def _complete(self, r: SeqRequest) -> None:
        r.finished_s = time.monotonic()
        if self.cfg.logprobs == "recompute" and r.output_ids and r.return_logprob and not self.weights_released:
            # A relabel, not on-policy: the tokens were drawn from the decode step's distribution, the reported
            # log-probs are the standard forward's of the whole sequence. The sampled ones travel along, so
            # the difference is measured (rollout/recompute_abs_diff), never hidden.
            ids = torch.tensor(r.all_ids, device=self.device)
            r.sampled_logprobs = r.logprobs.tolist()
            r.logprobs = array("d", token_logprobs_of_sequence(self.model, ids, len(r.prompt_ids)).tolist())
        r.answered_s = time.monotonic()
        try:
            r.on_done(r)
        except Exception:  # noqa: BLE001 - a broken callback must not kill the scheduler
            log.exception("completion callback failed for %s", r.rid)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            victims = self.running + list(self.waiting)
            self.running = []
            self.waiting.clear()
        self._inflight = None
        self._rows_dirty = True
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
        for r in waiting + running:
            r.finish_reason = {"type": "abort", "message": "Abort request " + ("(all)" if abort_all else rid)}
        for r in waiting:
            self._complete(r)
        self._compact()  # completes the running ones
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
            self._rows_dirty = True
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

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's shape, also while the weights are released (their tensors are then empty)."""
        if self.weights_released:
            return {n: tuple(shape) for n, (shape, _) in self._weight_shapes.items()}
        return {n: tuple(p.shape) for n, p in self.model.named_parameters()}

    def release_memory(self, tags: list[str], *, weights_cpu_backup: bool) -> dict[str, int]:
        if self.running or self.waiting:
            raise EngineStateError(
                f"release_memory_occupation needs an idle engine, but {len(self.running)} requests run and "
                f"{len(self.waiting)} wait: pause_generation(mode='abort') or wait for them first"
            )
        freed: dict[str, int] = {}
        cuda = self.device.type == "cuda"
        # Captured graphs hold raw addresses of the cache, the weights and their own memory pool:
        # releasing any of them makes the graphs invalid, so they go first (re-captured on demand).
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        self.runner.reset_graphs()
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
        if "cuda_graph" in tags:
            freed["cuda_graph"] = reserved - torch.cuda.memory_reserved(self.device) if cuda else 0
        if "kv_cache" in tags and self.cache is not None:
            freed["kv_cache"] = self.cache.nbytes()
            self.cache = None
            self.runner.set_cache(None)
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
        if cuda:
            # Dropped tensors go back to torch's caching allocator, not to the device: empty_cache
            # returns them, so the trainer (another process) can use the memory.
            gc.collect()
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
            self.runner.reset_graphs()  # new weight storage: graphs are re-captured against it
            restored["weights"] = total
        if "kv_cache" in tags and self.cache is None:
            self.cache = KVCache.allocate(
                self.model.args,
                self.cfg.max_running_requests,
                self.cfg.context_length,
                self.cfg.kv_cache_dtype or self.dtype,
                self.device,
            )
            self.runner.set_cache(self.cache)
            restored["kv_cache"] = self.cache.nbytes()
        if "cuda_graph" in tags:
            restored["cuda_graph"] = 0
        return restored
