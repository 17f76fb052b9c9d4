"""The embedded engine: an aiohttp server that answers SGLang's RL contract from hpcrl's own model code.

    hpcrl engine serve --model DIR [--host 127.0.0.1] [--port 30000] [--device cpu|cuda] [--dtype float32|bfloat16]

The HTTP layer (an event loop on a thread of its own) validates requests (with the same protocol types
the client uses) and hands work to the scheduler, which runs on the main thread; blocking control work
(rendezvous, weight receive) runs in a thread pool so the event loop keeps answering /health meanwhile.

The routes are grouped by role over one `EngineCore` (engine_core.py): generate_routes.py, control_routes.py and
weight_routes.py; http_server.py holds the aiohttp plumbing and server_config.py the settings and the API key.
"""

from __future__ import annotations

import gc
import hmac
import logging
import os
import signal
import sys
import time
from typing import Any

from aiohttp import web

from hpcrl.engine.embedded.control_routes import ControlRoutes
from hpcrl.engine.embedded.generate_routes import GenerateRoutes
from hpcrl.engine.embedded.http_server import Handler, _error, _HttpThread, _json_response
from hpcrl.engine.embedded.requests import EngineStateError
from hpcrl.engine.embedded.server_config import ServerConfig
from hpcrl.engine.embedded.weight_routes import WeightRoutes
from hpcrl.engine.kernels_config import describe
from hpcrl.engine.portcheck import bind_error, check_port_free

log = logging.getLogger("hpcrl.engine")


class EmbeddedEngine(GenerateRoutes, ControlRoutes, WeightRoutes):
    """The engine's parts and every route of the contract, as one aiohttp app."""

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
        r.add_post("/update_weights_from_delta", self.update_from_delta)
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
