"""Health, readiness and identity calls of `EngineClient`: /health, /health_generate, /model_info, /server_info,
the weight version, and waiting until an engine is ready."""

from __future__ import annotations

import time
from typing import Any, cast

import httpx

from hpcrl.engine import contract as C
from hpcrl.engine.client_transport import ClientTransport, _error_message
from hpcrl.engine.contract import Endpoint
from hpcrl.engine.errors import (
    EngineBusyError,
    EngineError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnreachableError,
)


class StatusCalls(ClientTransport):
    """Is the engine alive and ready, and what does it serve."""

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
