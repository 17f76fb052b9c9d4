"""Control calls of `EngineClient`: cache, abort, pause and continue, memory release and resume (colocated engines;
the server needs --enable-memory-saver), and weight updates, which are never re-sent (see `client.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from hpcrl.engine import contract as C
from hpcrl.engine.client_transport import ClientTransport
from hpcrl.engine.errors import (
    EngineRequestError,
)
from hpcrl.engine.protocol.control import (
    DEFAULT_GROUP_NAME,
    PAUSE_MODES,
    AbortRequest,
    ContinueGeneration,
    DestroyWeightsUpdateGroup,
    GetWeightsByName,
    InitWeightsUpdateGroup,
    MemoryOccupation,
    PauseGeneration,
    PauseMode,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    UpdateWeightVersion,
)
from hpcrl.engine.versions import format_weight_version


class ControlCalls(ClientTransport):
    """Cache, abort, pause, memory and weight-update calls."""

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

    def get_weights_by_name(self, name: str, truncate_size: int = 100, *, timeout_s: float | None = None) -> Any:
        """POST /get_weights_by_name: the first `truncate_size` values of a parameter (nested lists), for tests."""
        body = GetWeightsByName(name=name, truncate_size=truncate_size)
        return self.call(body.endpoint, body, timeout_s=timeout_s)
