"""The embedded engine: an aiohttp server that answers SGLang's RL contract from hpcrl's own model code.

    hpcrl engine serve --model DIR [--host 127.0.0.1] [--port 30000] [--device cpu|cuda] [--dtype float32|bfloat16]

The HTTP layer (an event loop on a thread of its own) validates requests (with the same protocol types
the client uses) and hands work to the scheduler, which runs on the main thread; blocking control work
(rendezvous, weight receive) runs in a thread pool so the event loop keeps answering /health meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import signal
import stat
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from aiohttp import web

from hpcrl.config import to_dict
from hpcrl.engine import jsonwire
from hpcrl.engine import protocol as P
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.embedded.detokenize import TextDecoder
from hpcrl.engine.embedded.kernels import launch
from hpcrl.engine.embedded.requests import EngineStateError, SeqRequest
from hpcrl.engine.embedded.scheduler import Scheduler, SchedulerConfig
from hpcrl.engine.embedded.weights import WeightReceiver
from hpcrl.engine.kernels_config import Override, describe
from hpcrl.engine.portcheck import bind_error, check_port_free
from hpcrl.model.hf import load_model, parse_dtype
from hpcrl.model.qwen3 import ModelArgs

log = logging.getLogger("hpcrl.engine")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """One engine process: the engine section whole (declared, defaulted and checked once, by EngineConfig), and
    where this process serves it."""

    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    kernel_overrides: tuple[Override, ...] = ()
    """The engine.kernels knobs an HPCRL_ENGINE_* variable set (engine.kernels already holds their values)."""
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    random_seed: int = 0
    weight_version: str = "default"
    ignore_sigterm: bool = False

    def __post_init__(self) -> None:
        # Checked before the model loads: a bad flag must not cost a model load.
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port; use 1..65535")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty; put the key in the --api-key-file or HPCRL_ENGINE_API_KEY")
        if not self.api_key and not is_loopback(self.host):
            raise ValueError(
                f"--host {self.host} is reachable from other machines, and this engine has no API key, so anyone "
                f"could drive it: give it a key with --api-key-file FILE (mode 0600) or the environment variable "
                f"{API_KEY_ENV}, or bind to loopback (--host 127.0.0.1)"
            )

    def info(self) -> dict[str, Any]:
        """What /server_info reports of the settings: the engine section whole, and this process's place."""
        return {
            **to_dict(self.engine),
            "model": self.model,
            "host": self.host,
            "port": self.port,
            "random_seed": self.random_seed,
            "weight_version": self.weight_version,
            "kernel_overrides": [str(o) for o in self.kernel_overrides],
        }


API_KEY_ENV = "HPCRL_ENGINE_API_KEY"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def resolve_api_key(*, api_key: str | None, api_key_file: str | None) -> str | None:
    """The engine's key from --api-key, --api-key-file or HPCRL_ENGINE_API_KEY (first given wins).

    The variable is removed from this process's environment, so the engine's own children do not inherit it.
    """
    from_env = os.environ.pop(API_KEY_ENV, None)
    if api_key is not None and api_key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if api_key is not None:
        return api_key
    if api_key_file is not None:
        return _read_key_file(api_key_file)
    return from_env if from_env else None


def _read_key_file(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: cannot open it ({exc.strerror})") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"--api-key-file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(
                f"--api-key-file {path} has mode {stat.S_IMODE(st.st_mode):o}: others can read the key; "
                f"run `chmod 600 {path}`"
            )
        raw = f.read(4097)
    if len(raw) > 4096:
        raise ValueError(f"--api-key-file {path} is over 4 KiB; it holds one key on one line")
    try:
        key = raw.decode().strip()
    except UnicodeDecodeError as exc:
        raise ValueError(f"--api-key-file {path} is not UTF-8 text") from exc
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"--api-key-file {path} must hold one key (no spaces) on one line")
    return key


def _json_response(data: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=jsonwire.dumps(data), status=status, content_type="application/json")


def _error(message: str, status: int = 400) -> web.Response:
    return _json_response({"error": {"message": message}, "success": False, "message": message}, status=status)


def _ok(message: str, **extra: Any) -> web.Response:
    return _json_response({"success": True, "status": "ok", "message": message, **extra})


class EmbeddedEngine:
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

    # ----- helpers -----
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

    def _seed_for(self, params: P.SamplingParams, sample_index: int, rid: str) -> int:
        if params.sampling_seed is not None:
            # Samples of one n>1 request must differ, yet stay a function of the request's seed.
            return params.sampling_seed if sample_index == 0 else (params.sampling_seed * 1_000_003 + sample_index)
        self._request_counter += 1
        return (self.cfg.random_seed * 1_000_000_007 + self._request_counter) & ((1 << 62) - 1)

    def _prompts(self, req: P.GenerateRequest) -> list[list[int]]:
        if req.input_ids is not None:
            ids = req.input_ids
            batch = cast("list[list[int]]", ids if req.is_batch else [ids])  # is_batch: a list of lists
        else:
            texts = req.text if isinstance(req.text, list) else [req.text]
            for i, t in enumerate(texts):
                if isinstance(t, str) and _has_lone_surrogate(t):
                    raise ValueError(f"text {i} holds a lone UTF-16 surrogate, which is not text; send valid Unicode")
            batch = [self.tokenizer.encode(t, add_special_tokens=False) if self.tokenizer else [] for t in texts]
        if len(batch) * req.n > MAX_SEQUENCES_PER_REQUEST:
            raise ValueError(
                f"the request asks for {len(batch)} prompt(s) x n={req.n} = {len(batch) * req.n} sequences, more than "
                f"{MAX_SEQUENCES_PER_REQUEST} in one request; split it"
            )
        vocab = self.model.args.vocab_size
        limit = self.scheduler.cfg.context_length
        for i, prompt in enumerate(batch):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; send at least one token")
            if max(prompt) >= vocab:  # at C speed: a 256 x 128 batch is 32k ids
                bad = next(t for t in prompt if t >= vocab)
                raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary (size {vocab})")
            need = len(prompt) + req.params_for(i if req.is_batch else 0).max_new_tokens
            if need > limit:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens and max_new_tokens asks for "
                    f"{req.params_for(i if req.is_batch else 0).max_new_tokens} more: {need} > the context length "
                    f"{limit}; shorten the prompt or lower max_new_tokens"
                )
        return batch

    def _result(self, r: SeqRequest, text_in_logprobs: bool, packed: bool) -> dict[str, Any]:
        column = r.reported_logprobs if r.return_logprob else None
        if column is not None and len(column) != len(r.output_ids):
            raise RuntimeError(
                f"request {r.rid} has {len(column)} log-probs for {len(r.output_ids)} output tokens: an engine bug "
                "(the scheduler appends one of each a step); please report it"
            )
        triples: list[tuple[float, int, str | None]] | None = None
        packed_text: str | None = None
        if column is not None and packed:
            # Most of the column was packed while the row decoded (GrowingPackedColumn); the rest is packed here.
            packed_text = r.packed_column.packed(column) if r.packed_column is not None else P.pack_logprobs(column)
        elif column is not None:
            texts = [self.tokenizer.decode([t]) for t in r.output_ids] if text_in_logprobs and self.tokenizer else None
            triples = P.logprob_triples(column.tolist(), r.output_ids, texts)
        # Written from the scheduler's records, which it keeps in the contract's shapes: a checked GenerateResult of
        # each first took most of a 256-row answer's time.
        return P.result_object(
            text=decoder.text(r.text, r.output_ids) if (decoder := self.scheduler.text_decoder) else None,
            output_ids=r.output_ids,
            rid=r.rid,
            finish_reason=r.finish_reason or {"type": "abort", "message": "no finish reason"},
            prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.output_ids),
            weight_version=self.scheduler.weight_version,
            num_retractions=r.num_retractions,
            e2e_latency_s=(r.finished_s or time.monotonic()) - r.created_s,
            logprob_triples=triples,
            packed_logprobs=packed_text,
            weight_versions=[P.span_object(v, s, e) for v, s, e in r.version_spans],
            sampling_mask=r.support_ids if r.return_sampling_mask else None,
            support_logprobs=r.support_logprobs if r.return_sampling_mask else None,
            extra_meta={"hpcrl_sampled_logprobs": r.sampled_logprobs}
            if r.sampled_logprobs is not None and r.return_logprob
            else None,
        )

    # ----- handlers -----
    async def generate(self, request: web.Request) -> web.Response:
        intake0 = time.perf_counter()
        if (request.content_length or 0) > MAX_GENERATE_BODY_BYTES:
            # The app's limit is for weight pushes; a prompt batch this large is a mistake or an attack.
            return _error(
                f"the /generate body has {request.content_length} bytes, more than {MAX_GENERATE_BODY_BYTES}; "
                "send fewer or shorter prompts per request",
                status=413,
            )
        body = await _json_body(request)
        if not isinstance(body, dict):
            return _error("the /generate body must be a JSON object")
        body = dict(body)
        logprob_scaled = bool(body.pop("return_scaled_logprob", False))
        try:
            req = P.GenerateRequest.from_dict(body)
            if self.scheduler.weights_released or self.scheduler.cache is None:
                raise ValueError(
                    "engine memory is released (release_memory_occupation); call resume_memory_occupation "
                    "before generating"
                )
            if self.weights.nonfinite:
                raise ValueError(
                    f"weight {sorted(self.weights.nonfinite)[0]!r} holds non-finite values from the last update; "
                    "push finite weights before generating"
                )
            if req.stream:
                raise ValueError("stream=true is not supported by the embedded engine; send stream=false")
            if req.input_ids is not None:
                prompts = self._prompts(req)
            else:
                loop = asyncio.get_running_loop()
                prompts = await loop.run_in_executor(self._tokenize_pool, self._prompts, req)
        except (ValueError, TypeError, RecursionError) as exc:
            return _error(str(exc))
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[SeqRequest]] = []
        seqs: list[SeqRequest] = []
        base_rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(prompts)
        # One read of the OS's randomness for the batch's fresh ids, not one a prompt (256 system calls).
        fresh = secrets.token_hex(8 * len(prompts))
        for i, prompt in enumerate(prompts):
            params = req.params_for(i if req.is_batch else 0)
            for j in range(req.n):
                base = base_rids[i] or fresh[16 * i : 16 * i + 16]
                rid = base if req.n == 1 else f"{base}-{j}"
                fut: asyncio.Future[SeqRequest] = loop.create_future()

                def done(r: SeqRequest, fut: asyncio.Future[SeqRequest] = fut) -> None:
                    loop.call_soon_threadsafe(_resolve, fut, r)

                seq = SeqRequest(
                    rid=rid,
                    prompt_ids=list(prompt),
                    max_new_tokens=params.max_new_tokens,
                    temperature=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    min_p=params.min_p,
                    seed=self._seed_for(params, j, rid),
                    stop_token_ids=frozenset(params.stop_token_ids),
                    ignore_eos=params.ignore_eos,
                    return_logprob=req.return_logprob,
                    return_sampling_mask=req.return_sampling_mask,
                    on_done=done,
                )
                seq.logprob_scaled = logprob_scaled
                if req.return_logprob and req.return_logprob_packed:
                    seq.packed_column = P.GrowingPackedColumn()
                seqs.append(seq)
                futures.append(fut)
        self.scheduler.submit(seqs)
        self.scheduler.host_stats["intake_s"] += time.perf_counter() - intake0
        try:
            finished = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            # The client went away: SGLang aborts a disconnected request, and so do we.
            for s in seqs:
                self.scheduler.call(functools.partial(self.scheduler.abort, s.rid))
            raise
        t0, cpu0, mono0 = time.perf_counter(), time.thread_time(), time.monotonic()
        # The answer is acyclic: collections it would set off (each scanning the model's heap) find nothing.
        with jsonwire.gc_paused():
            results = [self._result(r, req.return_text_in_logprobs, req.return_logprob_packed) for r in finished]
            response = _json_response(results if req.returns_list else results[0])
        stats = self.scheduler.host_stats
        stats["answer_s"] += time.perf_counter() - t0
        # Wall time above CPU time is time this thread waited (the GIL, the OS); the queue is the last request's
        # hand-over reaching this coroutine.
        stats["answer_cpu_s"] += time.thread_time() - cpu0
        stats["answer_queue_s"] += mono0 - max(r.answered_s or mono0 for r in finished)
        return response

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.scheduler.paused or self.scheduler.weights_released:
            return web.Response(text="")  # alive; generation is held on purpose
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[SeqRequest] = loop.create_future()
        seq = SeqRequest(
            rid=f"HEALTH_CHECK_{time.time()}",
            prompt_ids=[0],
            max_new_tokens=1,
            temperature=0.0,
            top_k=-1,
            top_p=1.0,
            min_p=0.0,
            seed=0,
            stop_token_ids=frozenset(),
            ignore_eos=True,
            return_logprob=False,
            return_sampling_mask=False,
            on_done=lambda r: loop.call_soon_threadsafe(_resolve, fut, r),
        )
        self.scheduler.submit([seq])
        try:
            r = await asyncio.wait_for(fut, timeout=20)
        except asyncio.TimeoutError:
            return web.Response(status=503, text="health check generate timed out")
        if r.finish_reason and r.finish_reason.get("type") == "abort":
            return web.Response(status=503, text=str(r.finish_reason.get("message")))
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        return _json_response(
            {
                "model_path": self.cfg.model,
                "tokenizer_path": self.cfg.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.scheduler.weight_version,
                "model_type": "qwen3" if self.model.args.qk_norm else "llama",
                "architectures": ["Qwen3ForCausalLM" if self.model.args.qk_norm else "LlamaForCausalLM"],
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.cfg.info()
        info["model_path"] = self.cfg.model
        info["context_length"] = self.scheduler.cfg.context_length
        info.update(
            {
                "engine": "hpcrl-embedded",
                "version": _version(),
                # hpcrl's engine client asks for the packed log-probs (return_logprob_packed) only where this
                # lists them: SGLang's /server_info has no such key, and SGLang refuses the request field.
                "logprob_wire": list(P.LOGPROB_WIRES),
                "internal_states": [
                    {
                        **self.scheduler.load(),
                        "num_decode_steps": self.scheduler.num_decode_steps,
                        "num_prefill_forwards": self.scheduler.num_prefill_forwards,
                        "num_generated_tokens": self.scheduler.num_generated_tokens,
                        "paused": self.scheduler.paused,
                        "weights_released": self.scheduler.weights_released,
                        "kv_cache_released": self.scheduler.cache is None,
                        "decode_path": self.scheduler.decode_path,
                        # What the scheduler and the kernels run with (the engine section, resolved): a setting
                        # can be checked where it acts, not only where it was given.
                        "max_running_requests": self.scheduler.cfg.max_running_requests,
                        "max_prefill_tokens": self.scheduler.cfg.max_prefill_tokens,
                        "overlap": self.scheduler.overlap,
                        "kernels": to_dict(launch.SETTINGS),
                        # Whether the decode kernels use programmatic dependent launch (engine.kernels.pdl, and a GPU
                        # that has it): what a benchmark row with PDL "on" can be checked against.
                        "pdl": self.scheduler.runner.mode in ("triton", "graph")
                        and launch.pdl_on(self.scheduler.runner.device),
                        "profile": self.scheduler.profile_summary(),
                    }
                ],
            }
        )
        return _json_response(info)

    async def get_load(self, request: web.Request) -> web.Response:
        return _json_response([{"dp_rank": 0, **self.scheduler.load(), "ts_tic": time.time()}])

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            await self._on_scheduler(self.scheduler.flush_cache)
        except EngineStateError as exc:
            return web.Response(status=400, text=f"Cache not flushed: {exc}")
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            req = P.AbortRequest.from_dict(await _json_body(request))
        except ValueError as exc:
            return _error(str(exc))
        await self._on_scheduler(lambda: self.scheduler.abort(req.rid, req.abort_all))
        return web.Response(text="")

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            req = P.PauseGeneration.from_dict(await _json_body(request, default={}))
        except ValueError as exc:
            return _error(str(exc))
        await self._on_scheduler(lambda: self.scheduler.pause(req.mode))
        return _json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        try:
            P.ContinueGeneration.from_dict(await _json_body(request, default={}))
        except ValueError as exc:
            return _error(str(exc))
        await self._on_scheduler(self.scheduler.resume_generation)
        return _json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory(self, request: web.Request) -> web.Response:
        try:
            req = P.MemoryOccupation.from_dict(await _json_body(request, default={}))
            tags = list(req.tags) if req.tags is not None else list(P.MEMORY_TAGS)
            before, reserved_before = _device_bytes(self.device), _device_reserved(self.device)
            t0 = time.perf_counter()
            freed = await self._on_scheduler(
                lambda: self.scheduler.release_memory(
                    tags, weights_cpu_backup=self.cfg.engine.enable_weights_cpu_backup
                )
            )
            seconds = time.perf_counter() - t0
        except (ValueError, EngineStateError) as exc:
            return _error(str(exc))
        after, reserved_after = _device_bytes(self.device), _device_reserved(self.device)
        log.info("released %s: %s bytes (device allocated %s -> %s)", tags, freed, before, after)
        return _json_response(
            {
                "success": True,
                "freed_bytes": freed,
                "device_allocated_before": before,
                "device_allocated_after": after,
                "device_reserved_before": reserved_before,
                "device_reserved_after": reserved_after,
                "seconds": seconds,
            }
        )

    async def resume_memory(self, request: web.Request) -> web.Response:
        try:
            req = P.MemoryOccupation.from_dict(await _json_body(request, default={}))
            tags = list(req.tags) if req.tags is not None else list(P.MEMORY_TAGS)
            t0 = time.perf_counter()
            restored = await self._on_scheduler(lambda: self.scheduler.resume_memory(tags))
            seconds = time.perf_counter() - t0
        except (ValueError, EngineStateError) as exc:
            return _error(str(exc))
        return _json_response(
            {
                "success": True,
                "restored_bytes": restored,
                "device_allocated_after": _device_bytes(self.device),
                "device_reserved_after": _device_reserved(self.device),
                "seconds": seconds,
            }
        )

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            req = P.InitWeightsUpdateGroup.from_dict(await _json_body(request))
            await self._run(
                lambda: self.weights.init_group(
                    master_address=req.master_address,
                    master_port=req.master_port,
                    rank_offset=req.rank_offset,
                    world_size=req.world_size,
                    group_name=req.group_name,
                    backend=req.backend,
                )
            )
        except web.HTTPException:
            raise  # a malformed body: its own 400 and message
        except Exception as exc:  # noqa: BLE001 - the contract answers every failure as success=false
            return _error(f"{type(exc).__name__}: {exc}")
        return _ok(f"Initialized weight update group {req.group_name}.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            req = P.DestroyWeightsUpdateGroup.from_dict(await _json_body(request, default={}))
            self.weights.destroy_group(req.group_name)
        except (ValueError, EngineStateError) as exc:
            return _error(str(exc))
        return _ok(f"Destroyed weight update group {req.group_name}.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        try:
            req = P.UpdateWeightsFromDistributed.from_dict(await _json_body(request))
            if req.abort_all_requests:
                await self._on_scheduler(lambda: self.scheduler.abort(abort_all=True))
            nbytes = await self._run(
                lambda: self.weights.receive_distributed(
                    names=list(req.names),
                    dtypes=list(req.dtypes),
                    shapes=[list(s) for s in req.shapes],
                    group_name=req.group_name,
                    load_format=req.load_format,
                    apply_strategy=req.apply_strategy,
                )
            )
            if (version := req.weight_version) is not None:
                await self._on_scheduler(lambda: self.scheduler.set_weight_version(version, False))
        except web.HTTPException:
            raise  # a malformed body: its own 400 and message
        except Exception as exc:  # noqa: BLE001
            return _error(f"{type(exc).__name__}: {exc}")
        return _ok(
            f"Succeeded to update parameter online from distributed ({len(req.names)} tensors).",
            bytes=nbytes,
            seconds=time.perf_counter() - t0,
        )

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        from hpcrl.weightwire.handover import UntrustedHandoverError, decode_payload

        t0 = time.perf_counter()
        try:
            req = P.UpdateWeightsFromTensor.from_dict(await _json_body(request))
            if len(req.serialized_named_tensors) != 1:
                raise ValueError("the embedded engine has one rank: send exactly one serialized_named_tensors entry")
            payload = decode_payload(req.serialized_named_tensors[0])
            if req.abort_all_requests:
                await self._on_scheduler(lambda: self.scheduler.abort(abort_all=True))
            nbytes = await self._run(lambda: self.weights.load_handover(payload, req.apply_strategy))
            if (version := req.weight_version) is not None:
                await self._on_scheduler(lambda: self.scheduler.set_weight_version(version, False))
        except UntrustedHandoverError as exc:
            log.warning("refused a handover: %s", exc)
            return _error(f"{type(exc).__name__}: {exc}", status=403)
        except web.HTTPException:
            raise  # a malformed body: its own 400 and message
        except Exception as exc:  # noqa: BLE001
            return _error(f"{type(exc).__name__}: {exc}")
        return _ok("Succeeded to update parameter online from tensor.", bytes=nbytes, seconds=time.perf_counter() - t0)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            req = P.UpdateWeightVersion.from_dict(await _json_body(request))
        except ValueError as exc:
            return _error(str(exc))
        await self._on_scheduler(lambda: self.scheduler.set_weight_version(req.new_version, req.abort_all_requests))
        return _ok(f"Weight version updated to {req.new_version}", new_version=req.new_version)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        try:
            req = P.GetWeightsByName.from_dict(await _json_body(request))
            params = self.scheduler.named_parameters()
            if req.name not in params:
                raise ValueError(f"no parameter named {req.name!r}")
            values = params[req.name].detach().float().flatten()[: req.truncate_size].cpu().tolist()
        except ValueError as exc:
            return _error(str(exc))
        return _json_response(values)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth_middleware], client_max_size=1 << 30)
        r = app.router
        for method in ("POST", "PUT"):
            r.add_route(method, "/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/get_load", self.get_load)
        r.add_get("/v1/loads", self.get_load)
        for method in ("GET", "POST"):
            r.add_route(method, "/flush_cache", self.flush_cache)
            r.add_route(method, "/release_memory_occupation", self.release_memory)
            r.add_route(method, "/resume_memory_occupation", self.resume_memory)
            r.add_route(method, "/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/update_weight_version", self.update_weight_version)
        app.on_shutdown.append(self._shutdown)
        return app

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.cfg.api_key
        if key:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return _json_response(
                    {"error": {"message": "Unauthorized: send Authorization: Bearer <api-key>"}}, status=401
                )
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except EngineStateError as exc:
            return _error(str(exc))

    async def _shutdown(self, app: web.Application) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        # A handler waiting on a rendezvous with a peer that is gone would hold the server's shutdown for
        # the whole group timeout: stop waiting (the client's connection closes).
        for waiter in list(self._waiters):
            waiter.cancel()


async def _json_body(request: web.Request, default: Any = None) -> Any:
    raw = await request.read()
    if not raw.strip():
        if default is not None:
            return default
        raise _bad_request("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad_request(f"the request body is not UTF-8 text ({exc}); send UTF-8 JSON") from exc
    try:
        # orjson, with the standard library behind it for what orjson refuses (a bare NaN, which the checks after
        # this name): a 256 x 128 batch took 1.6 ms through the standard library alone on a 2-core CPU, 0.5 here.
        return jsonwire.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad_request(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise _bad_request("the request body nests JSON too deeply; send a flat JSON object") from None


# One request's sequences (prompts x n): more would hold the scheduler's queue for everyone else.
MAX_SEQUENCES_PER_REQUEST = 65536
MAX_GENERATE_BODY_BYTES = 256 << 20  # 256 prompts of 128k token ids as JSON fit
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _has_lone_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def _bad_request(message: str) -> web.HTTPBadRequest:
    # The shape of _error's answers: SGLang's clients read error.message, its RL endpoints success/message.
    body = {"error": {"message": message}, "success": False, "message": message}
    return web.HTTPBadRequest(text=json.dumps(body), content_type="application/json")


def _device_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return None


def _device_reserved(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.memory_reserved(device))
    return None


def _resolve(fut: asyncio.Future[SeqRequest], seq: SeqRequest) -> None:
    if not fut.done():  # a cancelled request's future stays cancelled
        fut.set_result(seq)


def _load_tokenizer(model_dir: str) -> Any:
    if not (Path(model_dir) / "tokenizer.json").is_file() and not (Path(model_dir) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _version() -> str:
    from hpcrl import __version__

    return __version__


class _HttpThread:
    """The aiohttp server on an event loop of its own thread, so that the main thread is the scheduler's."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app, access_log=None)
        self.thread = threading.Thread(target=self.loop.run_forever, name="hpcrl-http", daemon=True)
        self.thread.start()
        # Binding errors (port in use) surface here, on the caller's thread.
        asyncio.run_coroutine_threadsafe(self._start(host, port), self.loop).result()

    async def _start(self, host: str, port: int) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()

    def stop(self) -> None:
        """Stop accepting, let the handlers in flight answer (the scheduler has finished them), run the
        app's shutdown hooks, then end the loop."""
        try:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=90)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def serve(cfg: ServerConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    check_port_free(cfg.host, cfg.port, what="hpcrl engine serve")  # before the model load, not after it
    engine = EmbeddedEngine(cfg)
    # What start-up made (torch, the model, the tokenizer: ~500k tracked objects) lives as long as the server.
    # Frozen, it is never scanned again by the cyclic collector, which building one large answer otherwise
    # sets off dozens of times (0.19 s -> 0.03 s for a 256 x 512 answer's lists).
    gc.collect()
    gc.freeze()
    try:
        http = _HttpThread(engine.app(), cfg.host, cfg.port)
    except OSError as exc:
        raise bind_error(exc, cfg.host, cfg.port, what="hpcrl engine serve") from None
    log.info(
        "loaded %s on %s/%s in %.1f s (decode path %s; kernels: %s); serving on http://%s:%d",
        cfg.model,
        cfg.engine.device,
        cfg.engine.dtype,
        time.perf_counter() - t0,
        engine.scheduler.decode_path,
        describe(cfg.engine.kernels, list(cfg.kernel_overrides)),
        cfg.host,
        cfg.port,
    )

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        engine.scheduler.stop()

    signal.signal(signal.SIGINT, on_signal)
    if cfg.ignore_sigterm:
        # Started by `hpcrl role engines`: Slurm TERMs every step of a job at once on requeue or
        # preemption, but the driver still needs this engine to finish its step and checkpoint; the role
        # stops it (SIGINT) when the driver is done, and Slurm's KILL ends it in any case.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, on_signal)
    try:
        engine.scheduler.run()  # the main thread: see the scheduler module's docstring
    except BaseException:
        log.exception("the scheduler failed")
        _end(engine, http, exit_code=1)
        raise
    _end(engine, http, exit_code=0)


def _end(engine: EmbeddedEngine, http: _HttpThread, *, exit_code: int) -> None:
    http.stop()
    if engine.control_busy():
        # Python joins the pool's threads at exit, and a TCPStore connect or a gloo rendezvous cannot be
        # interrupted: a stopped engine would live on for up to --group-timeout-s. Nothing is left to save.
        log.warning("exiting with weight-group work still blocked (a peer that is gone); not waiting for it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
