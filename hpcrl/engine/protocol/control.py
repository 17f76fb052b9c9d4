"""The bodies of the control endpoints: weight-update groups and updates, weight versions, pause and continue,
abort, memory release and resume, and reading a weight back.

Each type names its endpoint and inherits `from_dict` (what the embedded server validates) and `to_dict` (what the
client sends) from `Message`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast, get_args

from hpcrl.engine import contract as C
from hpcrl.engine.contract import Endpoint
from hpcrl.engine.protocol.fields import (
    Message,
    _bool,
    _int,
    _list,
    _optional_str,
    _simple_from_dict,
    _str,
)

DEFAULT_GROUP_NAME = "weight_update_group"
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
# load_format None sends one broadcast per tensor; "flattened_bucket" one flat buffer per bucket.
LOAD_FORMATS: tuple[str | None, ...] = (None, "flattened_bucket")
# SGLang resolves a dtype string with getattr(torch, name), so only bare torch attribute names work.
WEIGHT_DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)


@dataclass(frozen=True, kw_only=True)
class InitWeightsUpdateGroup(Message):
    """POST /init_weights_update_group: the trainer is rank 0; engine ranks start at `rank_offset`."""

    endpoint: ClassVar[Endpoint] = C.INIT_WEIGHTS_UPDATE_GROUP
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"

    def __post_init__(self) -> None:
        _str("master_address", self.master_address)
        _int("master_port", self.master_port, minimum=1, maximum=65535)
        _int("rank_offset", self.rank_offset, minimum=0)
        _int("world_size", self.world_size, minimum=1)
        if self.rank_offset >= self.world_size:
            raise ValueError(
                f"rank_offset ({self.rank_offset}) must be < world_size ({self.world_size}): the engine's ranks "
                "are rank_offset .. rank_offset + tp*dp - 1 inside the group"
            )
        _str("group_name", self.group_name)
        _str("backend", self.backend)


@dataclass(frozen=True, kw_only=True)
class DestroyWeightsUpdateGroup(Message):
    """POST /destroy_weights_update_group."""

    endpoint: ClassVar[Endpoint] = C.DESTROY_WEIGHTS_UPDATE_GROUP
    body_optional: ClassVar[bool] = True
    group_name: str = DEFAULT_GROUP_NAME

    def __post_init__(self) -> None:
        _str("group_name", self.group_name)


def _check_load_format(value: object) -> None:
    if value not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {value!r}")


APPLY_REPLACE = "replace"
"""`apply_strategy` of a weight update (hpcrl's extension): how the engine writes the tensors into its model.
The embedded engine lists its strategies (hpcrl/engine/embedded/apply.py) and refuses others; `to_dict` sends the
key only when it is not "replace", what a stock SGLang server does with every update (it refuses unknown keys)."""


def _without_default_apply(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("apply_strategy") == APPLY_REPLACE:
        del body["apply_strategy"]
    return body


@dataclass(frozen=True, kw_only=True)
class UpdateWeightsFromDistributed(Message):
    """POST /update_weights_from_distributed: the engine receives these tensors, in order, from group rank 0.

    With `load_format=None` the trainer broadcasts one tensor per name; with "flattened_bucket" one flat buffer.
    """

    endpoint: ClassVar[Endpoint] = C.UPDATE_WEIGHTS_FROM_DISTRIBUTED
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False
    apply_strategy: str = APPLY_REPLACE

    def __post_init__(self) -> None:
        names = tuple(_str(f"names[{i}]", name) for i, name in enumerate(_list("names", self.names)))
        dtypes = tuple(_list("dtypes", self.dtypes))
        for index, dtype in enumerate(dtypes):
            if dtype not in WEIGHT_DTYPES:
                hint = ""
                if isinstance(dtype, str) and dtype.startswith("torch."):
                    hint = f" (send {dtype.removeprefix('torch.')!r}: SGLang resolves it with getattr(torch, name))"
                raise ValueError(f"dtypes[{index}] must be one of {list(WEIGHT_DTYPES)}, got {dtype!r}{hint}")
        shapes = tuple(
            tuple(_int(f"shapes[{i}][{j}]", dim, minimum=0) for j, dim in enumerate(_list(f"shapes[{i}]", shape)))
            for i, shape in enumerate(_list("shapes", self.shapes))
        )
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor; got {len(names)} names, "
                f"{len(dtypes)} dtypes, {len(shapes)} shapes"
            )
        if len(set(names)) != len(names):
            raise ValueError("names contains duplicates; each tensor must appear once per update")
        _str("group_name", self.group_name)
        _bool("flush_cache", self.flush_cache)
        _bool("abort_all_requests", self.abort_all_requests)
        _optional_str("weight_version", self.weight_version)
        _check_load_format(self.load_format)
        _bool("torch_empty_cache", self.torch_empty_cache)
        _str("apply_strategy", self.apply_strategy)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "dtypes", dtypes)
        object.__setattr__(self, "shapes", shapes)

    def to_dict(self) -> dict[str, Any]:
        return _without_default_apply(super().to_dict())


@dataclass(frozen=True, kw_only=True)
class UpdateWeightsFromTensor(Message):
    """POST /update_weights_from_tensor: one serialized payload per engine TP rank (CUDA IPC, same node only)."""

    endpoint: ClassVar[Endpoint] = C.UPDATE_WEIGHTS_FROM_TENSOR
    serialized_named_tensors: tuple[str, ...]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False
    apply_strategy: str = APPLY_REPLACE

    def __post_init__(self) -> None:
        payloads = tuple(
            _str(f"serialized_named_tensors[{i}]", item)
            for i, item in enumerate(_list("serialized_named_tensors", self.serialized_named_tensors))
        )
        if not payloads:
            raise ValueError("serialized_named_tensors is empty; send one payload per engine TP rank")
        _check_load_format(self.load_format)
        _bool("flush_cache", self.flush_cache)
        _bool("abort_all_requests", self.abort_all_requests)
        _optional_str("weight_version", self.weight_version)
        if self.disable_draft_model is not None:
            _bool("disable_draft_model", self.disable_draft_model)
        _bool("torch_empty_cache", self.torch_empty_cache)
        _str("apply_strategy", self.apply_strategy)
        object.__setattr__(self, "serialized_named_tensors", payloads)

    def to_dict(self) -> dict[str, Any]:
        return _without_default_apply(super().to_dict())


@dataclass(frozen=True, kw_only=True)
class UpdateWeightsFromDelta(Message):
    """POST /update_weights_from_delta (hpcrl's extension, embedded engine): bring the weights to the version whose
    manifest is `manifest` (a path on a file system the engine shares with the trainer; the format is
    hpcrl/weightwire/delta.py). A delta manifest is applied on top of the versions before it, from the engine's
    own version or from the newest snapshot before it; a snapshot manifest is loaded whole."""

    endpoint: ClassVar[Endpoint] = C.UPDATE_WEIGHTS_FROM_DELTA
    manifest: str
    weight_version: str | None = None

    def __post_init__(self) -> None:
        _str("manifest", self.manifest)
        _optional_str("weight_version", self.weight_version)


@dataclass(frozen=True, kw_only=True)
class UpdateWeightVersion(Message):
    """POST /update_weight_version.

    The dataclass default `abort_all_requests=False` is hpcrl's; SGLang's server default is True and aborted
    nearly all in-flight generation after every sync in Miles (radixark/miles#2372), so `to_dict` always sends
    the flag. `from_dict` applies SGLang's True when the key is missing, so the embedded server behaves like SGLang.
    """

    endpoint: ClassVar[Endpoint] = C.UPDATE_WEIGHT_VERSION
    missing: ClassVar[Mapping[str, Any]] = {"abort_all_requests": True}
    new_version: str
    abort_all_requests: bool = False

    def __post_init__(self) -> None:
        _str("new_version", self.new_version)
        _bool("abort_all_requests", self.abort_all_requests)


@dataclass(frozen=True, kw_only=True)
class PauseGeneration(Message):
    """POST /pause_generation. SGLang's default mode is "abort"; hpcrl's client defaults to "retract"."""

    endpoint: ClassVar[Endpoint] = C.PAUSE_GENERATION
    body_optional: ClassVar[bool] = True
    mode: PauseMode = "abort"

    def __post_init__(self) -> None:
        if self.mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {self.mode!r}")


@dataclass(frozen=True, kw_only=True)
class ContinueGeneration(Message):
    """POST /continue_generation."""

    endpoint: ClassVar[Endpoint] = C.CONTINUE_GENERATION
    body_optional: ClassVar[bool] = True
    torch_empty_cache: bool = True

    def __post_init__(self) -> None:
        _bool("torch_empty_cache", self.torch_empty_cache)


@dataclass(frozen=True, kw_only=True)
class AbortRequest(Message):
    """POST /abort_request: `rid` matches by prefix in the scheduler; `abort_all` ignores `rid`.

    SGLang accepts an empty object (rid "" without abort_all) and does nothing, so this type accepts it too.
    """

    endpoint: ClassVar[Endpoint] = C.ABORT_REQUEST
    rid: str = ""
    abort_all: bool = False

    def __post_init__(self) -> None:
        _str("rid", self.rid, allow_empty=True)
        _bool("abort_all", self.abort_all)


@dataclass(frozen=True, kw_only=True)
class MemoryOccupation(Message):
    """POST /release_memory_occupation and /resume_memory_occupation; `tags=None` means all tags.

    One body type serves both endpoints: the client passes the endpoint to `call`.
    """

    endpoint: ClassVar[Endpoint] = C.RELEASE_MEMORY_OCCUPATION
    body_optional: ClassVar[bool] = True
    tags: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.tags is None:
            return
        tags = tuple(_list("tags", self.tags))
        for index, tag in enumerate(tags):
            if tag not in MEMORY_TAGS:
                raise ValueError(f"tags[{index}] must be one of {list(MEMORY_TAGS)}, got {tag!r}")
        object.__setattr__(self, "tags", tags)

    @classmethod
    def from_dict(cls, data: object) -> MemoryOccupation:
        return cast(MemoryOccupation, _simple_from_dict(cls, "the memory occupation body", data or {}))


@dataclass(frozen=True, kw_only=True)
class GetWeightsByName(Message):
    """POST /get_weights_by_name (for tests): the first `truncate_size` values of one parameter."""

    endpoint: ClassVar[Endpoint] = C.GET_WEIGHTS_BY_NAME
    name: str
    truncate_size: int = 100

    def __post_init__(self) -> None:
        _str("name", self.name)
        _int("truncate_size", self.truncate_size, minimum=1)
