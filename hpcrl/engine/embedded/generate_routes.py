"""The embedded engine's generation routes: /generate (prompts checked, tokenized off the event loop, handed to the
scheduler, answered in the contract's shape) and /health_generate."""

from __future__ import annotations

import asyncio
import functools
import re
import secrets
import time
from typing import Any, cast

import numpy as np
from aiohttp import web

from hpcrl.engine import jsonwire
from hpcrl.engine.embedded.engine_core import EngineCore
from hpcrl.engine.embedded.http_server import _error, _json_body, _json_response
from hpcrl.engine.embedded.requests import SeqRequest
from hpcrl.engine.protocol.answers import (
    INPUT_LOGPROBS_KEY,
    INPUT_TOP_LOGPROBS_KEY,
    GrowingPackedColumn,
    logprob_triples,
    pack_logprobs,
    result_object,
    span_object,
)
from hpcrl.engine.protocol.requests import GenerateRequest, SamplingParams
from hpcrl.model.moe import encode_routes

# One request's sequences (prompts x n): more would hold the scheduler's queue for everyone else.
MAX_SEQUENCES_PER_REQUEST = 65536
MAX_GENERATE_BODY_BYTES = 256 << 20  # 256 prompts of 128k token ids as JSON fit
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class GenerateRoutes(EngineCore):
    """POST /generate and GET /health_generate."""

    def _seed_for(self, params: SamplingParams, sample_index: int, rid: str) -> int:
        if params.sampling_seed is not None:
            # Samples of one n>1 request must differ, yet stay a function of the request's seed.
            return params.sampling_seed if sample_index == 0 else (params.sampling_seed * 1_000_003 + sample_index)
        self._request_counter += 1
        return (self.cfg.random_seed * 1_000_000_007 + self._request_counter) & ((1 << 62) - 1)

    def _prompts(self, req: GenerateRequest) -> list[list[int]]:
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
            if req.return_logprob and req.logprob_start_len >= len(prompt):
                raise ValueError(
                    f"logprob_start_len={req.logprob_start_len} is not inside prompt {i} of {len(prompt)} tokens; "
                    "send a position before its end (0: the whole prompt), or -1 for no prompt log-probs"
                )
            if (
                req.return_logprob
                and req.top_logprobs_num
                and (req.logprob_start_len < 0 or req.params_for(i if req.is_batch else 0).max_new_tokens)
            ):
                raise ValueError(
                    "top_logprobs_num: the embedded engine answers top-k log-probs for prompt scoring only; send "
                    "max_new_tokens=0 with logprob_start_len >= 0, or top_logprobs_num=0"
                )
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
            packed_text = r.packed_column.packed(column) if r.packed_column is not None else pack_logprobs(column)
        elif column is not None:
            texts = [self.tokenizer.decode([t]) for t in r.output_ids] if text_in_logprobs and self.tokenizer else None
            triples = logprob_triples(column.tolist(), r.output_ids, texts)
        # Written from the scheduler's records, which it keeps in the contract's shapes: a checked GenerateResult of
        # each first took most of a 256-row answer's time.
        return result_object(
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
            weight_versions=[span_object(v, s, e) for v, s, e in r.version_spans],
            sampling_mask=r.support_ids if r.return_sampling_mask else None,
            support_logprobs=r.support_logprobs if r.return_sampling_mask else None,
            extra_meta=_extra_meta(r),
        )

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
            req = GenerateRequest.from_dict(body)
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
            if req.return_routed_experts and self.scheduler.model.args.moe is None:
                raise ValueError(
                    "return_routed_experts asks for the experts each token was routed to, but this engine serves a "
                    "dense model (no experts); drop return_routed_experts or serve a mixture-of-experts model"
                )
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
                    return_routed_experts=req.return_routed_experts,
                )
                seq.logprob_scaled = logprob_scaled
                seq.logprob_start_len = req.logprob_start_len if req.return_logprob else -1
                seq.top_logprobs_num = req.top_logprobs_num if req.return_logprob else 0
                if req.return_logprob and req.return_logprob_packed:
                    seq.packed_column = GrowingPackedColumn()
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


def _has_lone_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def _resolve(fut: asyncio.Future[SeqRequest], seq: SeqRequest) -> None:
    if not fut.done():  # a cancelled request's future stays cancelled
        fut.set_result(seq)


def _extra_meta(r: SeqRequest) -> dict[str, Any] | None:
    """meta_info beyond the contract's fields: the sampled log-probs under a re-score, the prompt's log-probs, and
    the routed experts as SGLang answers them (base64 of int32 [prompt + output - 1 tokens, layers, top-k]: every
    token a forward ran)."""
    meta: dict[str, Any] = {}
    if r.sampled_logprobs is not None and r.return_logprob:
        meta["hpcrl_sampled_logprobs"] = r.sampled_logprobs
    if r.input_logprobs is not None:
        start = max(r.logprob_start_len, 0)
        meta[INPUT_LOGPROBS_KEY] = [(lp, t, None) for lp, t in zip(r.input_logprobs, r.prompt_ids[start:], strict=True)]
    if r.input_top_logprobs is not None:
        meta[INPUT_TOP_LOGPROBS_KEY] = [
            None if e is None else [(lp, t, None) for lp, t in e] for e in r.input_top_logprobs
        ]
    if r.return_routed_experts:
        kept = r.num_tokens - 1
        routes = np.concatenate(r.routes)[:kept] if r.routes else np.zeros((0, 0, 0), dtype=np.int32)
        meta["routed_experts"] = encode_routes(routes)
    return meta or None
