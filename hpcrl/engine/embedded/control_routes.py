"""The embedded engine's control and identity routes: health, model and server info, load, cache flush, abort, pause
and continue."""

from __future__ import annotations

import time

from aiohttp import web

from hpcrl.config import to_dict
from hpcrl.engine.embedded.engine_core import EngineCore
from hpcrl.engine.embedded.http_server import _error, _json_body, _json_response
from hpcrl.engine.embedded.kernels import launch
from hpcrl.engine.embedded.requests import EngineStateError
from hpcrl.engine.protocol.answers import (
    LOGPROB_WIRES,
)
from hpcrl.engine.protocol.control import (
    AbortRequest,
    ContinueGeneration,
    PauseGeneration,
)


class ControlRoutes(EngineCore):
    """/health, /model_info, /server_info, /get_load, /flush_cache, /abort_request, /pause_generation,
    /continue_generation."""

    async def health(self, request: web.Request) -> web.Response:
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
                "logprob_wire": list(LOGPROB_WIRES),
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
            req = AbortRequest.from_dict(await _json_body(request))
        except ValueError as exc:
            return _error(str(exc))
        await self._on_scheduler(lambda: self.scheduler.abort(req.rid, req.abort_all))
        return web.Response(text="")

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            req = PauseGeneration.from_dict(await _json_body(request, default={}))
        except ValueError as exc:
            return _error(str(exc))
        await self._on_scheduler(lambda: self.scheduler.pause(req.mode))
        return _json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        try:
            ContinueGeneration.from_dict(await _json_body(request, default={}))
        except ValueError as exc:
            return _error(str(exc))
        await self._on_scheduler(self.scheduler.resume_generation)
        return _json_response({"message": "Generation continued successfully.", "status": "ok"})


def _version() -> str:
    from hpcrl import __version__

    return __version__
