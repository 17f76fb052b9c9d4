"""EngineClient against a real HTTP server on loopback that answers contract-shaped bodies and misbehaves on
purpose; protocol types' validation and (de)serialisation."""

from __future__ import annotations

import base64
import json
import random
import socket
import struct
import threading
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from hpcrl.engine import jsonwire
from hpcrl.engine.client import EngineClient
from hpcrl.engine.errors import (
    EngineBusyError,
    EngineError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnreachableError,
)
from hpcrl.engine.protocol.answers import (
    FinishReason,
    GenerateResult,
    GrowingPackedColumn,
    WeightVersionSpan,
    pack_logprobs,
    parse_generate_response,
)
from hpcrl.engine.protocol.control import (
    AbortRequest,
    InitWeightsUpdateGroup,
    MemoryOccupation,
    PauseGeneration,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    UpdateWeightVersion,
)
from hpcrl.engine.protocol.requests import GenerateRequest, SamplingParams
from hpcrl.engine.versions import token_weight_versions

# ----------------------------------------------------------------------------------------------------------------
# A fake engine: canned contract-shaped answers, plus a per-path script of misbehaviours consumed first.


@dataclass
class Recorded:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any


# A scripted action: (status, json body) or one of the strings "close" (drop the connection) / ("sleep", s).
Action = tuple[int, Any] | tuple[str, float] | str


@dataclass
class EngineState:
    api_key: str | None = None
    weight_version: str = "default"
    requests: list[Recorded] = field(default_factory=list)
    scripts: dict[str, list[Action]] = field(default_factory=dict)
    missing_paths: set[str] = field(default_factory=set)
    # /server_info's `logprob_wire` (None: no such key, as SGLang): what the client reads to ask for packed log-probs.
    logprob_wire: list[str] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def script(self, path: str, *actions: Action) -> None:
        with self.lock:
            self.scripts.setdefault(path, []).extend(actions)

    def bodies(self, path: str) -> list[Any]:
        with self.lock:
            return [r.body for r in self.requests if r.path == path]

    def count(self, path: str) -> int:
        return len(self.bodies(path))


def _sample(prompt: list[int], index: int, params: dict[str, Any], version: str, rid: str) -> dict[str, Any]:
    """One result, shaped as SGLang's /generate answers it, plus hpcrl's extensions when asked."""
    n_out = int(params.get("max_new_tokens", 128))
    out = [(prompt[-1] + 1 + index + k) % 1000 for k in range(n_out)]
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": {"type": "length", "length": n_out},
        "prompt_tokens": len(prompt),
        "completion_tokens": n_out,
        "cached_tokens": 0,
        "weight_version": version,
        "num_retractions": 0,
        "e2e_latency": 0.01,
    }
    meta["output_token_logprobs"] = [[-0.25 * (k + 1), tid, None] for k, tid in enumerate(out)]
    if n_out:
        meta["weight_versions"] = [{"version": version, "start": 0, "end": n_out}]
    return {"text": " ".join(map(str, out)), "output_ids": out, "meta_info": meta}


def _canned(state: EngineState, method: str, path: str, body: Any) -> tuple[int, Any]:
    if path in ("/health", "/health_generate"):
        return 200, b""
    if path == "/model_info":
        return 200, {
            "model_path": "tiny",
            "tokenizer_path": "tiny",
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.weight_version,
        }
    if path == "/get_model_info":
        return 200, {"model_path": "tiny-old", "weight_version": state.weight_version}
    if path in ("/server_info", "/get_server_info"):
        info: dict[str, Any] = {"tp_size": 1, "version": "0.0-test", "internal_states": [{}]}
        if state.logprob_wire is not None:
            info["logprob_wire"] = state.logprob_wire
        return 200, info
    if path == "/flush_cache":
        return 200, b"Cache flushed.\n"
    if path == "/abort_request":
        return 200, b""
    if path == "/pause_generation":
        return 200, {"message": "Generation paused successfully.", "status": "ok"}
    if path == "/continue_generation":
        return 200, {"message": "Generation continued successfully.", "status": "ok"}
    if path in ("/release_memory_occupation", "/resume_memory_occupation"):
        return 200, b""
    if path == "/update_weight_version":
        state.weight_version = body["new_version"]
        return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}", **body}
    if path in ("/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed"):
        return 200, {"success": True, "message": "Succeeded."}
    if path == "/get_weights_by_name":
        return 200, [0.5] * min(body.get("truncate_size", 100), 3)
    if path == "/generate":
        ids = body["input_ids"]
        prompts = ids if isinstance(ids[0], list) else [ids]
        params_list = body["sampling_params"]
        results = []
        for i, prompt in enumerate(prompts):
            params = params_list[i] if isinstance(params_list, list) else params_list
            rids = body.get("rid")
            base = (rids[i] if isinstance(rids, list) else rids) or f"req{i}"
            for j in range(params.get("n", 1)):
                results.append(_sample(prompt, j, params, state.weight_version, base))
        if body.get("return_logprob_packed"):
            for result in results:  # written here with struct, not with the hpcrl code under test
                meta = result["meta_info"]
                column = [lp for lp, _, _ in meta.pop("output_token_logprobs")]
                packed = base64.b64encode(struct.pack(f"<{len(column)}d", *column)).decode()
                meta["output_token_logprobs_packed"] = packed
        single = not isinstance(ids[0], list) and len(results) == 1
        return 200, results[0] if single else results
    return 404, {"detail": "Not Found"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn, so that the client's pool is exercised
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def _serve(self, method: str) -> None:
        state = self.server.state
        path, _, query = self.path.partition("?")
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        with state.lock:
            state.requests.append(Recorded(method, path, query, dict(self.headers.items()), body))
            script = state.scripts.get(path)
            action: Action | None = script.pop(0) if script else None
        if state.api_key is not None and self.headers.get("Authorization") != f"Bearer {state.api_key}":
            self._send(401, {"error": "Unauthorized"})
            return
        if action == "close":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if isinstance(action, tuple) and action[0] == "sleep":
            time.sleep(float(action[1]))
            action = None
        if path in state.missing_paths:
            self._send(404, {"detail": "Not Found"})
            return
        status, payload = action if isinstance(action, tuple) else _canned(state, method, path, body)
        self._send(int(status), payload)

    def _send(self, status: int, payload: Any) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream" if isinstance(payload, bytes) else "json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout test): nothing to answer


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, state: EngineState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    srv = _Server(EngineState())
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def engine(server: _Server) -> EngineState:
    server.state = EngineState()
    return server.state


@pytest.fixture
def client(server: _Server, engine: EngineState) -> Iterator[EngineClient]:
    host, port = server.server_address[:2]
    with EngineClient(f"http://{host}:{port}", timeout_s=5.0, max_retries=3, retry_backoff_s=0.01) as c:
        yield c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------------------------------------------
# generate


def test_generate_single_parses_logprobs_versions_and_serialises_params(client: EngineClient, engine: EngineState):
    params = SamplingParams(max_new_tokens=3, temperature=0.7, top_k=20, stop_token_ids=(7,), sampling_seed=11)
    result = client.generate([5, 6], params, rid="abc")
    assert isinstance(result, GenerateResult)
    assert result.output_ids == [7, 8, 9]
    assert result.output_token_logprobs == [-0.25, -0.5, -0.75]
    assert result.rid == "abc"
    assert result.finish_reason == FinishReason(type="length", length=3)
    assert result.prompt_tokens == 2 and result.completion_tokens == 3
    assert result.weight_version == "default"
    assert result.weight_versions == [WeightVersionSpan(version="default", start=0, end=3)]
    assert token_weight_versions(result, "http://engine") == [0] * 3  # "default" is the loaded weights
    assert result.e2e_latency_s == pytest.approx(0.01)
    (sent,) = engine.bodies("/generate")
    assert sent == {
        "input_ids": [5, 6],
        "sampling_params": {
            "max_new_tokens": 3,
            "temperature": 0.7,
            "top_k": 20,
            "stop_token_ids": [7],
            "sampling_seed": 11,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": "abc",
    }


def test_generate_batch_with_n_returns_prompt_major_list(client: EngineClient, engine: EngineState):
    results = client.generate(
        [[1], [100, 101]], SamplingParams(max_new_tokens=2, n=2, top_k=4), rid=["a", "b"], return_sampling_mask=True
    )
    assert isinstance(results, list) and len(results) == 4
    assert [r.rid for r in results] == ["a", "a", "b", "b"]
    assert results[2].output_ids == [102, 103]
    sent = engine.bodies("/generate")[0]
    assert sent["input_ids"] == [[1], [100, 101]]
    assert sent["return_sampling_mask"] is True
    assert sent["sampling_params"] == {"max_new_tokens": 2, "top_k": 4, "n": 2}


def test_generate_count_mismatch_is_an_engine_error(client: EngineClient, engine: EngineState):
    engine.script("/generate", (200, [_sample([1], 0, {"max_new_tokens": 1}, "v", "x")]))
    with pytest.raises(EngineError, match="expected a list of 2"):
        client.generate([[1], [2]], SamplingParams(max_new_tokens=1))


def test_generate_rejects_invalid_request_before_sending(client: EngineClient, engine: EngineState):
    with pytest.raises(ValueError, match="input_ids is empty"):
        client.generate([])
    with pytest.raises(ValueError, match=r"input_ids\[1\] must be a non-negative integer"):
        client.generate([1, -2])
    assert engine.count("/generate") == 0


def test_generate_is_not_retried_on_503(client: EngineClient, engine: EngineState):
    engine.script("/generate", (503, {"error": {"message": "overloaded"}}))
    with pytest.raises(EngineBusyError, match="overloaded"):
        client.generate([1], SamplingParams(max_new_tokens=1))
    assert engine.count("/generate") == 1


def test_generate_is_not_retried_when_the_connection_drops(client: EngineClient, engine: EngineState):
    engine.script("/generate", "close")
    with pytest.raises(EngineUnreachableError, match="closed the connection"):
        client.generate([1], SamplingParams(max_new_tokens=1))
    assert engine.count("/generate") == 1


def test_generate_read_timeout(client: EngineClient, engine: EngineState):
    engine.script("/generate", ("sleep", 1.5))
    start = time.monotonic()
    with pytest.raises(EngineTimeoutError, match="did not answer within 0.3 s"):
        client.generate([1], SamplingParams(max_new_tokens=1), timeout_s=0.3)
    assert time.monotonic() - start < 1.2
    assert engine.count("/generate") == 1
    # The client is still usable after a timed-out call.
    assert client.generate([1], SamplingParams(max_new_tokens=1)).output_ids == [2]  # type: ignore[union-attr]


def test_generate_400_carries_the_servers_message(client: EngineClient, engine: EngineState):
    engine.script("/generate", (400, {"error": {"message": "sampling_params.top_p must be in (0, 1]"}}))
    with pytest.raises(EngineRequestError, match=r"HTTP 400: sampling_params.top_p must be in \(0, 1\]") as info:
        client.generate([1])
    assert info.value.status_code == 400
    assert engine.count("/generate") == 1


def test_generate_many_keeps_order_across_threads(client: EngineClient, engine: EngineState):
    requests = [
        GenerateRequest(input_ids=[i], sampling_params=SamplingParams(max_new_tokens=1), return_logprob=True)
        for i in range(40)
    ]
    results = client.generate_many(requests, max_concurrency=8)
    assert [r.output_ids for r in results] == [[i + 1] for i in range(40)]  # type: ignore[union-attr]
    assert engine.count("/generate") == 40


def test_generate_many_raises_the_first_failure(client: EngineClient, engine: EngineState):
    engine.script("/generate", (400, {"error": {"message": "bad prompt"}}))
    requests = [GenerateRequest(input_ids=[i], sampling_params=SamplingParams(max_new_tokens=1)) for i in range(3)]
    with pytest.raises(EngineRequestError, match="bad prompt"):
        client.generate_many(requests, max_concurrency=1)


# ----------------------------------------------------------------------------------------------------------------
# retries, dead engines, auth


def test_model_info_retries_503_then_succeeds(client: EngineClient, engine: EngineState):
    engine.script("/model_info", (503, {"error": {"message": "starting"}}), (503, {"error": {"message": "starting"}}))
    assert client.model_info()["model_path"] == "tiny"
    assert engine.count("/model_info") == 3


def test_503_after_all_retries_is_busy(client: EngineClient, engine: EngineState):
    engine.script("/server_info", *[(503, {"error": {"message": "warming up"}})] * 4)
    with pytest.raises(EngineBusyError, match="after 4 attempt"):
        client.server_info()
    assert engine.count("/server_info") == 4


def test_safe_call_is_retried_after_a_dropped_connection(client: EngineClient, engine: EngineState):
    engine.script("/flush_cache", "close")
    assert client.flush_cache() is True
    assert engine.count("/flush_cache") == 2


def test_model_info_falls_back_to_the_old_path(client: EngineClient, engine: EngineState):
    engine.missing_paths.add("/model_info")
    assert client.model_info()["model_path"] == "tiny-old"
    assert client.weight_version() == 0  # SGLang's "default": the weights the engine loaded, version 0
    # The working path is remembered: the new one is not asked again.
    assert engine.count("/model_info") == 1


def test_dead_engine_is_unreachable_quickly():
    port = _free_port()
    with EngineClient(f"127.0.0.1:{port}", timeout_s=30.0, max_retries=2, retry_backoff_s=0.01) as dead:
        start = time.monotonic()
        with pytest.raises(EngineUnreachableError, match=f"127.0.0.1:{port} is unreachable") as info:
            dead.generate([1, 2, 3])
        assert time.monotonic() - start < 2.0
        assert "after 3 attempt" in str(info.value)
        with pytest.raises(EngineUnreachableError):
            dead.health()
        with pytest.raises(EngineUnreachableError, match="did not accept a connection within"):
            dead.wait_until_ready(0.3, poll_s=0.05)


def test_api_key_is_sent_and_missing_key_is_explained(server: _Server, engine: EngineState):
    engine.api_key = "s3cret"
    host, port = server.server_address[:2]
    with EngineClient(f"http://{host}:{port}", api_key="s3cret") as authed:
        assert authed.health() is True
        assert authed.model_info()["weight_version"] == "default"
    assert {r.headers["Authorization"] for r in engine.requests} == {"Bearer s3cret"}
    with EngineClient(f"http://{host}:{port}", max_retries=0) as anonymous:
        with pytest.raises(EngineRequestError, match="HTTP 401: Unauthorized; pass the engine's --api-key"):
            anonymous.model_info()
        assert "s3cret" not in repr(anonymous)


def test_health_false_on_persistent_503(client: EngineClient, engine: EngineState):
    assert client.health() is True
    engine.script("/health_generate", *[(503, b"")] * 4)
    assert client.health_generate() is False


def test_wait_until_ready_polls_until_200(client: EngineClient, engine: EngineState):
    engine.script("/health", (503, b""), (503, b""), (503, b""))
    waited_s = client.wait_until_ready(5.0, poll_s=0.02)
    assert 0.0 < waited_s < 5.0
    assert engine.count("/health") == 4


def test_wait_until_ready_times_out_when_never_ready(client: EngineClient, engine: EngineState):
    engine.script("/health", *[(503, b"")] * 1000)
    with pytest.raises(EngineTimeoutError, match=r"not ready after 0\.\d s \(last /health: HTTP 503\)"):
        client.wait_until_ready(0.3, poll_s=0.02)


# ----------------------------------------------------------------------------------------------------------------
# control and weight-update endpoints


def test_update_weight_version_always_sends_abort_false(client: EngineClient, engine: EngineState):
    # An int inside hpcrl, a string on the wire (SGLang's new_version and model_info.weight_version).
    assert client.update_weight_version(3) == 3
    assert engine.bodies("/update_weight_version") == [{"new_version": "3", "abort_all_requests": False}]
    assert client.weight_version() == 3
    client.update_weight_version(4, abort_all_requests=True)
    assert engine.bodies("/update_weight_version")[-1] == {"new_version": "4", "abort_all_requests": True}
    with pytest.raises(ValueError, match="a weight version is an int >= 0"):
        client.update_weight_version("5")  # type: ignore[arg-type]
    assert len(engine.bodies("/update_weight_version")) == 2, "nothing was sent"


def test_an_engine_answering_a_version_that_is_not_a_number_is_named(client: EngineClient, engine: EngineState):
    engine.weight_version = "golden-v3"
    with pytest.raises(EngineRequestError, match="/model_info weight_version='golden-v3', which is not a weight") as e:
        client.weight_version()
    assert e.value.url == client.url and f"engine {client.url} answered" in str(e.value)
    engine.script("/update_weight_version", (200, {"success": True, "new_version": "v7"}))
    with pytest.raises(EngineRequestError, match="/update_weight_version new_version='v7'"):
        client.update_weight_version(7)


def test_success_false_is_a_request_error(client: EngineClient, engine: EngineState):
    engine.script("/update_weight_version", (200, {"success": False, "message": "version must be new"}))
    with pytest.raises(EngineRequestError, match="version must be new"):
        client.update_weight_version(5)


def test_weight_update_calls_are_never_retried(client: EngineClient, engine: EngineState):
    request = UpdateWeightsFromDistributed(
        names=("w",), dtypes=("bfloat16",), shapes=((2, 3),), flush_cache=False, weight_version="7"
    )
    engine.script("/update_weights_from_distributed", (503, {"error": {"message": "busy"}}))
    with pytest.raises(EngineBusyError):
        client.update_weights_from_distributed(request)
    engine.script(
        "/update_weights_from_distributed", (400, {"success": False, "message": "shape mismatch for w: (3, 2)"})
    )
    with pytest.raises(EngineRequestError, match="shape mismatch for w"):
        client.update_weights_from_distributed(request)
    assert client.update_weights_from_distributed(request)["success"] is True
    bodies = engine.bodies("/update_weights_from_distributed")
    assert len(bodies) == 3
    assert bodies[0] == {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[2, 3]],
        "group_name": "weight_update_group",
        "flush_cache": False,
        "abort_all_requests": False,
        "weight_version": "7",
        "load_format": None,
        "torch_empty_cache": False,
    }


def test_group_lifecycle_bodies(client: EngineClient, engine: EngineState):
    init = InitWeightsUpdateGroup(master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=2)
    assert client.init_weights_update_group(init)["success"] is True
    client.destroy_weights_update_group()
    assert engine.bodies("/init_weights_update_group") == [
        {
            "master_address": "10.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "weight_update_group",
            "backend": "nccl",
        }
    ]
    assert engine.bodies("/destroy_weights_update_group") == [{"group_name": "weight_update_group"}]


def test_pause_continue_abort_memory_and_flush(client: EngineClient, engine: EngineState):
    assert client.pause_generation()["status"] == "ok"
    client.continue_generation(torch_empty_cache=False)
    client.abort_request("grp-3")
    client.abort_request(abort_all=True)
    client.release_memory_occupation()
    client.resume_memory_occupation(["weights"])
    assert engine.bodies("/pause_generation") == [{"mode": "retract"}]
    assert engine.bodies("/continue_generation") == [{"torch_empty_cache": False}]
    assert engine.bodies("/abort_request") == [{"rid": "grp-3", "abort_all": False}, {"rid": "", "abort_all": True}]
    assert engine.bodies("/release_memory_occupation") == [{"tags": None}]
    assert engine.bodies("/resume_memory_occupation") == [{"tags": ["weights"]}]
    with pytest.raises(ValueError, match="aborts nothing"):
        client.abort_request()
    with pytest.raises(ValueError, match="mode must be one of"):
        client.pause_generation("freeze")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tags\[0\] must be one of"):
        client.release_memory_occupation(["kv"])

    engine.script("/flush_cache", (400, b"Cache not flushed: requests are running"))
    assert client.flush_cache(wait_s=2.0) is False
    assert client.flush_cache() is True
    assert [r.query for r in engine.requests if r.path == "/flush_cache"] == ["timeout=2.0", ""]


def test_abort_404_hints_at_routers(client: EngineClient, engine: EngineState):
    engine.missing_paths.add("/abort_request")
    with pytest.raises(EngineRequestError, match="router"):
        client.abort_request(abort_all=True)


def test_get_weights_by_name(client: EngineClient, engine: EngineState):
    assert client.get_weights_by_name("lm_head.weight", truncate_size=2) == [0.5, 0.5]
    assert engine.bodies("/get_weights_by_name") == [{"name": "lm_head.weight", "truncate_size": 2}]


# ----------------------------------------------------------------------------------------------------------------
# protocol types


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, r"temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, r"top_k must be -1 \(whole vocabulary\) or >= 1"),
        ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
        ({"max_new_tokens": -1}, r"max_new_tokens must be >= 0"),
        ({"n": 0}, r"n must be >= 1"),
        ({"n": True}, r"n must be an integer, got True \(bool\)"),
        ({"max_new_tokens": 1.5}, r"max_new_tokens must be an integer"),
        ({"temperature": "hot"}, r"temperature must be a number"),
        ({"temperature": float("nan")}, r"temperature must be finite"),
        ({"ignore_eos": 1}, r"ignore_eos must be true or false"),
        ({"stop_token_ids": [1, -1]}, r"stop_token_ids\[1\] must be a non-negative integer"),
        ({"sampling_seed": -3}, r"sampling_seed must be >= 0"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, Any], message: str):
    with pytest.raises(ValueError, match="sampling_params." + message):
        SamplingParams(**kwargs)


def test_sampling_params_from_dict_and_to_dict():
    params = SamplingParams.from_dict(
        {
            "max_new_tokens": 16,
            "temperature": 0,
            "top_p": None,  # null means default, as in SGLang
            "stop": "</s>",
            "frequency_penalty": 0.0,  # unsupported keys at their default are fine
            "repetition_penalty": 1,
            "json_schema": None,
            "stream_interval": 8,
        }
    )
    assert params == SamplingParams(max_new_tokens=16, temperature=0.0, stop=("</s>",))
    assert params.is_greedy and not params.truncates_support
    assert params.to_dict() == {"max_new_tokens": 16, "temperature": 0.0, "stop": ["</s>"]}
    assert SamplingParams().to_dict() == {"max_new_tokens": 128}
    assert SamplingParams(top_p=0.9).truncates_support
    assert SamplingParams.from_dict(SamplingParams(top_k=5, stop_token_ids=(1, 2)).to_dict()) == SamplingParams(
        top_k=5, stop_token_ids=(1, 2)
    )
    with pytest.raises(ValueError, match="frequency_penalty=0.5 is not supported by the embedded engine"):
        SamplingParams.from_dict({"frequency_penalty": 0.5})
    with pytest.raises(ValueError, match=r"regex='\[a-z\]\+' is not supported"):
        SamplingParams.from_dict({"regex": "[a-z]+"})
    with pytest.raises(ValueError, match=r"unknown key 'temprature' in sampling_params; valid keys: \[.*'temperature'"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="sampling_params must be a JSON object"):
        SamplingParams.from_dict([1])


def test_generate_request_from_dict_validation():
    request = GenerateRequest.from_dict(
        {
            "input_ids": [[1, 2], [3]],
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
            "return_logprob": [True, True],
            "rid": ["a", "b"],
            "log_metrics": True,
            "top_logprobs_num": 0,
        }
    )
    assert request.is_batch and request.batch_size == 2 and request.num_results == 2
    assert request.params_for(1).max_new_tokens == 2 and request.return_logprob is True
    assert GenerateRequest.from_dict(request.to_dict()) == request
    text_request = GenerateRequest.from_dict({"text": "hello"})
    assert not text_request.is_batch and text_request.to_dict()["text"] == "hello"
    # Callers may pass already-parsed sampling params.
    parsed = GenerateRequest.from_dict({"input_ids": [1], "sampling_params": SamplingParams(n=3)})
    assert parsed.returns_list and parsed.num_results == 3

    errors = {
        "send exactly one of text or input_ids": {"text": "a", "input_ids": [1]},
        "one of input_ids": {"sampling_params": {}},
        "input_ids is empty": {"input_ids": []},
        r"input_ids\[0\]\[1\] must be a non-negative integer": {"input_ids": [[1, "x"]]},
        r"input_ids\[1\] must be a non-negative integer token id, got \[2\]": {"input_ids": [1, [2]]},
        "sampling_params has 1 entries but the batch has 2": {"input_ids": [[1], [2]], "sampling_params": [{}]},
        "sampling_params must be one object for a single prompt": {"input_ids": [1], "sampling_params": [{}]},
        r"sampling_params\[1\]: sampling_params.top_k": {
            "input_ids": [[1], [2]],
            "sampling_params": [{}, {"top_k": 0}],
        },
        "n must be the same for every item": {"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]},
        "rid must be a list of 2 ids": {"input_ids": [[1], [2]], "rid": "x"},
        "per-item return_logprob values differ": {"input_ids": [[1], [2]], "return_logprob": [True, False]},
        r"token_ids_logprob=\[3\] is not supported by the embedded engine": {
            "input_ids": [1],
            "token_ids_logprob": [3],
        },
        "top_logprobs_num must be >= 0": {"input_ids": [1], "top_logprobs_num": -1},
        "unknown key 'prompt' in the /generate body; valid keys": {"input_ids": [1], "prompt": "x"},
        "logprob_start_len must be >= -1": {"input_ids": [1], "logprob_start_len": -2},
        r"return_sampling_mask needs a truncated sampling support, but sampling_params\[1\]": {
            "input_ids": [[1], [2]],
            "sampling_params": [{"top_p": 0.9}, {}],
            "return_sampling_mask": True,
        },
    }
    for message, body in errors.items():
        with pytest.raises(ValueError, match=message):
            GenerateRequest.from_dict(body)


def test_generate_result_round_trip_and_extensions():
    result = GenerateResult(
        text="ab",
        output_ids=[4, 5, 6],
        rid="r1",
        finish_reason=FinishReason(type="stop", matched=6),
        prompt_tokens=2,
        completion_tokens=3,
        weight_version="2",
        output_token_logprobs=[-0.1, -0.2, -0.3],
        weight_versions=[
            WeightVersionSpan(version="1", start=0, end=2),
            WeightVersionSpan(version="2", start=2, end=3),
        ],
        sampling_mask=[[4, 9], [5], [6, 1]],
        support_logprobs=[-0.05, 0.0, -0.1],
        num_retractions=1,
        e2e_latency_s=0.5,
    )
    wire = json.loads(jsonwire.dumps(result.to_response(token_texts=["a", "b", None])))  # what the server sends
    assert wire["meta_info"]["output_token_logprobs"] == [[-0.1, 4, "a"], [-0.2, 5, "b"], [-0.3, 6, None]]
    assert wire["meta_info"]["finish_reason"] == {"type": "stop", "matched": 6}
    assert wire["meta_info"]["weight_versions"][1] == {"version": "2", "start": 2, "end": 3}
    parsed = GenerateResult.from_response(json.loads(json.dumps(wire)))
    assert parsed == result
    assert token_weight_versions(parsed, "http://engine") == [1, 1, 2]
    assert parse_generate_response([wire, wire]) == [result, result]

    # Upstream SGLang shapes: no extensions, older retraction key, abort with a message.
    upstream = {
        "output_ids": [1],
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": "abort", "message": "aborted by pause", "status_code": 200},
            "prompt_tokens": 3,
            "completion_tokens": 1,
            "total_retractions": 2,
            "weight_version": "default",
        },
    }
    parsed_upstream = GenerateResult.from_response(upstream)
    assert parsed_upstream.aborted and parsed_upstream.num_retractions == 2
    assert parsed_upstream.output_token_logprobs is None and parsed_upstream.weight_versions is None
    assert token_weight_versions(parsed_upstream, "http://engine") == [0]

    with pytest.raises(ValueError, match="weight_versions spans cover 2 tokens, the output has 3"):
        GenerateResult(text=None, output_ids=[1, 2, 3], rid="", finish_reason=None,
                       weight_versions=[WeightVersionSpan(version="1", start=0, end=2)])  # fmt: skip
    with pytest.raises(ValueError, match="sampling_mask has 1 entries for 2 output tokens"):
        GenerateResult(text=None, output_ids=[1, 2], rid="", finish_reason=None, sampling_mask=[[1]])
    with pytest.raises(ValueError, match=r"finish_reason.type must be one of \['stop', 'length', 'abort'\]"):
        FinishReason.from_dict({"type": "eos"})
    with pytest.raises(ValueError, match="end > start"):
        WeightVersionSpan(version="1", start=2, end=2)


def test_weight_update_types_validate_for_the_server():
    body = {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[2], [3, 4]]}
    request = UpdateWeightsFromDistributed.from_dict(body)
    assert request.shapes == ((2,), (3, 4)) and request.flush_cache and not request.abort_all_requests
    assert UpdateWeightsFromDistributed.from_dict(request.to_dict()) == request
    with pytest.raises(ValueError, match=r"send 'bfloat16'"):
        UpdateWeightsFromDistributed.from_dict({**body, "dtypes": ["torch.bfloat16", "float32"]})
    with pytest.raises(ValueError, match="got 2 names, 2 dtypes, 1 shapes"):
        UpdateWeightsFromDistributed.from_dict({**body, "shapes": [[2]]})
    with pytest.raises(ValueError, match=r"load_format must be one of \[None, 'flattened_bucket'\]"):
        UpdateWeightsFromDistributed.from_dict({**body, "load_format": "bucket"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['flush'\]"):
        UpdateWeightsFromDistributed.from_dict({**body, "flush": True})
    with pytest.raises(ValueError, match="missing required key"):
        UpdateWeightsFromDistributed.from_dict({"names": ["a"]})

    init = InitWeightsUpdateGroup.from_dict(
        {"master_address": "h", "master_port": 1234, "rank_offset": 1, "world_size": 3, "backend": "gloo"}
    )
    assert init.group_name == "weight_update_group"
    with pytest.raises(ValueError, match=r"rank_offset \(2\) must be < world_size \(2\)"):
        InitWeightsUpdateGroup(master_address="h", master_port=1, rank_offset=2, world_size=2)
    with pytest.raises(ValueError, match="master_port must be <= 65535"):
        InitWeightsUpdateGroup(master_address="h", master_port=70000, rank_offset=1, world_size=2)

    tensor = UpdateWeightsFromTensor.from_dict({"serialized_named_tensors": ["abc"], "weight_version": "3"})
    assert tensor.to_dict()["serialized_named_tensors"] == ["abc"] and tensor.flush_cache
    with pytest.raises(ValueError, match="serialized_named_tensors is empty"):
        UpdateWeightsFromTensor(serialized_named_tensors=())

    # SGLang's server default for a missing flag is to abort everything; the embedded server mirrors it.
    assert UpdateWeightVersion.from_dict({"new_version": "9"}).abort_all_requests is True
    assert UpdateWeightVersion(new_version="9").to_dict() == {"new_version": "9", "abort_all_requests": False}
    with pytest.raises(ValueError, match="new_version must be a non-empty string"):
        UpdateWeightVersion.from_dict({"new_version": ""})

    assert PauseGeneration.from_dict(None).mode == "abort"
    assert PauseGeneration.from_dict({"mode": "in_place"}).mode == "in_place"
    assert MemoryOccupation.from_dict({"tags": None}).tags is None
    assert MemoryOccupation.from_dict({"tags": ["kv_cache", "cuda_graph"]}).tags == ("kv_cache", "cuda_graph")
    assert AbortRequest.from_dict({}) == AbortRequest(rid="", abort_all=False)


# ----------------------------------------------------------------------------------------------------------------
# the contract as data


def test_every_endpoint_retries_as_the_failure_model_says():
    from hpcrl.engine import contract as C

    never = {name for name, e in C.ENDPOINTS.items() if e.retry is C.Retry.NEVER}
    assert never == {
        "init_weights_update_group",
        "destroy_weights_update_group",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
    }
    assert C.GENERATE.retry is C.Retry.CONNECT
    assert C.RELEASE_MEMORY_OCCUPATION.retry is C.Retry.CONNECT
    # Request types name their endpoint; older SGLang names of a path come after the current one.
    assert UpdateWeightVersion.endpoint is C.UPDATE_WEIGHT_VERSION and GenerateRequest.endpoint is C.GENERATE
    assert C.MODEL_INFO.paths == ("/model_info", "/get_model_info")
    assert C.SERVER_INFO.paths == ("/server_info", "/get_server_info")


def test_server_info_falls_back_to_the_old_path_and_remembers_it(client: EngineClient, engine: EngineState):
    engine.missing_paths.add("/server_info")
    assert client.server_info()["version"] == "0.0-test"
    assert client.server_info()["tp_size"] == 1
    gets = [r.path for r in engine.requests]
    assert gets == ["/server_info", "/get_server_info", "/get_server_info"]


def test_generic_call_sends_a_raw_body_and_surfaces_the_servers_error(client: EngineClient, engine: EngineState):
    from hpcrl.engine import contract as C

    engine.script("/generate", (400, {"error": {"message": "unknown field 'foo'"}}))
    with pytest.raises(EngineRequestError, match="HTTP 400: unknown field 'foo'"):
        client.call(C.GENERATE, {"input_ids": [1], "foo": 1})
    assert engine.bodies("/generate") == [{"input_ids": [1], "foo": 1}]
    assert client.call(C.MODEL_INFO)["model_path"] == "tiny"


def _meta_with(**extra: Any) -> dict[str, Any]:
    return {
        "output_ids": [4, 5],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": 2},
            "output_token_logprobs": [[-0.5, 4, None], [-0.25, 5, None]],
            **extra,
        },
    }


def test_sampling_supports_read_under_sglang_0_5_16_and_embedded_names():
    masks, support = [[4, 9], [5]], [-0.1, 0.0]
    sglang = GenerateResult.from_response(
        _meta_with(
            output_token_sampling_mask=masks,
            output_token_sampling_logprobs=support,
            output_token_sampling_mask_length=2,
            num_retractions=1,
        )
    )
    older = GenerateResult.from_response(_meta_with(sampling_mask=masks, support_logprobs=support, total_retractions=1))
    for result in (sglang, older):
        assert result.sampling_mask == masks and result.support_logprobs == support
        assert result.num_retractions == 1
    # What hpcrl sends (the embedded engine) is 0.5.16's form only, whatever names it read.
    wire = older.to_response()["meta_info"]
    assert wire["output_token_sampling_mask"] == masks and wire["output_token_sampling_logprobs"] == support
    assert wire["output_token_sampling_mask_length"] == 2
    assert not {"sampling_mask", "support_logprobs", "total_retractions"} & set(wire)
    with pytest.raises(ValueError, match="output_token_sampling_mask has 1 entries for 2 output tokens|"
                       r"sampling_mask has 1 entries for 2 output tokens"):  # fmt: skip
        GenerateResult.from_response(_meta_with(output_token_sampling_mask=[[4]]))


def test_an_idle_connection_past_the_servers_keep_alive_is_never_reused():
    """SGLang's uvicorn closes a connection after 5 s idle; a request sent on it as it closes gets no answer, and a
    /generate is not re-sent, so one such race ended an H200 run (docs/sglang.md). This server behaves like that
    timer firing as the request arrives: a request on a connection idle for more than 2.2 s is read and the
    connection closed unanswered. The client must not send on a connection that idle (httpx's default expiry, 5 s,
    would), so the second /generate, 2.5 s after the first, must be answered."""
    from hpcrl.engine.client_transport import KEEPALIVE_EXPIRY_S
    from tests.support import tcp_server

    server_idle_limit_s = 2.2
    assert KEEPALIVE_EXPIRY_S < server_idle_limit_s < 2.5
    body = json.dumps(_meta_with()).encode()
    answered, dropped = [], []

    def serve(conn: socket.socket) -> None:
        last_s = None
        with conn, conn.makefile("rb") as rfile:
            while True:
                head = []
                while (line := rfile.readline()) not in (b"\r\n", b""):
                    head.append(line)
                if not head:
                    return
                length = next((int(h.split(b":")[1]) for h in head if h.lower().startswith(b"content-length")), 0)
                rfile.read(length)
                if last_s is not None and time.monotonic() - last_s > server_idle_limit_s:
                    dropped.append(head[0])
                    return  # the keep-alive timer fired: close, no answer
                answered.append(head[0])
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
                last_s = time.monotonic()

    listener = tcp_server(serve)
    try:
        with EngineClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=10) as client:
            assert client.generate([1], SamplingParams(max_new_tokens=2)).output_ids == [4, 5]
            time.sleep(2.5)
            assert client.generate([1], SamplingParams(max_new_tokens=2)).output_ids == [4, 5]
    finally:
        listener.close()
    # The first /generate with log-probs is preceded by the client's one /server_info (which log-prob wire).
    assert [line.split()[:2] for line in answered] == [[b"GET", b"/server_info"]] + [[b"POST", b"/generate"]] * 2
    assert dropped == []


def test_many_threads_sharing_a_client_never_lose_a_request_to_a_connection_closed_under_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """httpx's shared pool (httpcore 1.0.9) can close a connection whose keep-alive just expired after another
    thread was given it and began its request: that request fails with "[Errno 9] Bad file descriptor" or hangs to
    its read timeout (one such /generate hung a 128-episode multi-turn run for 600 s). A keep-alive of 0.5 ms puts
    every reuse at that edge: 64 threads x 40 calls through 16 connections lost 14 to 65 calls per run with the
    shared pool on this machine. Every call must be answered, and no more connections opened than allowed."""
    import hpcrl.engine.client_transport as client_module

    class Quick(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        peers: set[tuple[str, int]] = set()
        lock = threading.Lock()

        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            time.sleep(0.002)
            data = json.dumps(_meta_with()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 512  # connection churn must not overflow the listen backlog (a reset, not the race)

    monkeypatch.setattr(client_module, "KEEPALIVE_EXPIRY_S", 0.0005)
    srv = Server(("127.0.0.1", 0), Quick)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    failures: list[str] = []
    answered = [0]
    count_lock = threading.Lock()
    try:
        with EngineClient(
            f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=20, max_retries=0, max_connections=16
        ) as client:

            def calls(_: int) -> None:
                for _ in range(40):
                    try:
                        client.generate([1], SamplingParams(max_new_tokens=2))
                    except EngineError as exc:
                        failures.append(str(exc)[:200])
                    else:
                        with count_lock:
                            answered[0] += 1

            threads = [threading.Thread(target=calls, args=(i,)) for i in range(64)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert failures == [] and answered[0] == 64 * 40
            assert len(client._connections._made) <= 16
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize(
    ("entries", "error"),
    [
        ([[-0.1, 4, None], [-0.2]], r"output_token_logprobs\[1\] must be \[logprob, token_id, text\]"),
        ([[-0.1, 4, None], ["x", 5, None]], r"output_token_logprobs\[1\]\[0\] must be a number"),
        ([[None, 4, None]], r"output_token_logprobs\[0\]\[0\] must be a number"),  # a NaN log-prob, sent as null
        ([[-0.1, 4, None], [-0.2, -5, None]], r"output_token_logprobs\[1\]\[1\] must be >= 0"),
        ([[-0.1, True, None]], r"output_token_logprobs\[0\]\[1\] must be an integer"),
        ([[-0.1, 4, None], "ab"], r"output_token_logprobs\[1\] must be a list"),
    ],
)
def test_a_malformed_log_prob_entry_is_named_by_its_index(entries: list[Any], error: str) -> None:
    answer = {"output_ids": [], "meta_info": {"id": "r", "output_token_logprobs": entries}}
    with pytest.raises(ValueError, match=error):
        GenerateResult.from_response(answer)


def test_log_prob_entries_parse_to_the_same_columns_however_they_come() -> None:
    lists = [[-0.5, 7, None], [-1.25, 0, "a"]]
    tuples = [(-0.5, 7, None), (-1.25, 0, "a")]
    integral = [[0, 7, None], [-1.25, 0, "a"]]  # a log-prob of 0 written as an integer
    for entries, logprobs in ((lists, [-0.5, -1.25]), (tuples, [-0.5, -1.25]), (integral, [0.0, -1.25])):
        meta = {"id": "r", "output_token_logprobs": entries}
        result = GenerateResult.from_response({"output_ids": [], "meta_info": meta})
        assert result.output_token_logprobs == logprobs and result.output_ids == [7, 0]
        assert all(type(x) is float for x in result.output_token_logprobs)


# ----------------------------------------------------------------------------------------------------------------
# the packed log-prob wire (hpcrl's extension; the embedded engine's side is in test_engine.py)


def _packed(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}d", *values)).decode()


def test_the_client_asks_for_packed_log_probs_only_from_an_engine_that_lists_them(server: _Server, engine: EngineState):
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}"
    params = SamplingParams(max_new_tokens=3)
    # An engine whose /server_info has no logprob_wire (SGLang): the triples, and not one unknown key in the body.
    with EngineClient(url, retry_backoff_s=0.01) as client:
        triples = [client.generate([5, 6], params), client.generate([[5, 6], [1]], params)]
        assert client.speaks_packed_logprobs() is False
    assert engine.count("/server_info") == 1, "asked once, then remembered"
    assert not any("return_logprob_packed" in body for body in engine.bodies("/generate"))

    engine.requests.clear()
    engine.logprob_wire = ["triples", "packed"]
    with EngineClient(url, retry_backoff_s=0.01) as client:
        packed = [client.generate([5, 6], params), client.generate([[5, 6], [1]], params)]
        assert client.speaks_packed_logprobs() is True
        # Without log-probs, or with a text per token (which only the triples carry), the request stays as asked.
        client.generate([5, 6], params, return_logprob=False)
        client.generate_request(GenerateRequest(input_ids=[5], return_logprob=True, return_text_in_logprobs=True))
    assert engine.count("/server_info") == 1
    flags = [body.get("return_logprob_packed") for body in engine.bodies("/generate")]
    assert flags == [True, True, None, None]
    assert packed == triples  # the same results, whichever wire carried the log-probs
    assert "output_token_logprobs_packed" in packed[0].meta_info  # type: ignore[union-attr]


def test_an_unanswered_server_info_sends_triples_and_is_asked_again_later(
    client: EngineClient, engine: EngineState, monkeypatch: pytest.MonkeyPatch
):
    engine.logprob_wire = ["triples", "packed"]
    engine.script("/server_info", *[(503, {"error": {"message": "warming up"}})] * 4)
    # The probe is an optimisation: its failure costs the request nothing but the packed wire.
    assert client.generate([1], SamplingParams(max_new_tokens=1)).output_token_logprobs == [-0.25]  # type: ignore[union-attr]
    assert "return_logprob_packed" not in engine.bodies("/generate")[-1]
    asked = engine.count("/server_info")
    client.generate([1], SamplingParams(max_new_tokens=1))
    assert engine.count("/server_info") == asked  # not again within WIRE_PROBE_RETRY_S
    assert "return_logprob_packed" not in engine.bodies("/generate")[-1]
    monkeypatch.setattr(client, "_wire_retry_at", 0.0)  # the retry time has passed
    assert client.generate([1], SamplingParams(max_new_tokens=1)).output_token_logprobs == [-0.25]  # type: ignore[union-attr]
    assert engine.bodies("/generate")[-1]["return_logprob_packed"] is True

    engine.missing_paths |= {"/server_info", "/get_server_info"}  # an older server: no server info at all
    with EngineClient(client.url, retry_backoff_s=0.01) as old:
        assert old.generate([1], SamplingParams(max_new_tokens=1)).output_token_logprobs == [-0.25]  # type: ignore[union-attr]
        assert old.speaks_packed_logprobs() is False  # a 404 is an answer: remembered, not asked again
        assert engine.count("/get_server_info") + engine.count("/server_info") == asked + 3
    assert "return_logprob_packed" not in engine.bodies("/generate")[-1]


def test_a_slow_server_info_holds_up_only_the_request_that_asks(client: EngineClient, engine: EngineState):
    engine.logprob_wire = ["triples", "packed"]
    engine.script("/server_info", ("sleep", 3.0))
    with ThreadPoolExecutor(max_workers=4) as pool:
        first = pool.submit(client.generate, [1], SamplingParams(max_new_tokens=1))
        while engine.count("/server_info") == 0:  # the first request is probing
            time.sleep(0.01)
        others = [pool.submit(client.generate, [1], SamplingParams(max_new_tokens=1)) for _ in range(3)]
        for f in others:
            f.result()
        # They went as triples, not in line behind the probe, which is still asleep.
        assert not first.done()
        first.result()
    bodies = engine.bodies("/generate")
    assert sum("return_logprob_packed" not in b for b in bodies) == 3
    assert bodies[-1]["return_logprob_packed"] is True  # the prober, answered "packed"
    assert engine.count("/server_info") == 1


def test_a_failed_packed_request_makes_the_client_ask_again(client: EngineClient, engine: EngineState):
    engine.logprob_wire = ["triples", "packed"]
    client.generate([1], SamplingParams(max_new_tokens=1))
    assert engine.bodies("/generate")[-1]["return_logprob_packed"] is True
    # SGLang now answers at the URL: it refuses the field, and the client stops trusting what it remembered.
    engine.logprob_wire = None
    engine.script("/generate", (400, {"error": {"message": "unexpected keyword argument 'return_logprob_packed'"}}))
    with pytest.raises(EngineRequestError, match="return_logprob_packed"):
        client.generate([1], SamplingParams(max_new_tokens=1))
    assert client.generate([1], SamplingParams(max_new_tokens=1)).output_token_logprobs == [-0.25]  # type: ignore[union-attr]
    assert "return_logprob_packed" not in engine.bodies("/generate")[-1]
    assert engine.count("/server_info") == 2


def test_the_packed_request_flag_is_sent_only_when_set_and_never_with_texts():
    plain = GenerateRequest(input_ids=[1], return_logprob=True)
    assert "return_logprob_packed" not in plain.to_dict()
    packed = GenerateRequest(input_ids=[1], return_logprob=True, return_logprob_packed=True)
    assert packed.to_dict()["return_logprob_packed"] is True
    assert GenerateRequest.from_dict(packed.to_dict()) == packed
    with pytest.raises(ValueError, match="return_logprob_packed and return_text_in_logprobs cannot be combined"):
        GenerateRequest.from_dict({"input_ids": [1], "return_logprob_packed": True, "return_text_in_logprobs": True})
    with pytest.raises(ValueError, match="return_logprob_packed must be true or false"):
        GenerateRequest.from_dict({"input_ids": [1], "return_logprob_packed": "yes"})
    with pytest.raises(ValueError, match=r"unknown key 'return_logprobs_packed' .*'return_logprob_packed'"):
        GenerateRequest.from_dict({"input_ids": [1], "return_logprobs_packed": True})


def test_packed_log_probs_read_as_the_triples_do_bit_for_bit():
    values = [-0.1, -1e-300, -7.123456789012345, 0.0, -(2.0**-1074)]
    ids = [4, 5, 6, 7, 8]
    packed = GenerateResult.from_response(
        {"output_ids": ids, "meta_info": {"output_token_logprobs_packed": _packed(values)}}
    )
    triples = GenerateResult.from_response(
        {
            "output_ids": ids,
            "meta_info": {"output_token_logprobs": [[v, t, None] for v, t in zip(values, ids, strict=True)]},
        }
    )
    assert packed.output_token_logprobs == triples.output_token_logprobs == values
    assert struct.pack("<5d", *packed.output_token_logprobs) == base64.b64decode(_packed(values))  # type: ignore[misc]
    # What the embedded engine writes (pack_logprobs of its array("d")) is that little-endian column.
    assert pack_logprobs(array("d", values)) == pack_logprobs(values) == _packed(values)
    # A parsed packed answer written again goes as triples alone, without its raw packed column next to them.
    wire = json.loads(jsonwire.dumps(packed.to_response()))
    assert "output_token_logprobs_packed" not in wire["meta_info"]
    assert GenerateResult.from_response(wire).output_token_logprobs == values


def test_a_column_packed_while_it_grows_is_the_whole_column_packed() -> None:
    rng = random.Random(5)
    for _ in range(200):
        column: array[float] = array("d")
        growing = GrowingPackedColumn()
        for _ in range(rng.randrange(0, 12)):
            column.extend(-rng.random() * 20 for _ in range(rng.randrange(0, 40)))
            growing.advance(column)
            assert growing.values_packed % 3 == 0 and len(column) - 3 < growing.values_packed <= len(column)
        column.extend(-rng.random() for _ in range(rng.randrange(0, 5)))  # the tail the answer packs
        assert growing.packed(column) == pack_logprobs(column)
    # A column replaced after packing began (a re-score writes a new array) is packed whole, from the new one.
    rescored = array("d", [-1.5, -2.5, -3.5, -4.5])
    assert growing.packed(rescored) == pack_logprobs(rescored)
    growing.advance(rescored)
    assert growing.values_packed == 3 and growing.packed(rescored) == pack_logprobs(rescored)


@pytest.mark.parametrize(
    ("packed", "error"),
    [
        ("not base64!", r"meta_info.output_token_logprobs_packed is not valid base64"),
        (_packed([-0.5]), r"meta_info.output_token_logprobs_packed holds 8 bytes, but 2 output tokens need 16"),
        (_packed([-0.5, -0.25, -1.0]), r"output_token_logprobs_packed holds 24 bytes, but 2 output tokens need 16"),
        (_packed([-0.5, float("nan")]), r"meta_info.output_token_logprobs_packed\[1\] must be a finite log-prob"),
        (_packed([float("-inf"), -0.5]), r"meta_info.output_token_logprobs_packed\[0\] must be a finite log-prob"),
        ([-0.5, -0.25], r"meta_info.output_token_logprobs_packed must be a base64 string"),
    ],
)
def test_a_malformed_packed_log_prob_column_is_named(packed: Any, error: str) -> None:
    answer = {"output_ids": [4, 5], "meta_info": {"id": "r", "output_token_logprobs_packed": packed}}
    with pytest.raises(ValueError, match=error):
        GenerateResult.from_response(answer)


def test_packed_log_probs_need_output_ids_and_never_come_with_the_triples() -> None:
    with pytest.raises(ValueError, match="output_token_logprobs_packed needs output_ids"):
        GenerateResult.from_response({"meta_info": {"output_token_logprobs_packed": _packed([-0.5])}})
    both = _meta_with(output_token_logprobs_packed=_packed([-0.5, -0.25]))
    with pytest.raises(ValueError, match="carries both output_token_logprobs and output_token_logprobs_packed"):
        GenerateResult.from_response(both)
    # The engine client names the broken answer.
    with pytest.raises(ValueError, match=r"result 1: meta_info.output_token_logprobs_packed is not valid base64"):
        parse_generate_response([_meta_with(), {"output_ids": [1], "meta_info": {"output_token_logprobs_packed": "?"}}])
