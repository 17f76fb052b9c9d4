"""HTTP client for one rollout engine speaking the SGLang contract (real SGLang or hpcrl's embedded engine).

The contract is data (`contract.py`: each endpoint's method, paths, retry rule and reply shape): `call` sends
any endpoint; the typed methods below are thin helpers over it.

Failure model (why the retry rules differ per call):
- A connection that could not be established means the request never left this process, so any call may be
  re-sent; after the retries the engine is reported dead (`EngineUnreachableError`), quickly.
- Calls that are safe to repeat (reads, health, flush, pause/continue, abort, version stamps) are also re-sent
  when the engine answers 503 (starting, overloaded) or drops the connection mid-request.
- `generate` is not re-sent once it may have reached the engine: a duplicate would burn engine time and
  could return a sample the caller did not ask for twice.
- Weight-update calls are never re-sent: each pairs with collectives on the trainer side, and a second call
  would wait for broadcasts that never come.
Every call is bounded by a timeout; no loop retries forever.

Log-probs travel as SGLang's `[logprob, token_id, text]` triples, except from an engine whose /server_info lists
"packed" under `logprob_wire` (hpcrl's embedded engine): there `generate_request` asks for them packed
(`return_logprob_packed`, one base64 column of float64), which saves writing, moving and parsing 131k triples per
256 x 512 batch. The client asks /server_info at its first /generate with log-probs and keeps the answer; a packed
request that fails makes it ask again (another engine may answer at the URL now). Stock SGLang never sees the
field: it refuses keys it does not know.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, cast

import httpx

from hpcrl.engine import contract as C
from hpcrl.engine import jsonwire
from hpcrl.engine.contract import Endpoint, Reply, Retry
from hpcrl.engine.protocol import (
    DEFAULT_GROUP_NAME,
    PAUSE_MODES,
    AbortRequest,
    ContinueGeneration,
    DestroyWeightsUpdateGroup,
    GenerateRequest,
    GenerateResult,
    GetWeightsByName,
    InitWeightsUpdateGroup,
    MemoryOccupation,
    Message,
    PauseGeneration,
    PauseMode,
    SamplingParams,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    UpdateWeightVersion,
    parse_generate_response,
)
from hpcrl.engine.versions import format_weight_version, parse_weight_version

__all__ = [
    "EngineBusyError",
    "EngineClient",
    "EngineError",
    "EngineRequestError",
    "EngineTimeoutError",
    "EngineUnreachableError",
]

logger = logging.getLogger(__name__)

WIRE_PROBE_TIMEOUT_S = 10.0
"""The most a /generate waits for the /server_info that says whether the engine takes packed log-probs."""
WIRE_PROBE_RETRY_S = 30.0
"""After a probe that got no answer, requests go as triples for this long before the next probe."""

# Exponential backoff doubles from retry_backoff_s; the cap keeps a long retry chain from sleeping minutes.
_MAX_BACKOFF_S = 8.0
# An idle kept-alive connection is reused only this long. SGLang's uvicorn closes one after 5 s idle
# (SGLANG_TIMEOUT_KEEP_ALIVE), httpx's default expiry is also 5 s: a request sent on a connection the server is
# closing at that moment gets no answer ("Server disconnected without sending a response"), and a /generate is
# not re-sent. Seen on the H200 mid-run (docs/sglang.md); 2 s leaves the server's timer a 3 s margin.
KEEPALIVE_EXPIRY_S = 2.0
_JSON_HEADERS = {"content-type": "application/json"}  # of a body written here (orjson), not by httpx's json=
# Error bodies can be whole HTML pages from a proxy; the first part is enough to name the problem.
_MAX_ERROR_CHARS = 500


class EngineError(RuntimeError):
    """Base of every engine-client failure; `url` is the engine's base URL."""

    def __init__(self, message: str, *, url: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status_code = status_code


class EngineUnreachableError(EngineError):
    """No connection to the engine (refused, DNS, connect timeout) or it closed the connection: dead or gone."""


class EngineRequestError(EngineError):
    """The engine answered with an error (HTTP 4xx, 5xx other than 503, or {"success": false}); not retried."""


class EngineTimeoutError(EngineError):
    """The engine accepted the connection but did not answer within the timeout."""


class EngineBusyError(EngineError):
    """The engine kept answering 503 (starting up, overloaded or unhealthy) through all retries."""


def _normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("engine url is empty; pass e.g. 'http://127.0.0.1:30000'")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"engine url {url!r} must use http:// or https://")
    return url


def _error_message(response: httpx.Response) -> str:
    """The server's own error text: {"error": {"message"}} (SGLang), {"message"}, {"detail"} (FastAPI) or raw."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:_MAX_ERROR_CHARS].strip() or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if key in body:
                value = body[key]
                return value if isinstance(value, str) else json.dumps(value)[:_MAX_ERROR_CHARS]
    return json.dumps(body)[:_MAX_ERROR_CHARS]


class _LentConnections:
    """Up to `size` httpx clients of one connection each; a call borrows one and no other thread uses it meanwhile.

    Not one httpx client shared by the threads: its pool (httpcore 1.0.9) lets one thread close a kept-alive
    connection whose keep-alive just expired while another thread, given that connection a moment earlier, has
    started its request on it (encode/httpcore#1110). That request then fails with "[Errno 9] Bad file
    descriptor", or waits out its whole read timeout; seen in a multi-turn run, 128 episodes at once, where a
    /generate hung for 600 s and ended the run. A client that only one thread uses at a time has no such race.
    Waiters are served first come, first served (a returned client goes straight to the oldest waiter), as
    httpcore's queue does; the most recently returned idle client is lent first, its connection the freshest.
    """

    def __init__(self, make: Callable[[], httpx.Client], size: int) -> None:
        self._make, self._size = make, size
        self._lock = threading.Lock()
        self._idle: list[httpx.Client] = []
        self._made: list[httpx.Client] = []
        self._waiters: collections.deque[tuple[threading.Event, list[httpx.Client | None]]] = collections.deque()
        self._closed = False

    @contextmanager
    def lend(self, wait_s: float | None) -> Iterator[httpx.Client]:
        client = self._take(wait_s)
        try:
            yield client
        finally:
            self._give_back(client)

    def _take(self, wait_s: float | None) -> httpx.Client:
        with self._lock:
            if self._closed:
                raise RuntimeError("this engine client is closed")
            if self._idle:
                return self._idle.pop()
            if len(self._made) < self._size:
                self._made.append(self._make())
                return self._made[-1]
            waiter: tuple[threading.Event, list[httpx.Client | None]] = (threading.Event(), [])
            self._waiters.append(waiter)
        waiter[0].wait(wait_s)
        with self._lock:
            if not waiter[1]:  # timed out (or closed) before a client was handed over
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                if self._closed:
                    raise RuntimeError("this engine client is closed")
                raise httpx.PoolTimeout(f"none of the {self._size} connections was free within {wait_s} s")
        client = waiter[1][0]
        assert client is not None
        return client

    def _give_back(self, client: httpx.Client) -> None:
        with self._lock:
            if self._waiters:
                event, box = self._waiters.popleft()
                box.append(client)
                event.set()
            else:
                self._idle.append(client)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            made, self._made, self._idle = self._made, [], []
            for event, _ in self._waiters:
                event.set()
            self._waiters.clear()
        for client in made:
            client.close()


class EngineClient:
    """Synchronous client of one engine, safe to share between threads (each call borrows a connection of its own).

    `timeout_s` bounds each wait for the engine's bytes (for a non-streaming call, the whole answer);
    `connect_timeout_s` bounds establishing a connection, kept short so that a dead engine shows quickly.
    Every method takes `timeout_s=` to override the default for that call.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_connections: int = 256,
    ) -> None:
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) and connect_timeout_s ({connect_timeout_s}) must be > 0")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {retry_backoff_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.url = _normalise_url(url)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_retries = max_retries
        self.retry_backoff_s = float(retry_backoff_s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

        def one_connection() -> httpx.Client:
            return httpx.Client(
                base_url=self.url,
                headers=headers,
                timeout=self._timeout(None),
                limits=httpx.Limits(
                    max_connections=1, max_keepalive_connections=1, keepalive_expiry=KEEPALIVE_EXPIRY_S
                ),
                # HPC login and compute nodes often export http_proxy; engine traffic must never go through it.
                trust_env=False,
            )

        self._connections = _LentConnections(one_connection, max_connections)
        # Endpoint paths changed across SGLang versions (/get_model_info -> /model_info); remember what worked.
        self._path_cache: dict[str, str] = {}
        self._path_lock = threading.Lock()
        # Whether the engine answers return_logprob_packed (None: not known yet); see speaks_packed_logprobs.
        self._packed_logprobs: bool | None = None
        self._wire_probing = False
        self._wire_retry_at = 0.0  # time.monotonic() before which no probe is sent after one that got no answer
        self._wire_lock = threading.Lock()

    # ----------------------------------------------------------------------------------------------------------
    # lifecycle

    def close(self) -> None:
        self._connections.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        # Never print the api key.
        return f"EngineClient({self.url!r}, timeout_s={self.timeout_s}, max_retries={self.max_retries})"

    # ----------------------------------------------------------------------------------------------------------
    # transport

    def _timeout(self, timeout_s: float | None) -> httpx.Timeout:
        total = self.timeout_s if timeout_s is None else float(timeout_s)
        if total <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        return httpx.Timeout(total, connect=min(self.connect_timeout_s, total))

    def _backoff(self, attempt: int, why: str, method: str, path: str) -> None:
        delay_s = min(self.retry_backoff_s * (2**attempt), _MAX_BACKOFF_S)
        logger.warning(
            "engine %s: %s %s failed (%s); retry %d/%d in %.2f s",
            self.url,
            method,
            path,
            why,
            attempt + 1,
            self.max_retries,
            delay_s,
        )
        time.sleep(delay_s)

    def _request(
        self,
        method: str,
        path: str,
        *,
        retry: Retry,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """Send one request with the retry policy; return a 2xx response or raise an EngineError. `json_body`: a
        JSON object, or its UTF-8 bytes already written."""
        timeout = self._timeout(timeout_s)
        where = f"{method} {self.url}{path}"
        attempts = 1 + (0 if retry is Retry.NEVER else self.max_retries)
        for attempt in range(attempts):
            can_retry = attempt + 1 < attempts
            try:
                with self._connections.lend(timeout.pool) as http:
                    if isinstance(json_body, bytes):
                        response = http.request(
                            method, path, content=json_body, headers=_JSON_HEADERS, params=params, timeout=timeout
                        )
                    else:
                        response = http.request(method, path, json=json_body, params=params, timeout=timeout)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # The request never left: re-sending is safe for every call that retries at all.
                if can_retry:
                    self._backoff(attempt, f"cannot connect: {exc}", method, path)
                    continue
                raise EngineUnreachableError(
                    f"engine at {self.url} is unreachable ({type(exc).__name__}: {exc}) after {attempt + 1} "
                    f"attempt(s) of {where}; check that the engine process is alive and that the address and port "
                    "are right",
                    url=self.url,
                ) from exc
            except httpx.PoolTimeout as exc:
                raise EngineTimeoutError(
                    f"{where}: no free connection in the client's pool within {timeout.pool} s; raise "
                    "max_connections or lower the number of concurrent calls",
                    url=self.url,
                ) from exc
            except httpx.TimeoutException as exc:
                raise EngineTimeoutError(
                    f"{where}: the engine did not answer within {timeout.read} s ({type(exc).__name__}); it may be "
                    "hung or overloaded; raise timeout_s for long calls",
                    url=self.url,
                ) from exc
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError) as exc:
                # The request may have reached the engine, so only repeatable calls are re-sent.
                if retry is Retry.IDEMPOTENT and can_retry:
                    self._backoff(attempt, f"connection dropped: {exc}", method, path)
                    continue
                raise EngineUnreachableError(
                    f"engine at {self.url} closed the connection during {where} ({type(exc).__name__}: {exc}); "
                    "the engine process probably died or restarted",
                    url=self.url,
                ) from exc
            except httpx.HTTPError as exc:
                raise EngineError(f"{where} failed: {type(exc).__name__}: {exc}", url=self.url) from exc

            status = response.status_code
            if status == 503:
                if retry is Retry.IDEMPOTENT and can_retry:
                    self._backoff(attempt, "HTTP 503", method, path)
                    continue
                raise EngineBusyError(
                    f"{where} answered 503 (engine starting, overloaded or unhealthy) after {attempt + 1} "
                    f"attempt(s): {_error_message(response)}",
                    url=self.url,
                    status_code=status,
                )
            if status >= 400:
                hint = ""
                if status in (401, 403):
                    hint = "; pass the engine's --api-key as api_key="
                raise EngineRequestError(
                    f"{where} failed with HTTP {status}: {_error_message(response)}{hint}",
                    url=self.url,
                    status_code=status,
                )
            return response
        raise AssertionError("unreachable: the retry loop always returns or raises")

    def _json(self, response: httpx.Response, what: str) -> Any:
        if not response.content:
            return None
        try:
            return jsonwire.loads(response.content)
        except ValueError as exc:
            raise EngineError(
                f"{what}: the engine answered HTTP {response.status_code} with a body that is not JSON: "
                f"{response.text[:_MAX_ERROR_CHARS]!r}",
                url=self.url,
                status_code=response.status_code,
            ) from exc

    def _send(
        self, endpoint: Endpoint, json_body: Any, params: Mapping[str, Any] | None, timeout_s: float | None
    ) -> tuple[httpx.Response, str]:
        """Send to the first of the endpoint's paths that exists (404 moves on), remembering it for later calls."""
        with self._path_lock:
            known = self._path_cache.get(endpoint.name)
        candidates = [known] if known else list(endpoint.paths)
        for index, path in enumerate(candidates):
            try:
                response = self._request(
                    endpoint.method,
                    path,
                    retry=endpoint.retry,
                    json_body=json_body,
                    params=None if params is None else dict(params),
                    timeout_s=timeout_s,
                )
            except EngineRequestError as exc:
                if exc.status_code == 404 and index + 1 < len(candidates):
                    continue
                raise
            if len(endpoint.paths) > 1:
                with self._path_lock:
                    self._path_cache[endpoint.name] = path
            return response, path
        raise AssertionError("unreachable: the last candidate path returns or raises")

    def call(
        self,
        endpoint: Endpoint,
        body: Message | Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Send one request of the contract and return its reply, checked as `endpoint.reply` says.

        `body` is a request type (validated when it was built) or, for tests and new fields, a raw JSON object.
        Returns: GENERATE a GenerateResult or a list of them; OBJECT and SUCCESS a dict; MAYBE_SUCCESS a dict or
        None; ANY the parsed JSON or None; IGNORED None. Failures raise an EngineError (see the module docstring).
        """
        # A request type was validated when built (its floats are finite): orjson writes it, 7x faster than the
        # standard library (256 prompts x 128 ids: 0.23 against 1.69 ms on a 2-core CPU). A raw object goes through
        # the standard library, which keeps a NaN as NaN for the engine to refuse (orjson would write null).
        json_body: bytes | dict[str, Any] | None
        if isinstance(body, Message):
            json_body = jsonwire.dumps(body.to_dict())
        else:
            json_body = None if body is None else dict(body)
        response, path = self._send(endpoint, json_body, params, timeout_s)
        what = f"{endpoint.method} {path}"
        reply = endpoint.reply
        if reply is Reply.IGNORED:
            return None
        if reply is Reply.MAYBE_SUCCESS:
            # SGLang answers these with an empty body; only an object can carry a failure.
            try:
                parsed = jsonwire.loads(response.content) if response.content else None
            except ValueError:
                return None
            return self._checked(parsed, what, response.status_code) if isinstance(parsed, dict) else None
        parsed = self._json(response, what)
        if reply is Reply.ANY:
            return parsed
        if reply is Reply.GENERATE:
            try:
                return parse_generate_response(parsed)
            except ValueError as exc:
                raise EngineError(f"{what}: malformed response from the engine: {exc}", url=self.url) from exc
        if not isinstance(parsed, dict):
            raise EngineError(f"{what}: expected a JSON object, got {parsed!r}", url=self.url)
        return self._checked(parsed, what, response.status_code) if reply is Reply.SUCCESS else parsed

    def _checked(self, body: dict[str, Any], what: str, status_code: int) -> dict[str, Any]:
        """A {"success": bool, "message": str} body; success false is an error."""
        if body.get("success") is False:
            raise EngineRequestError(
                f"{what} failed on the engine: {body.get('message', '(no message)')}",
                url=self.url,
                status_code=status_code,
            )
        return body

    # ----------------------------------------------------------------------------------------------------------
    # generation

    def generate(
        self,
        input_ids: Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | Sequence[str] | None = None,
        return_sampling_mask: bool = False,
        logprob_start_len: int = -1,
        timeout_s: float | None = None,
    ) -> GenerateResult | list[GenerateResult]:
        """POST /generate with token ids: one prompt (`list[int]`) or a batch (`list[list[int]]`).

        Returns one result for one prompt with n == 1, else a list of `batch_size * n` results, prompt-major.
        An aborted request is a result with `finish_reason.type == "abort"`, not an exception.
        """
        ids: list[int] | list[list[int]]
        if input_ids and isinstance(input_ids[0], Sequence):
            ids = [list(cast(Sequence[int], prompt)) for prompt in input_ids]
        else:
            ids = list(cast(Sequence[int], input_ids))
        params: SamplingParams | list[SamplingParams]
        if sampling_params is None:
            params = SamplingParams()
        elif isinstance(sampling_params, SamplingParams):
            params = sampling_params
        else:
            params = list(sampling_params)
        request = GenerateRequest(
            input_ids=ids,
            sampling_params=params,
            return_logprob=return_logprob,
            rid=rid if rid is None or isinstance(rid, str) else list(rid),
            return_sampling_mask=return_sampling_mask,
            logprob_start_len=logprob_start_len,
        )
        return self.generate_request(request, timeout_s=timeout_s)

    def generate_request(
        self, request: GenerateRequest, *, timeout_s: float | None = None
    ) -> GenerateResult | list[GenerateResult]:
        """POST /generate with a prepared request (also for `text` prompts).

        Log-probs are asked for packed when the engine speaks that wire (`speaks_packed_logprobs`) and the request
        wants no text per token; the result is the same either way. A request that sets return_logprob_packed
        itself is sent as it is.
        """
        if request.stream:
            raise ValueError("EngineClient does not stream; send the request with stream=False")
        if (
            request.return_logprob
            and not request.return_logprob_packed
            and not request.return_text_in_logprobs
            and self.speaks_packed_logprobs(timeout_s=timeout_s)
        ):
            request = dataclasses.replace(request, return_logprob_packed=True)
            try:
                parsed = self.call(C.GENERATE, request, timeout_s=timeout_s)
            except EngineRequestError:
                self._forget_wire()
                raise
        else:
            parsed = self.call(C.GENERATE, request, timeout_s=timeout_s)
        if isinstance(parsed, list) != request.returns_list or (
            isinstance(parsed, list) and len(parsed) != request.num_results
        ):
            got = f"a list of {len(parsed)}" if isinstance(parsed, list) else "one object"
            want = f"a list of {request.num_results}" if request.returns_list else "one object"
            raise EngineError(f"POST /generate: expected {want} result(s), the engine sent {got}", url=self.url)
        return cast(GenerateResult | list[GenerateResult], parsed)

    def generate_many(
        self,
        requests: Sequence[GenerateRequest],
        *,
        max_concurrency: int = 32,
        timeout_s: float | None = None,
    ) -> list[GenerateResult | list[GenerateResult]]:
        """Send requests concurrently from a thread pool; results in request order.

        The first failure cancels the requests not yet sent and is raised; requests already in flight finish.
        """
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(max_concurrency, len(requests))) as pool:
            futures: list[Future[GenerateResult | list[GenerateResult]]] = [
                pool.submit(self.generate_request, request, timeout_s=timeout_s) for request in requests
            ]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                if future in done and future.exception() is not None:
                    for other in futures:
                        other.cancel()
                    raise cast(BaseException, future.exception())
            return [future.result() for future in futures]

    # ----------------------------------------------------------------------------------------------------------
    # health and info

    def health(self, *, timeout_s: float | None = None) -> bool:
        """GET /health: True when the engine answers 200, False when it keeps answering 5xx.

        Raises EngineUnreachableError when nothing answers, so that a dead engine is not mistaken for a busy one.
        """
        return self._probe(C.HEALTH, timeout_s)

    def health_generate(self, *, timeout_s: float | None = None) -> bool:
        """GET /health_generate (runs a one-token generation). One False is not death: it has false negatives
        during long prefills (sgl-project/sglang#22511)."""
        return self._probe(C.HEALTH_GENERATE, timeout_s)

    def _probe(self, endpoint: Endpoint, timeout_s: float | None) -> bool:
        try:
            self.call(endpoint, timeout_s=timeout_s)
        except EngineBusyError:
            return False
        except EngineRequestError as exc:
            if exc.status_code is not None and exc.status_code >= 500:
                return False
            raise
        return True

    def model_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """GET /model_info (older servers: /get_model_info): model_path, weight_version, ..."""
        return cast(dict[str, Any], self.call(C.MODEL_INFO, timeout_s=timeout_s))

    def server_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """GET /server_info (older servers: /get_server_info): server args, scheduler info, version."""
        return cast(dict[str, Any], self.call(C.SERVER_INFO, timeout_s=timeout_s))

    def speaks_packed_logprobs(self, *, timeout_s: float | None = None) -> bool:
        """Whether the engine answers return_logprob_packed: its /server_info lists "packed" under `logprob_wire`
        (hpcrl's embedded engine does; SGLang's has no such key).

        Only an optimisation, so it never raises and never holds a request up for long: one thread asks (within
        WIRE_PROBE_TIMEOUT_S), and requests that come meanwhile, or after a probe that got no answer, go as
        triples, which every engine takes. A /server_info answer, or a 404 on it (an older server), is
        remembered; anything else (unreachable, busy, a 5xx, a malformed body) is asked again after
        WIRE_PROBE_RETRY_S.
        """
        with self._wire_lock:
            if self._packed_logprobs is not None:
                return self._packed_logprobs
            if self._wire_probing or time.monotonic() < self._wire_retry_at:
                return False
            self._wire_probing = True
        answer: bool | None = None
        try:
            probe_s = WIRE_PROBE_TIMEOUT_S if timeout_s is None else min(timeout_s, WIRE_PROBE_TIMEOUT_S)
            wires = self.server_info(timeout_s=probe_s).get("logprob_wire")
            answer = isinstance(wires, list) and "packed" in wires
        except EngineError as exc:
            if exc.status_code == 404:
                answer = False
            else:
                logger.warning(
                    "engine %s: /server_info did not say which log-prob wires it speaks (%s); sending triples, "
                    "asking again in %.0f s",
                    self.url,
                    exc,
                    WIRE_PROBE_RETRY_S,
                )
        finally:
            with self._wire_lock:
                self._wire_probing = False
                self._packed_logprobs = answer
                if answer is None:
                    self._wire_retry_at = time.monotonic() + WIRE_PROBE_RETRY_S
        return bool(answer)

    def _forget_wire(self) -> None:
        """A packed request failed: the engine behind the URL may have changed (SGLang started where an embedded
        engine was), so the next request asks /server_info again rather than trust the remembered answer."""
        with self._wire_lock:
            self._packed_logprobs = None
            self._wire_retry_at = 0.0

    def weight_version(self, *, timeout_s: float | None = None) -> int:
        """The engine's current weight version (model_info; older servers: /get_weight_version)."""
        info = self.model_info(timeout_s=timeout_s)
        if info.get("weight_version") is not None:
            return self._version(info["weight_version"], "/model_info weight_version")
        try:
            body = self.call(C.GET_WEIGHT_VERSION, timeout_s=timeout_s)
        except EngineRequestError as exc:
            if exc.status_code != 404:
                raise
            body = None
        if isinstance(body, dict) and body.get("weight_version") is not None:
            return self._version(body["weight_version"], "/get_weight_version weight_version")
        raise EngineError(
            "the engine reports no weight_version in /model_info or /get_weight_version; it is too old for hpcrl",
            url=self.url,
        )

    def wait_until_ready(self, timeout_s: float, *, poll_s: float = 0.5) -> float:
        """Poll GET /health until it answers 200; return the seconds waited.

        Raises EngineUnreachableError if nothing ever accepted a connection, EngineTimeoutError if the engine
        answered but was not ready in time.
        """
        if timeout_s <= 0 or poll_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) and poll_s ({poll_s}) must be > 0")
        start = time.monotonic()
        deadline = start + timeout_s
        last_problem = "no probe was sent"
        ever_connected = False
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                break
            probe_timeout = httpx.Timeout(
                min(self.timeout_s, remaining_s), connect=min(self.connect_timeout_s, remaining_s)
            )
            try:
                with self._connections.lend(probe_timeout.pool) as http:
                    response = http.get("/health", timeout=probe_timeout)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last_problem = f"cannot connect ({type(exc).__name__}: {exc})"
            except httpx.HTTPError as exc:
                ever_connected = True
                last_problem = f"{type(exc).__name__}: {exc}"
            else:
                ever_connected = True
                if response.status_code == 200:
                    return time.monotonic() - start
                if response.status_code in (401, 403):
                    raise EngineRequestError(
                        f"GET {self.url}/health answered HTTP {response.status_code}: {_error_message(response)}; "
                        "pass the engine's --api-key as api_key=",
                        url=self.url,
                        status_code=response.status_code,
                    )
                last_problem = f"HTTP {response.status_code}"
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
        elapsed_s = time.monotonic() - start
        if not ever_connected:
            raise EngineUnreachableError(
                f"engine at {self.url} did not accept a connection within {elapsed_s:.1f} s (last: {last_problem}); "
                "check the engine's log for a crash during startup and that the address and port are right",
                url=self.url,
            )
        raise EngineTimeoutError(
            f"engine at {self.url} was not ready after {elapsed_s:.1f} s (last /health: {last_problem}); "
            "loading may be slow: raise the readiness timeout, or read the engine's log",
            url=self.url,
        )

    # ----------------------------------------------------------------------------------------------------------
    # cache, abort, pause

    def flush_cache(self, *, wait_s: float | None = None, timeout_s: float | None = None) -> bool:
        """POST /flush_cache: True when flushed, False when the engine refused because requests are running.

        `wait_s` asks newer servers to wait that long for running requests to finish (older ones ignore it).
        """
        params = None if wait_s is None else {"timeout": wait_s}
        try:
            self.call(C.FLUSH_CACHE, params=params, timeout_s=timeout_s)
        except EngineRequestError as exc:
            if exc.status_code == 400:
                return False
            raise
        return True

    def abort_request(self, rid: str = "", abort_all: bool = False, *, timeout_s: float | None = None) -> None:
        """POST /abort_request: abort requests whose rid starts with `rid`, or all of them.

        Send it to each engine URL directly: routers have not always forwarded it (THUDM/slime#2340).
        """
        if not rid and not abort_all:
            raise ValueError("abort_request(rid='') aborts nothing; pass a rid (prefix) or abort_all=True")
        try:
            self.call(C.ABORT_REQUEST, AbortRequest(rid=rid, abort_all=abort_all), timeout_s=timeout_s)
        except EngineRequestError as exc:
            if exc.status_code == 404:
                raise EngineRequestError(
                    f"{exc} (a router in front of the engines may not forward /abort_request: send it to each "
                    "engine's own URL)",
                    url=self.url,
                    status_code=404,
                ) from exc
            raise

    def pause_generation(self, mode: PauseMode = "retract", *, timeout_s: float | None = None) -> dict[str, Any]:
        """POST /pause_generation: 'abort' returns in-flight requests as aborted, 'retract' re-queues them
        (KV recomputed later), 'in_place' freezes them with their KV kept (then flush_cache fails)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        body = PauseGeneration(mode=mode)
        return cast(dict[str, Any], self.call(C.PAUSE_GENERATION, body, timeout_s=timeout_s) or {})

    def continue_generation(self, torch_empty_cache: bool = True, *, timeout_s: float | None = None) -> dict[str, Any]:
        """POST /continue_generation."""
        body = ContinueGeneration(torch_empty_cache=torch_empty_cache)
        return cast(dict[str, Any], self.call(C.CONTINUE_GENERATION, body, timeout_s=timeout_s) or {})

    # ----------------------------------------------------------------------------------------------------------
    # memory (colocated engines; the server needs --enable-memory-saver)

    def release_memory_occupation(
        self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None
    ) -> dict[str, Any] | None:
        """POST /release_memory_occupation; `tags` among weights, kv_cache, cuda_graph (None: all).

        Returns the JSON body when there is one: the embedded engine reports `freed_bytes` per tag; SGLang
        answers an empty body, so a caller that must know what was freed measures it (NVML)."""
        body = MemoryOccupation(tags=None if tags is None else tuple(tags))
        return cast(dict[str, Any] | None, self.call(C.RELEASE_MEMORY_OCCUPATION, body, timeout_s=timeout_s))

    def resume_memory_occupation(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None) -> None:
        """POST /resume_memory_occupation; `tags` among weights, kv_cache, cuda_graph (None: all)."""
        body = MemoryOccupation(tags=None if tags is None else tuple(tags))
        self.call(C.RESUME_MEMORY_OCCUPATION, body, timeout_s=timeout_s)

    # ----------------------------------------------------------------------------------------------------------
    # weights: never re-sent (see the module docstring)

    def init_weights_update_group(
        self, request: InitWeightsUpdateGroup, *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """POST /init_weights_update_group. Blocks until the trainer joins the group: call it concurrently with
        the trainer's init_process_group, and give `timeout_s` longer than that rendezvous may take."""
        return cast(dict[str, Any], self.call(request.endpoint, request, timeout_s=timeout_s))

    def destroy_weights_update_group(
        self, group_name: str = DEFAULT_GROUP_NAME, *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """POST /destroy_weights_update_group."""
        body = DestroyWeightsUpdateGroup(group_name=group_name)
        return cast(dict[str, Any], self.call(body.endpoint, body, timeout_s=timeout_s))

    def update_weights_from_distributed(
        self, request: UpdateWeightsFromDistributed, *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """POST /update_weights_from_distributed; the trainer broadcasts the tensors while this call waits."""
        return cast(dict[str, Any], self.call(request.endpoint, request, timeout_s=timeout_s))

    def update_weights_from_tensor(
        self, request: UpdateWeightsFromTensor, *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """POST /update_weights_from_tensor (CUDA IPC handles; same node only)."""
        return cast(dict[str, Any], self.call(request.endpoint, request, timeout_s=timeout_s))

    def update_weight_version(
        self, version: int, *, abort_all_requests: bool = False, timeout_s: float | None = None
    ) -> int:
        """POST /update_weight_version; returns the version the engine now reports.

        `abort_all_requests` is always sent: SGLang's default is true and aborts all in-flight generation
        (radixark/miles#2372).
        """
        body = UpdateWeightVersion(new_version=format_weight_version(version), abort_all_requests=abort_all_requests)
        result = self.call(body.endpoint, body, timeout_s=timeout_s)
        if result.get("new_version") is None:
            return version
        return self._version(result["new_version"], "/update_weight_version new_version")

    def _version(self, text: object, field: str) -> int:
        """A weight version this engine answered in `field`; one that is not a version is the engine's error."""
        try:
            return parse_weight_version(text, url=self.url, field=field)
        except ValueError as exc:
            raise EngineRequestError(str(exc), url=self.url) from None

    def get_weights_by_name(self, name: str, truncate_size: int = 100, *, timeout_s: float | None = None) -> Any:
        """POST /get_weights_by_name: the first `truncate_size` values of a parameter (nested lists), for tests."""
        body = GetWeightsByName(name=name, truncate_size=truncate_size)
        return self.call(body.endpoint, body, timeout_s=timeout_s)
