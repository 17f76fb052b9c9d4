"""The HTTP transport under `EngineClient`: one call of the contract with its retry rule, over connections lent
one thread at a time (see `client.py` for the failure model)."""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx

from hpcrl.engine import jsonwire
from hpcrl.engine.contract import Endpoint, Reply, Retry
from hpcrl.engine.errors import (
    EngineBusyError,
    EngineError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnreachableError,
)
from hpcrl.engine.protocol.answers import parse_generate_response
from hpcrl.engine.protocol.fields import Message
from hpcrl.engine.versions import parse_weight_version

logger = logging.getLogger("hpcrl.engine.client")
_Client = TypeVar("_Client", bound="ClientTransport")

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


class ClientTransport:
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

    def close(self) -> None:
        self._connections.close()

    def __enter__(self: _Client) -> _Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        # Never print the api key.
        return f"EngineClient({self.url!r}, timeout_s={self.timeout_s}, max_retries={self.max_retries})"

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

    def _version(self, text: object, field: str) -> int:
        """A weight version this engine answered in `field`; one that is not a version is the engine's error."""
        try:
            return parse_weight_version(text, url=self.url, field=field)
        except ValueError as exc:
            raise EngineRequestError(str(exc), url=self.url) from None

    def _checked(self, body: dict[str, Any], what: str, status_code: int) -> dict[str, Any]:
        """A {"success": bool, "message": str} body; success false is an error."""
        if body.get("success") is False:
            raise EngineRequestError(
                f"{what} failed on the engine: {body.get('message', '(no message)')}",
                url=self.url,
                status_code=status_code,
            )
        return body
