"""The failures of an engine call, one class per thing a caller does about it (see `client.py`'s failure model)."""

from __future__ import annotations


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
