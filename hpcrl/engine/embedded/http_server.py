"""The embedded engine's aiohttp plumbing: JSON bodies in, JSON answers out, and the server on an event loop of its
own thread."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from hpcrl.engine import jsonwire

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json_response(data: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=jsonwire.dumps(data), status=status, content_type="application/json")


def _error(message: str, status: int = 400) -> web.Response:
    return _json_response({"error": {"message": message}, "success": False, "message": message}, status=status)


def _ok(message: str, **extra: Any) -> web.Response:
    return _json_response({"success": True, "status": "ok", "message": message, **extra})


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


def _bad_request(message: str) -> web.HTTPBadRequest:
    # The shape of _error's answers: SGLang's clients read error.message, its RL endpoints success/message.
    body = {"error": {"message": message}, "success": False, "message": message}
    return web.HTTPBadRequest(text=json.dumps(body), content_type="application/json")


# How long a connection may wait before its request's line and headers have all arrived, counted from the connection
# (or from the previous answer on it): a client that connects and sends nothing, or sends the head a byte at a time,
# is dropped then, instead of holding a socket for aiohttp's default of an hour. aiohttp has no timeout of its own
# for the head; its keep-alive timer is armed when a connection opens and closes one whose next head is incomplete,
# so this is that timer. It also closes a connection idle between requests: hpcrl's client reuses an idle one only
# for KEEPALIVE_EXPIRY_S (2 s) and SGLang's server (uvicorn) closes one after 5 s, so 10 s cuts off no client that
# works with either, and a request head on loopback or a cluster network arrives in milliseconds.
HEADER_TIMEOUT_S = 10.0


class _HttpThread:
    """The aiohttp server on an event loop of its own thread, so that the main thread is the scheduler's."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app, access_log=None, keepalive_timeout=HEADER_TIMEOUT_S)
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
