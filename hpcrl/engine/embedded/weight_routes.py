"""The embedded engine's weight routes: weight-update groups, updates from a broadcast or a handover, version stamps,
reading a weight back, and releasing and resuming memory (what a colocated run does around an update)."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

import torch
from aiohttp import web

from hpcrl.engine.embedded.engine_core import EngineCore
from hpcrl.engine.embedded.http_server import _error, _json_body, _json_response, _ok
from hpcrl.engine.embedded.requests import EngineStateError
from hpcrl.engine.protocol.control import (
    MEMORY_TAGS,
    DestroyWeightsUpdateGroup,
    GetWeightsByName,
    InitWeightsUpdateGroup,
    MemoryOccupation,
    UpdateWeightsFromDelta,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    UpdateWeightVersion,
)

if TYPE_CHECKING:
    from hpcrl.engine.embedded.delta_load import DeltaLoader

log = logging.getLogger("hpcrl.engine")


class WeightRoutes(EngineCore):
    """/init_weights_update_group, /destroy_weights_update_group, /update_weights_from_distributed,
    /update_weights_from_tensor, /update_weights_from_delta, /update_weight_version, /get_weights_by_name,
    /release_memory_occupation, /resume_memory_occupation."""

    async def release_memory(self, request: web.Request) -> web.Response:
        try:
            req = MemoryOccupation.from_dict(await _json_body(request, default={}))
            tags = list(req.tags) if req.tags is not None else list(MEMORY_TAGS)
            before, reserved_before = _device_bytes(self.device), _device_reserved(self.device)
            t0 = time.perf_counter()
            freed = await self._on_scheduler(
                lambda: self.scheduler.release_memory(
                    tags, weights_cpu_backup=self.cfg.engine.enable_weights_cpu_backup
                )
            )
            seconds = time.perf_counter() - t0
        except (ValueError, EngineStateError) as exc:
            return _error(str(exc))
        after, reserved_after = _device_bytes(self.device), _device_reserved(self.device)
        log.info("released %s: %s bytes (device allocated %s -> %s)", tags, freed, before, after)
        return _json_response(
            {
                "success": True,
                "freed_bytes": freed,
                "device_allocated_before": before,
                "device_allocated_after": after,
                "device_reserved_before": reserved_before,
                "device_reserved_after": reserved_after,
                "seconds": seconds,
            }
        )

    async def resume_memory(self, request: web.Request) -> web.Response:
        try:
            req = MemoryOccupation.from_dict(await _json_body(request, default={}))
            tags = list(req.tags) if req.tags is not None else list(MEMORY_TAGS)
            t0 = time.perf_counter()
            restored = await self._on_scheduler(lambda: self.scheduler.resume_memory(tags))
            seconds = time.perf_counter() - t0
        except (ValueError, EngineStateError) as exc:
            return _error(str(exc))
        return _json_response(
            {
                "success": True,
                "restored_bytes": restored,
                "device_allocated_after": _device_bytes(self.device),
                "device_reserved_after": _device_reserved(self.device),
                "seconds": seconds,
            }
        )

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            req = InitWeightsUpdateGroup.from_dict(await _json_body(request))
            await self._run(
                lambda: self.weights.init_group(
                    master_address=req.master_address,
                    master_port=req.master_port,
                    rank_offset=req.rank_offset,
                    world_size=req.world_size,
                    group_name=req.group_name,
                    backend=req.backend,
                )
            )
        except web.HTTPException:
            raise  # a malformed body: its own 400 and message
        except Exception as exc:  # noqa: BLE001 - the contract answers every failure as success=false
            return _error(f"{type(exc).__name__}: {exc}")
        return _ok(f"Initialized weight update group {req.group_name}.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            req = DestroyWeightsUpdateGroup.from_dict(await _json_body(request, default={}))
            self.weights.destroy_group(req.group_name)
        except (ValueError, EngineStateError) as exc:
            return _error(str(exc))
        return _ok(f"Destroyed weight update group {req.group_name}.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        try:
            req = UpdateWeightsFromDistributed.from_dict(await _json_body(request))
            if req.abort_all_requests:
                await self._on_scheduler(lambda: self.scheduler.abort(abort_all=True))
            nbytes = await self._run(
                lambda: self.weights.receive_distributed(
                    names=list(req.names),
                    dtypes=list(req.dtypes),
                    shapes=[list(s) for s in req.shapes],
                    group_name=req.group_name,
                    load_format=req.load_format,
                    apply_strategy=req.apply_strategy,
                )
            )
            await self._stamp(req.weight_version)
        except web.HTTPException:
            raise  # a malformed body: its own 400 and message
        except Exception as exc:  # noqa: BLE001
            return _error(f"{type(exc).__name__}: {exc}")
        return _ok(
            f"Succeeded to update parameter online from distributed ({len(req.names)} tensors).",
            bytes=nbytes,
            seconds=time.perf_counter() - t0,
        )

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        from hpcrl.weightwire.handover import UntrustedHandoverError, decode_payload

        t0 = time.perf_counter()
        try:
            req = UpdateWeightsFromTensor.from_dict(await _json_body(request))
            if len(req.serialized_named_tensors) != 1:
                raise ValueError("the embedded engine has one rank: send exactly one serialized_named_tensors entry")
            payload = decode_payload(req.serialized_named_tensors[0])
            if req.abort_all_requests:
                await self._on_scheduler(lambda: self.scheduler.abort(abort_all=True))
            nbytes = await self._run(lambda: self.weights.load_handover(payload, req.apply_strategy))
            await self._stamp(req.weight_version)
        except UntrustedHandoverError as exc:
            log.warning("refused a handover: %s", exc)
            return _error(f"{type(exc).__name__}: {exc}", status=403)
        except web.HTTPException:
            raise  # a malformed body: its own 400 and message
        except Exception as exc:  # noqa: BLE001
            return _error(f"{type(exc).__name__}: {exc}")
        return _ok("Succeeded to update parameter online from tensor.", bytes=nbytes, seconds=time.perf_counter() - t0)

    async def _stamp(self, version: str | None) -> None:
        """Serve under `version` from now on (an update that names one)."""
        if version is not None:
            await self._on_scheduler(lambda: self.scheduler.set_weight_version(version, False))

    @functools.cached_property
    def _delta_loader(self) -> DeltaLoader:
        """One per engine: it remembers which disk version the parameters hold."""
        from hpcrl.engine.embedded.delta_load import DeltaLoader

        return DeltaLoader()

    async def update_from_delta(self, request: web.Request) -> web.Response:
        from pathlib import Path

        try:
            req = UpdateWeightsFromDelta.from_dict(await _json_body(request))
            if self.scheduler.weights_released:
                raise EngineStateError("weights are released; resume_memory_occupation(['weights']) before an update")
            loader = self._delta_loader
            done = await self._on_scheduler(lambda: loader.load(self.scheduler.named_parameters(), Path(req.manifest)))
            await self._stamp(req.weight_version)
        except web.HTTPException:
            raise  # a malformed body: its own 400 and message
        except Exception as exc:  # noqa: BLE001
            return _error(f"{type(exc).__name__}: {exc}")
        log.info("weights at disk version %s via %s in %.3f s", done["version"], done["applied"], done["seconds"])
        return _ok(f"Weights at version {done['version']} from {req.manifest}.", **done)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            req = UpdateWeightVersion.from_dict(await _json_body(request))
        except ValueError as exc:
            return _error(str(exc))
        await self._on_scheduler(lambda: self.scheduler.set_weight_version(req.new_version, req.abort_all_requests))
        return _ok(f"Weight version updated to {req.new_version}", new_version=req.new_version)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        try:
            req = GetWeightsByName.from_dict(await _json_body(request))
            params = self.scheduler.named_parameters()
            if req.name not in params:
                raise ValueError(f"no parameter named {req.name!r}")
            values = params[req.name].detach().float().flatten()[: req.truncate_size].cpu().tolist()
        except ValueError as exc:
            return _error(str(exc))
        return _json_response(values)


def _device_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return None


def _device_reserved(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.memory_reserved(device))
    return None
