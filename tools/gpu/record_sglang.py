#!/usr/bin/env python3
"""Record what a real SGLang server answers to the requests hpcrl sends, one JSON file per case.

    python3 tools/gpu/record_sglang.py --out /tmp/sglang-golden            # starts SGLang on a tiny model (GPU)
    python3 tools/gpu/record_sglang.py --out /tmp/embedded --embedded      # the same cases, hpcrl's embedded engine

The recordings go to tests/golden/sglang-0.5.16/ (copy the *.json files, manifest.json included), where
tests/unit/test_sglang_golden.py replays them through hpcrl's client and sends the same requests to the
embedded engine; the format is described in tests/golden/sglang-0.5.16/README.md.

The script starts the server itself (SGLang: `python3 -m sglang.launch_server ... --enable-memory-saver`, on a
tiny model made like `hpcrl model init-tiny`, with a context long enough for requests that outlive a pause),
waits up to --startup-timeout-s for /health (SGLang 0.5.16 takes 130-150 s with the port silent), runs every
case with a timeout on each request, restarts the server if a case killed it, and kills it at exit. A case
prints one summary line. A case whose recording cannot show what it is for (a request that finished before
the abort or the pause reached it, a transport error, a server that died) is written with its `problems`
listed and makes the exit status 1; what the server did is never a problem, only recorded (the tests judge
it). Needs only the standard library, httpx and hpcrl. Never sends a non-pickle body to
/update_weights_from_tensor: it kills SGLang's scheduler.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hpcrl.engine.protocol.control import (
    AbortRequest,
    ContinueGeneration,
    MemoryOccupation,
    PauseGeneration,
    UpdateWeightVersion,
)
from hpcrl.engine.protocol.requests import GenerateRequest, SamplingParams

FORMAT_VERSION = 1
PROG = Path(__file__).stem
# "12+34=" in the tiny model's character tokenizer; any ids below its vocabulary (99) would do.
PROMPT = [20, 21, 14, 22, 23, 32]
PROMPTS = [PROMPT, [20, 14, 21], [23, 22, 14, 20, 32]]
SGLANG_ARGS = (
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--skip-server-warmup",
    "--mem-fraction-static",
    "0.3",
    "--enable-memory-saver",
)
# The server_info keys worth keeping (the whole body is every ServerArgs field, hundreds of them).
SERVER_INFO_KEYS = (
    "version",
    "model_path",
    "tp_size",
    "dp_size",
    "weight_version",
    "context_length",
    "max_running_requests",
    "mem_fraction_static",
    "enable_memory_saver",
    "random_seed",
    "skip_server_warmup",
    "internal_states",
)
# Headers that say how to read the body; the rest (date, server) change every run.
KEPT_HEADERS = ("content-type",)


# ----------------------------------------------------------------------------------------------------------------
# the server


class Server:
    """The engine process in a session of its own, so that stopping it ends every process it started."""

    def __init__(self, cmd: list[str], url: str, log_path: Path) -> None:
        self.cmd, self.url, self.log_path = cmd, url, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, startup_timeout_s: float) -> float:
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {datetime.datetime.now().isoformat()} {' '.join(self.cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        last = "no answer yet"
        while time.monotonic() - t0 < startup_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during start-up\n{self.log_tail()}")
            try:
                status = httpx.get(self.url + "/health", timeout=5.0, trust_env=False).status_code
                if status == 200:
                    return time.monotonic() - t0
                last = f"HTTP {status}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(1.0)
        raise RuntimeError(
            f"the server did not answer /health with 200 within {startup_timeout_s:.0f} s (last: {last}); "
            f"raise --startup-timeout-s or read the log\n{self.log_tail()}"
        )

    def alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            return httpx.get(self.url + "/health", timeout=30.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        return "\n".join(["--- server log tail ---", *text[-lines:], "---"])

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


# ----------------------------------------------------------------------------------------------------------------
# recording


def response_record(response: httpx.Response) -> dict[str, Any]:
    record: dict[str, Any] = {
        "status": response.status_code,
        "headers": {k: response.headers[k] for k in KEPT_HEADERS if k in response.headers},
    }
    if not response.content:
        record["text"] = ""
        return record
    try:
        record["body"] = response.json()
    except ValueError:
        record["text"] = response.text
    return record


@dataclass
class Exchange:
    label: str
    method: str
    path: str
    body: Any = None
    params: dict[str, Any] | None = None
    background: bool = False
    response: dict[str, Any] | None = None
    seconds: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        request: dict[str, Any] = {"method": self.method, "path": self.path}
        if self.params:
            request["query"] = self.params
        if self.body is not None:
            request["body"] = self.body
        out: dict[str, Any] = {"label": self.label, "request": request}
        if self.background:
            out["background"] = True
        out["response"] = self.response
        if self.seconds is not None:
            out["seconds"] = round(self.seconds, 3)
        if self.error:
            out["error"] = self.error
        return out


class Pending:
    """A request running on a thread of its own while the case sends others."""

    def __init__(self, rec: Recorder, exchange: Exchange, timeout_s: float) -> None:
        self.exchange = exchange
        self.thread = threading.Thread(target=rec._perform, args=(exchange, timeout_s), daemon=True)
        self.thread.start()

    def wait(self, timeout_s: float) -> dict[str, Any]:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"{self.exchange.label}: no answer within {timeout_s:.0f} s")
        if self.exchange.response is None:
            raise RuntimeError(f"{self.exchange.label}: {self.exchange.error}")
        return self.exchange.response


class Recorder:
    def __init__(self, url: str, request_timeout_s: float) -> None:
        self.http = httpx.Client(base_url=url, trust_env=False, timeout=request_timeout_s)
        self.request_timeout_s = request_timeout_s
        self.exchanges: list[Exchange] = []

    def _perform(self, exchange: Exchange, timeout_s: float) -> None:
        t0 = time.monotonic()
        try:
            response = self.http.request(
                exchange.method, exchange.path, json=exchange.body, params=exchange.params, timeout=timeout_s
            )
            exchange.response = response_record(response)
        except httpx.HTTPError as exc:
            exchange.error = f"{type(exc).__name__}: {exc}"
        exchange.seconds = time.monotonic() - t0

    def send(
        self,
        label: str,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        exchange = Exchange(label, method, path, body, params)
        self.exchanges.append(exchange)
        self._perform(exchange, timeout_s or self.request_timeout_s)
        if exchange.response is None:
            raise RuntimeError(f"{label}: {method} {path} failed: {exchange.error}")
        return exchange.response

    def start(self, label: str, method: str, path: str, body: Any, *, timeout_s: float) -> Pending:
        exchange = Exchange(label, method, path, body, background=True)
        self.exchanges.append(exchange)
        return Pending(self, exchange, timeout_s)

    def running_requests(self) -> int | None:
        """Requests the engine is running, from /get_load or /v1/loads; None when neither says."""
        for path in ("/get_load", "/v1/loads"):
            try:
                response = self.http.get(path, timeout=10.0)
                if response.status_code != 200:
                    continue
                found = _find_counts(response.json())
            except (httpx.HTTPError, ValueError):
                continue
            if found is not None:
                return found
        return None

    def wait_running(self, pending: Pending, timeout_s: float = 60.0, fallback_s: float = 2.0) -> None:
        """Return once the engine runs a request (the background one), so that what follows acts on it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and pending.thread.is_alive():
            count = self.running_requests()
            if count is None:
                time.sleep(fallback_s)  # the engine cannot say: give the request time to start
                return
            if count > 0:
                return
            time.sleep(0.05)

    def cleanup(self) -> None:
        """Leave no paused engine or running request behind for the next case (not recorded)."""
        for path, body in (("/continue_generation", {}), ("/abort_request", {"abort_all": True})):
            try:
                self.http.post(path, json=body, timeout=30.0)
            except httpx.HTTPError:
                pass


def _find_counts(data: Any) -> int | None:
    """Sum of num_reqs / num_running_reqs anywhere in a load answer (its shape changed across versions)."""
    if isinstance(data, list):
        counts = [c for c in (_find_counts(item) for item in data) if c is not None]
        return sum(counts) if counts else None
    if isinstance(data, dict):
        for key in ("num_reqs", "num_running_reqs"):
            if isinstance(data.get(key), int):
                return int(data[key])
        counts = [c for c in (_find_counts(v) for v in data.values()) if c is not None]
        return sum(counts) if counts else None
    return None


# ----------------------------------------------------------------------------------------------------------------
# cases


@dataclass
class Ctx:
    long_new_tokens: int
    problems: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def expect(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)


def _meta(response: dict[str, Any]) -> dict[str, Any]:
    body = response.get("body")
    return body.get("meta_info", {}) if isinstance(body, dict) else {}


def _finish(response: dict[str, Any]) -> str | None:
    reason = _meta(response).get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else None


def _gen(max_new_tokens: int, rid: str | None = None, **params: Any) -> dict[str, Any]:
    return GenerateRequest(
        input_ids=list(PROMPT),
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens, **params),
        return_logprob=True,
        rid=rid,
    ).to_dict()


def _long(ctx: Ctx, rid: str) -> dict[str, Any]:
    # No log-probs: thousands of triples would bloat the recording and say nothing the short cases do not.
    return GenerateRequest(
        input_ids=list(PROMPT),
        sampling_params=SamplingParams(max_new_tokens=ctx.long_new_tokens, ignore_eos=True, sampling_seed=11),
        rid=rid,
    ).to_dict()


def case_generate_logprobs_single(rec: Recorder, ctx: Ctx) -> None:
    body = _gen(8, "golden-single", sampling_seed=7)
    first = rec.send("seeded generate", "POST", "/generate", body)
    again = rec.send("the same request again", "POST", "/generate", body)
    ctx.expect(first["status"] == 200, f"generate answered {first['status']}")
    ctx.expect(len(_meta(first).get("output_token_logprobs") or []) == 8, "not 8 output_token_logprobs")
    ctx.notes["seeded_repeat_equal"] = first.get("body", {}).get("output_ids") == again.get("body", {}).get(
        "output_ids"
    )


def case_generate_logprobs_batch(rec: Recorder, ctx: Ctx) -> None:
    body = GenerateRequest(
        input_ids=[list(p) for p in PROMPTS],
        sampling_params=[SamplingParams(max_new_tokens=4 + 2 * i, sampling_seed=i + 1) for i in range(len(PROMPTS))],
        return_logprob=True,
        rid=[f"golden-batch-{i}" for i in range(len(PROMPTS))],
    ).to_dict()
    response = rec.send("batch of 3 seeded prompts", "POST", "/generate", body)
    ctx.expect(isinstance(response.get("body"), list) and len(response["body"]) == 3, "not a list of 3 results")


def case_generate_sampling_mask(rec: Recorder, ctx: Ctx) -> None:
    body = GenerateRequest(
        input_ids=list(PROMPT),
        sampling_params=SamplingParams(max_new_tokens=6, temperature=1.0, top_k=5, top_p=0.9, sampling_seed=3),
        return_logprob=True,
        return_sampling_mask=True,
        rid="golden-mask",
    ).to_dict()
    response = rec.send("top-k/top-p with return_sampling_mask", "POST", "/generate", body)
    meta = _meta(response)
    ctx.expect(response["status"] == 200, f"generate answered {response['status']}")
    ctx.notes["sampling_keys"] = sorted(k for k in meta if "sampling" in k or "support" in k)
    ctx.expect(bool(ctx.notes["sampling_keys"]), "no sampling-support field in meta_info")


def case_abort_request(rec: Recorder, ctx: Ctx) -> None:
    pending = rec.start("long generate", "POST", "/generate", _long(ctx, "golden-abort"), timeout_s=600)
    rec.wait_running(pending)
    rec.send("abort it by rid", "POST", "/abort_request", AbortRequest(rid="golden-abort").to_dict())
    result = pending.wait(120)
    ctx.notes["finish_reason"] = _finish(result)
    ctx.expect(_finish(result) != "length", "the request finished before the abort reached it: raise --long-new-tokens")


def case_pause_retract_continue(rec: Recorder, ctx: Ctx) -> None:
    pending = rec.start("long generate", "POST", "/generate", _long(ctx, "golden-retract"), timeout_s=600)
    rec.wait_running(pending)
    rec.send("pause (retract)", "POST", "/pause_generation", PauseGeneration(mode="retract").to_dict())
    rec.send("continue", "POST", "/continue_generation", ContinueGeneration().to_dict())
    ctx.expect(pending.thread.is_alive(), "the request finished before the continue: raise --long-new-tokens")
    result = pending.wait(600)
    ctx.notes["finish_reason"] = _finish(result)
    ctx.notes["num_retractions"] = _meta(result).get("num_retractions", _meta(result).get("total_retractions"))


def case_update_weight_version(rec: Recorder, ctx: Ctx) -> None:
    rec.send(
        "stamp a version", "POST", "/update_weight_version", UpdateWeightVersion(new_version="golden-v1").to_dict()
    )
    info = rec.send("model_info reports it", "GET", "/model_info")
    ctx.notes["model_info_weight_version"] = (info.get("body") or {}).get("weight_version")


def _weight_update_mid_request(rec: Recorder, ctx: Ctx, mode: str, version: str) -> None:
    pending = rec.start("long generate", "POST", "/generate", _long(ctx, f"golden-mid-{mode}"), timeout_s=600)
    rec.wait_running(pending)
    rec.send(f"pause ({mode})", "POST", "/pause_generation", PauseGeneration(mode=mode).to_dict())  # type: ignore[arg-type]
    rec.send(
        "stamp a new version", "POST", "/update_weight_version", UpdateWeightVersion(new_version=version).to_dict()
    )
    rec.send("continue", "POST", "/continue_generation", ContinueGeneration().to_dict())
    ctx.expect(pending.thread.is_alive(), "the request finished before the continue: raise --long-new-tokens")
    result = pending.wait(600)
    meta = _meta(result)
    ctx.notes["finish_reason"] = _finish(result)
    ctx.notes["final_weight_version"] = meta.get("weight_version")
    ctx.notes["new_version"] = version


def case_weight_update_mid_request_retract(rec: Recorder, ctx: Ctx) -> None:
    _weight_update_mid_request(rec, ctx, "retract", "golden-v2")


def case_weight_update_mid_request_in_place(rec: Recorder, ctx: Ctx) -> None:
    _weight_update_mid_request(rec, ctx, "in_place", "golden-v3")


def case_model_info(rec: Recorder, ctx: Ctx) -> None:
    info = rec.send("model info", "GET", "/model_info")
    ctx.expect(isinstance(info.get("body"), dict) and "weight_version" in info["body"], "no weight_version")


def case_server_info(rec: Recorder, ctx: Ctx) -> None:
    info = rec.send("server info (trimmed)", "GET", "/server_info")
    body = info.get("body")
    ctx.expect(isinstance(body, dict), "server_info is not an object")
    if isinstance(body, dict):
        ctx.notes["all_keys"] = sorted(body)
        info["body"] = {k: body[k] for k in SERVER_INFO_KEYS if k in body}
        info["trimmed_to"] = list(SERVER_INFO_KEYS)


def case_health(rec: Recorder, ctx: Ctx) -> None:
    response = rec.send("health", "GET", "/health")
    ctx.expect(response["status"] == 200, f"/health answered {response['status']}")


def case_flush_cache_idle(rec: Recorder, ctx: Ctx) -> None:
    response = rec.send("flush an idle engine", "POST", "/flush_cache")
    ctx.expect(response["status"] == 200, f"/flush_cache answered {response['status']}")


def case_flush_cache_busy(rec: Recorder, ctx: Ctx) -> None:
    pending = rec.start("long generate", "POST", "/generate", _long(ctx, "golden-busy"), timeout_s=600)
    rec.wait_running(pending)
    refused = rec.send("flush while a request runs", "POST", "/flush_cache")
    still_running = pending.thread.is_alive()
    rec.send("abort everything", "POST", "/abort_request", AbortRequest(abort_all=True).to_dict())
    result = pending.wait(120)
    ctx.expect(still_running or _finish(result) != "length", "finished before the flush: raise --long-new-tokens")
    ctx.notes["status"] = refused["status"]


def _error_case(body: Any, method: str = "POST", path: str = "/generate") -> Callable[[Recorder, Ctx], None]:
    def run(rec: Recorder, ctx: Ctx) -> None:
        # Whatever the server answers is the finding (SGLang may accept what hpcrl's engine refuses).
        response = rec.send("bad request", method, path, body)
        ctx.notes["status"] = response["status"]

    return run


def case_error_update_weights_from_distributed_bad_body(rec: Recorder, ctx: Ctx) -> None:
    # Only names: no dtypes, shapes, group. A server that dies here is recorded as such and restarted.
    ctx.notes["may_kill_server"] = True
    body = {"names": ["model.embed_tokens.weight"]}
    try:
        response = rec.send("bad body", "POST", "/update_weights_from_distributed", body, timeout_s=60)
    except RuntimeError:
        return  # no answer: the exchange says so (response null), and notes.server_survived
    ctx.notes["status"] = response["status"]


def case_memory_release_resume(rec: Recorder, ctx: Ctx) -> None:
    rec.send("pause (retract)", "POST", "/pause_generation", PauseGeneration(mode="retract").to_dict())
    rec.send("flush", "POST", "/flush_cache")
    for verb, tag in (("release", "kv_cache"), ("release", "weights"), ("resume", "weights"), ("resume", "kv_cache")):
        response = rec.send(
            f"{verb} {tag}", "POST", f"/{verb}_memory_occupation", MemoryOccupation(tags=(tag,)).to_dict()
        )
        ctx.notes[f"{verb}_{tag}_status"] = response["status"]
    rec.send("continue", "POST", "/continue_generation", ContinueGeneration().to_dict())
    # Documents what a generate sees after weights were released and resumed without a push (0.5.16: zeros).
    after = rec.send("greedy generate after resume", "POST", "/generate", _gen(4, "golden-after", temperature=0.0))
    ctx.notes["logprobs_after_resume"] = [e[0] for e in _meta(after).get("output_token_logprobs") or []]


CASES: dict[str, tuple[str, Callable[[Recorder, Ctx], None]]] = {
    "health": ("GET /health of a live server", case_health),
    "generate_logprobs_single": ("one prompt, log-probs, sampling_seed; sent twice", case_generate_logprobs_single),
    "generate_logprobs_batch": ("a batch of 3 prompts with per-item seeds and rids", case_generate_logprobs_batch),
    "generate_sampling_mask": ("return_sampling_mask with top_k/top_p", case_generate_sampling_mask),
    "abort_request": ("abort_request by rid while a long generate runs", case_abort_request),
    "pause_retract_continue": ("pause (retract) and continue around a long generate", case_pause_retract_continue),
    "update_weight_version": ("update_weight_version, then model_info", case_update_weight_version),
    "weight_update_mid_request_retract": (
        "a long generate through pause (retract), update_weight_version, continue",
        case_weight_update_mid_request_retract,
    ),
    "weight_update_mid_request_in_place": (
        "a long generate through pause (in_place), update_weight_version, continue",
        case_weight_update_mid_request_in_place,
    ),
    "model_info": ("GET /model_info", case_model_info),
    "server_info": ("GET /server_info, trimmed to the keys worth keeping", case_server_info),
    "flush_cache_idle": ("flush_cache with nothing running", case_flush_cache_idle),
    "flush_cache_busy": ("flush_cache while a request runs (refused)", case_flush_cache_busy),
    "error_unknown_field": (
        "/generate with a key GenerateReqInput does not have",
        _error_case({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "not_a_field": 1}),
    ),
    "error_unknown_sampling_param": (
        "/generate with a key SamplingParams does not have",
        _error_case({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "not_a_param": 1}}),
    ),
    "error_bad_top_p": (
        "/generate with top_p outside (0, 1]",
        _error_case({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "top_p": 1.5}}),
    ),
    "error_missing_input": (
        "/generate with neither input_ids nor text",
        _error_case({"sampling_params": {"max_new_tokens": 2}}),
    ),
    "error_sampling_mask_without_truncation": (
        "return_sampling_mask with top_p 1 and top_k -1 (nothing truncates the support)",
        _error_case(
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 2, "top_p": 1.0, "top_k": -1},
                "return_sampling_mask": True,
            }
        ),
    ),
    "error_bad_path": ("GET a path that does not exist", _error_case(None, "GET", "/no_such_endpoint")),
    "error_update_weights_from_distributed_bad_body": (
        "/update_weights_from_distributed with only names",
        case_error_update_weights_from_distributed_bad_body,
    ),
    # Last: after weights are released and resumed without a push, SGLang 0.5.16 serves zeros.
    "memory_release_resume": (
        "pause, flush, release kv_cache and weights, resume both, continue, generate",
        case_memory_release_resume,
    ),
}


def summarise(exchange: Exchange) -> str:
    r = exchange.response
    if r is None:
        return f"{exchange.method} {exchange.path}: {exchange.error}"
    body = r.get("body")
    bits = [f"{exchange.path} {r['status']}"]
    # Generate answers (one, or a batch) get a summary each; other bodies (a weight's values, ...) only the status.
    results = [x for x in body if isinstance(x, dict)] if isinstance(body, list) else [body]
    for result in [x for x in results if isinstance(x, dict) and "meta_info" in x][:3]:
        meta = result["meta_info"]
        reason = meta.get("finish_reason") or {}
        bits.append(
            f"{len(result.get('output_ids') or [])} tok {reason.get('type')} v={meta.get('weight_version')}"
            + (f" retr={meta.get('num_retractions')}" if meta.get("num_retractions") else "")
        )
    return " ".join(bits)


# ----------------------------------------------------------------------------------------------------------------
# main


def dumps(value: Any, indent: int = 0) -> str:
    """JSON with one line per object key and list item, except lists of scalars (token ids, log-prob triples),
    which stay on one line: readable in a diff, and a long output is one line, not thousands."""
    pad, inner = " " * indent, " " * (indent + 1)

    def flat(item: Any) -> bool:
        return not isinstance(item, (dict, list)) or (isinstance(item, list) and all(flat(x) for x in item))

    if isinstance(value, list) and flat(value) or not isinstance(value, (dict, list)) or not value:
        return json.dumps(value)
    if isinstance(value, list):
        return "[\n" + ",\n".join(inner + dumps(item, indent + 1) for item in value) + "\n" + pad + "]"
    items = (f"{inner}{json.dumps(str(k))}: {dumps(v, indent + 1)}" for k, v in value.items())
    return "{\n" + ",\n".join(items) + "\n" + pad + "}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_model(model_dir: Path, max_position_embeddings: int) -> Path:
    from hpcrl.model.tiny import TinyModelSpec, init_tiny_model

    if (model_dir / "config.json").is_file():
        return model_dir
    return init_tiny_model(model_dir, TinyModelSpec(max_position_embeddings=max_position_embeddings))


def context_of(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("max_position_embeddings", 1024))


def engine_version(url: str) -> str | None:
    for path in ("/server_info", "/get_server_info"):
        try:
            body = httpx.get(url + path, timeout=30.0, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(body, dict) and body.get("version") is not None:
            return str(body["version"])
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory (one JSON file per case)")
    parser.add_argument("--model", type=Path, help="model directory (default: a tiny model made under --out)")
    parser.add_argument("--python", default="python3", help="the interpreter that has sglang (default python3)")
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="wait for /health (default 300)")
    parser.add_argument("--request-timeout-s", type=float, default=120.0, help="per request (default 120)")
    parser.add_argument(
        "--long-new-tokens", type=int, default=6000, help="max_new_tokens of requests that must outlive a pause"
    )
    parser.add_argument("--max-restarts", type=int, default=3, help="server restarts after a case killed it")
    parser.add_argument("--cases", help=f"comma-separated subset of: {', '.join(CASES)}")
    parser.add_argument("--embedded", action="store_true", help="record hpcrl's embedded engine instead (CPU)")
    parser.add_argument("--sglang-arg", action="append", default=[], help="one more launch_server argument")
    args = parser.parse_args(argv)
    if args.cases:
        unknown = sorted(set(args.cases.split(",")) - set(CASES))
        if unknown:
            parser.error(f"unknown case(s) {unknown}; valid: {', '.join(CASES)}")
    return args


def server_command(args: argparse.Namespace, model_dir: Path, port: int) -> list[str]:
    if args.embedded:
        return [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model_dir), "--port", str(port)]
    return [
        args.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SGLANG_ARGS,
        *args.sglang_arg,
    ]


def start_server(server: Server, what: str, startup_timeout_s: float, prog: str) -> bool:
    """Start `server` with a line before and after; False, with the error on stderr, if it never answers /health."""
    try:
        print(f"starting {what} on {server.url} ...", flush=True)
        print(f"server up after {server.start(startup_timeout_s):.1f} s", flush=True)
    except RuntimeError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return False
    return True


def new_manifest(*, embedded: bool, version: str | None, **fields: Any) -> dict[str, Any]:
    """manifest.json's head (the README's format); `cases` fills as the cases are written."""
    return {
        "format": FORMAT_VERSION,
        "engine": "hpcrl-embedded" if embedded else "sglang",
        "version": version,
        "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **fields,
        "cases": {},
    }


def record_case(
    out: Path,
    manifest: dict[str, Any],
    name: str,
    description: str,
    run: Callable[..., None],
    *,
    server: Server,
    request_timeout_s: float,
    ctx: Ctx,
    case_args: tuple[Any, ...] = (),
    extra: dict[str, Any] | None = None,
    width: int = 48,
) -> tuple[Recorder, bool]:
    """Run one case, `run(recorder, ctx, *case_args)`, against `server`, write CASE.json (with `extra` fields), list it
    in the manifest and print its line and problems; the recorder (for its cleanup) and whether the server survived
    the case."""
    rec = Recorder(server.url, request_timeout_s)
    t0 = time.monotonic()
    try:
        run(rec, ctx, *case_args)
    except Exception as exc:  # noqa: BLE001 - a broken case is reported and the next one runs
        ctx.problems.append(f"{type(exc).__name__}: {exc}")
    survived = server.alive()
    ctx.notes["server_survived"] = survived
    if not survived and not ctx.notes.get("may_kill_server"):
        ctx.problems.append("the server died or stopped answering /health during this case")
    record = {
        "format": FORMAT_VERSION,
        "case": name,
        "description": description,
        "recorded": True,
        "engine": manifest["engine"],
        "version": manifest["version"],
        **(extra or {}),
        "problems": ctx.problems,
        "notes": ctx.notes,
        "exchanges": [e.to_json() for e in rec.exchanges],
    }
    (out / f"{name}.json").write_text(dumps(record) + "\n")
    manifest["cases"][name] = description
    status = "ok" if not ctx.problems else "FAILED"
    detail = " | ".join(summarise(e) for e in rec.exchanges)
    print(f"case {name:<{width}} {status:<6} {time.monotonic() - t0:6.1f} s  {detail}", flush=True)
    for problem in ctx.problems:
        print(f"    problem: {problem}", flush=True)
    return rec, survived


def write_manifest(out: Path, manifest: dict[str, Any], failed: list[str]) -> None:
    manifest["failed"] = failed
    (out / "manifest.json").write_text(dumps(manifest) + "\n")
    print(f"{len(manifest['cases'])} case(s) written to {out}, {len(failed)} with problems: {failed}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model or make_model(out / "model", max_position_embeddings=8192)
    # Long requests must fit the context next to the prompt.
    long_new_tokens = max(1, min(args.long_new_tokens, context_of(model_dir) - len(PROMPT) - 8))
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server(server_command(args, model_dir, port), url, out / "server.log")
    atexit.register(server.stop)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not start_server(server, "the embedded engine" if args.embedded else "SGLang", args.startup_timeout_s, PROG):
        return 1
    names = args.cases.split(",") if args.cases else list(CASES)
    manifest = new_manifest(
        embedded=args.embedded, version=engine_version(url), command=server.cmd[1:], long_new_tokens=long_new_tokens
    )
    failed: list[str] = []
    restarts = 0
    for name in names:
        description, run = CASES[name]
        ctx = Ctx(long_new_tokens=long_new_tokens)
        rec, survived = record_case(
            out, manifest, name, description, run, server=server, request_timeout_s=args.request_timeout_s, ctx=ctx
        )
        if ctx.problems:
            failed.append(name)
        if survived:
            rec.cleanup()
            continue
        print(server.log_tail(), flush=True)
        server.stop()
        if restarts >= args.max_restarts:
            print(f"{PROG}: error: the server died too often; stopping", file=sys.stderr)
            break
        restarts += 1
        try:
            print(f"restarted after {server.start(args.startup_timeout_s):.1f} s", flush=True)
        except RuntimeError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            break
    write_manifest(out, manifest, failed)
    server.stop()
    return 1 if failed or len(manifest["cases"]) < len(names) else 0


if __name__ == "__main__":
    sys.exit(main())
