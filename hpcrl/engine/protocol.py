"""Typed requests and responses of the SGLang HTTP contract (see docs/sglang-contract.md).

One module serves both ends: `EngineClient` builds requests with `to_dict()` and parses responses with
`GenerateResult.from_response`; the embedded engine server validates incoming JSON with `from_dict()` and
answers with `GenerateResult.to_response()`. Every validation error is a `ValueError` whose message names
the field, the allowed values and what was received, because the server returns it verbatim as HTTP 400.

Where engines name the same field differently, `contract.py` holds the table (`META_INFO_ALIASES`): readers
accept every name, writers send SGLang 0.5.16's. With `return_sampling_mask` that is
`output_token_sampling_mask` (per output token, the token ids of the sampling support after top-k/top-p/min-p),
`output_token_sampling_logprobs` (per output token, the log-prob renormalised over that support) and
`output_token_sampling_mask_length` (the number of output tokens those lists cover).

hpcrl's extensions to `meta_info` (absent from upstream SGLang, so every reader treats them as optional):
`weight_versions`: `[{"version": str, "start": int, "end": int}, ...]` half-open spans `[start, end)` over
output-token indices saying which weight version produced each token (weights can change mid-request).
`output_token_logprobs_packed`: with the request's `return_logprob_packed` (hpcrl's engine client sets it only
for an engine whose /server_info lists "packed" under `logprob_wire`), the log-probs as base64 of little-endian
float64, one per `output_ids` entry, instead of the `output_token_logprobs` triples: a 256 x 512 answer's 131k
`[logprob, id, text]` triples cost ~0.14 s a pass to write, move and parse on the H200's host, and a decimal
round trip per float. `from_response` reads either form into the same `output_token_logprobs` list.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar, cast, get_args

from hpcrl.engine import contract as C
from hpcrl.engine.contract import Endpoint

__all__ = [
    "AbortRequest",
    "ContinueGeneration",
    "DestroyWeightsUpdateGroup",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "GetWeightsByName",
    "InitWeightsUpdateGroup",
    "MemoryOccupation",
    "Message",
    "PauseGeneration",
    "SamplingParams",
    "UpdateWeightVersion",
    "UpdateWeightsFromDistributed",
    "UpdateWeightsFromTensor",
    "WeightVersionSpan",
    "pack_logprobs",
    "parse_generate_response",
    "DEFAULT_GROUP_NAME",
    "DEFAULT_WEIGHT_VERSION",
    "LOAD_FORMATS",
    "LOGPROB_WIRES",
    "MEMORY_TAGS",
    "PACKED_LOGPROBS_KEY",
    "PAUSE_MODES",
    "WEIGHT_DTYPES",
]

DEFAULT_GROUP_NAME = "weight_update_group"
# SGLang's `--weight-version` default: what an engine reports before its first weight update.
DEFAULT_WEIGHT_VERSION = "default"
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
# How /generate answers carry log-probs: SGLang's [logprob, token_id, text] triples, or hpcrl's packed column
# (base64 of little-endian float64). The embedded engine lists the wires it speaks in /server_info's `logprob_wire`.
LOGPROB_WIRES = ("triples", "packed")
PACKED_LOGPROBS_KEY = "output_token_logprobs_packed"
FinishType = Literal["stop", "length", "abort"]
FINISH_TYPES: tuple[str, ...] = get_args(FinishType)


# --------------------------------------------------------------------------------------------------------------
# Validation helpers. JSON has no int/bool distinction problem but Python does: True is an int, so every
# integer check excludes bool explicitly.


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float))) and not isinstance(value, bool)


def _int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    number = cast(int, value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}")
    return number


def _float(name: str, value: object) -> float:
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    number = float(cast(float, value))
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}")
    return number


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def _str(name: str, value: object, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r} ({type(value).__name__})")
    if not allow_empty and not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _optional_str(name: str, value: object) -> str | None:
    return None if value is None else _str(name, value)


def _list(name: str, value: object) -> list[Any]:
    # A str is a Sequence too; accepting it would silently split "abc" into characters.
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list, got {value!r} ({type(value).__name__})")
    return list(value)


def _all_of_type(values: list[Any], kinds: set[type]) -> bool:
    """Every value's type is one of `kinds` exactly (so bool is no int), checked at C speed: answers carry lists of
    ~10^5 numbers, and a Python-level check per element costs about a microsecond each."""
    return set(map(type, values)) <= kinds


def _token_ids(name: str, value: object, *, allow_empty: bool) -> list[int]:
    ids = _list(name, value)
    if not allow_empty and not ids:
        raise ValueError(f"{name} is empty; a prompt needs at least one token id")
    if _all_of_type(ids, {int}) and (not ids or min(ids) >= 0):
        return ids
    for index, token in enumerate(ids):
        if not _is_int(token) or token < 0:
            raise ValueError(f"{name}[{index}] must be a non-negative integer token id, got {token!r}")
    return ids


def _mapping(name: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {value!r} ({type(value).__name__})")
    return value


def _reject_unknown_keys(what: str, data: Mapping[str, Any], valid: Sequence[str]) -> None:
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {what}; valid keys: {sorted(valid)}")


def _is_default(value: object, default: object) -> bool:
    # SGLang treats null as "use the default"; empty containers carry no request either.
    if value is None or value == default:
        return True
    return isinstance(value, (Mapping, list, tuple, str)) and len(value) == 0 and default is None


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _simple_from_dict(cls: type, what: str, data: object, *, missing: Mapping[str, Any] | None = None) -> Any:
    body = _mapping(what, data)
    names = _field_names(cls)
    _reject_unknown_keys(what, body, names)
    kwargs = dict(missing or {})
    kwargs.update(body)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        # A missing required key surfaces as TypeError from the dataclass __init__.
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        raise ValueError(f"{what} is missing required key(s); required: {required} ({exc})") from exc


# --------------------------------------------------------------------------------------------------------------
# Request bodies

_M = TypeVar("_M", bound="Message")


def _jsonable(value: Any) -> Any:
    # Tuples keep the dataclasses immutable; JSON wants lists.
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    return value


@dataclass(frozen=True, kw_only=True)
class Message:
    """A request body of one endpoint.

    `missing` holds SGLang's server defaults where they differ from hpcrl's dataclass defaults: `from_dict` applies
    them to an absent key so that the embedded server behaves like SGLang. `body_optional` types accept an empty
    or null body as all-defaults (older servers took none).
    """

    endpoint: ClassVar[Endpoint]
    missing: ClassVar[Mapping[str, Any]] = {}
    body_optional: ClassVar[bool] = False

    @classmethod
    def from_dict(cls: type[_M], data: object) -> _M:
        what = f"the {cls.endpoint.path} body"
        body = (data or {}) if cls.body_optional else data
        return cast(_M, _simple_from_dict(cls, what, body, missing=cls.missing))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


# --------------------------------------------------------------------------------------------------------------
# Sampling parameters

# Keys of SGLang's SamplingParams that the embedded engine does not implement, with SGLang's defaults: a request
# may carry them at their default (clients such as Miles send full dicts), never with another value, because
# silently ignoring a penalty or a grammar would return samples from a different distribution than asked.
_UNSUPPORTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "custom_params": None,
    "logit_bias": None,
}
# Keys that only shape delivery (streaming chunk size), never the samples: safe to accept and ignore.
_IGNORED_SAMPLING_KEYS = ("stream_interval",)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """The sampling parameters hpcrl uses; names, defaults and ranges follow SGLang's SamplingParams.

    `temperature=0` means greedy. `top_k=-1` means the whole vocabulary. Lists given for `stop_token_ids`
    or `stop` are stored as tuples so that the object stays immutable and hashable.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        p = "sampling_params."
        _int(p + "max_new_tokens", self.max_new_tokens, minimum=0)
        temperature = _float(p + "temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"{p}temperature must be >= 0 (0 means greedy), got {temperature}")
        top_p = _float(p + "top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"{p}top_p must be in (0, 1] (1 disables top-p), got {top_p}")
        top_k = _int(p + "top_k", self.top_k)
        if top_k != -1 and top_k < 1:
            raise ValueError(f"{p}top_k must be -1 (whole vocabulary) or >= 1, got {top_k}")
        min_p = _float(p + "min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"{p}min_p must be in [0, 1] (0 disables min-p), got {min_p}")
        stop_ids = tuple(_token_ids(p + "stop_token_ids", self.stop_token_ids, allow_empty=True))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(_list(p + "stop", self.stop))
        for index, text in enumerate(stop):
            _str(f"{p}stop[{index}]", text)
        _bool(p + "ignore_eos", self.ignore_eos)
        _int(p + "n", self.n, minimum=1)
        if self.sampling_seed is not None:
            _int(p + "sampling_seed", self.sampling_seed, minimum=0)
        _bool(p + "skip_special_tokens", self.skip_special_tokens)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "min_p", min_p)
        object.__setattr__(self, "stop_token_ids", stop_ids)
        object.__setattr__(self, "stop", stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates_support(self) -> bool:
        """True when top-k/top-p/min-p shrink the sampling support (then the trainer needs the support mask)."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def from_dict(cls, data: object) -> SamplingParams:
        """Validate a request's `sampling_params` object as SGLang would.

        Null means default (SGLang's rule). SGLang keys the embedded engine does not implement are accepted at
        their default and rejected otherwise; unknown keys are rejected with the list of valid keys.
        """
        body = _mapping("sampling_params", data)
        supported = _field_names(cls)
        kwargs: dict[str, Any] = {}
        for key, value in body.items():
            if key in supported:
                if value is not None:
                    kwargs[key] = value
            elif key in _UNSUPPORTED_SAMPLING_DEFAULTS:
                default = _UNSUPPORTED_SAMPLING_DEFAULTS[key]
                if not _is_default(value, default):
                    raise ValueError(
                        f"sampling_params.{key}={value!r} is not supported by the embedded engine; "
                        f"remove it (default {default!r}) or run a real SGLang server, which implements it"
                    )
            elif key not in _IGNORED_SAMPLING_KEYS:
                valid = sorted([*supported, *_UNSUPPORTED_SAMPLING_DEFAULTS, *_IGNORED_SAMPLING_KEYS])
                raise ValueError(f"unknown key {key!r} in sampling_params; valid keys: {valid}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The contract's JSON form: only non-default fields, plus `max_new_tokens` always."""
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if spec.name == "max_new_tokens" or value == spec.default:
                continue
            out[spec.name] = list(value) if isinstance(value, tuple) else value
        return out


# --------------------------------------------------------------------------------------------------------------
# /generate request

# GenerateReqInput keys the embedded engine does not implement, with SGLang's defaults (same rule as sampling).
_UNSUPPORTED_GENERATE_DEFAULTS: dict[str, Any] = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_indexer_topk": False,
    "return_prompt_token_ids": False,
    "return_entropy": False,
    "lora_path": None,
    "lora_id": None,
    "session_params": None,
    "custom_logit_processor": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
}
# Routing and bookkeeping hints that cannot change the samples of a single-engine server.
_IGNORED_GENERATE_KEYS = (
    "routed_dp_rank",
    "data_parallel_rank",
    "routing_key",
    "priority",
    "log_metrics",
    "extra_key",
    "custom_labels",
    "modalities",
)


@dataclass(frozen=True, kw_only=True)
class GenerateRequest(Message):
    """A `/generate` request: one prompt (`input_ids: list[int]`, `text: str`) or a batch (lists of those).

    Exactly one of `input_ids` and `text` is set. For a batch, `sampling_params` is one object for all items
    or a list with one per item, and `rid` (if set) is a list with one id per item. With `n > 1` SGLang
    answers a list of `batch_size * n` results, prompt-major (all samples of prompt 0 first).

    `return_logprob_packed` is hpcrl's extension (the embedded engine only; stock SGLang refuses unknown keys, so
    `to_dict` sends it only when true): log-probs come back as `meta_info.output_token_logprobs_packed` instead
    of the triples. Without `return_logprob` it asks for nothing and is ignored.
    """

    endpoint: ClassVar[Endpoint] = C.GENERATE
    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingParams | list[SamplingParams] = field(default_factory=SamplingParams)
    return_logprob: bool = False
    rid: str | list[str] | None = None
    return_sampling_mask: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_logprob_packed: bool = False

    def __post_init__(self) -> None:
        if self.input_ids is not None and self.text is not None:
            raise ValueError("send exactly one of text or input_ids, not both")
        if self.input_ids is None and self.text is None:
            raise ValueError("one of input_ids (token ids, what RL clients send) or text is required")
        batch_size: int | None
        if self.input_ids is not None:
            ids = _list("input_ids", self.input_ids)
            if ids and all(not _is_int(x) for x in ids):
                if not all(isinstance(x, Sequence) and not isinstance(x, str) for x in ids):
                    raise ValueError(
                        "input_ids must be a list of token ids (one prompt) or a list of such lists (a batch)"
                    )
                batch = [_token_ids(f"input_ids[{i}]", x, allow_empty=False) for i, x in enumerate(ids)]
                object.__setattr__(self, "input_ids", batch)
                batch_size = len(batch)
            else:
                object.__setattr__(self, "input_ids", _token_ids("input_ids", ids, allow_empty=False))
                batch_size = None
        else:
            if isinstance(self.text, str):
                batch_size = None
            else:
                texts = _list("text", self.text)
                if not texts:
                    raise ValueError("text is an empty batch; send at least one prompt")
                for index, item in enumerate(texts):
                    _str(f"text[{index}]", item, allow_empty=True)
                object.__setattr__(self, "text", texts)
                batch_size = len(texts)

        params = self.sampling_params
        if isinstance(params, SamplingParams):
            pass
        elif batch_size is None:
            raise ValueError("sampling_params must be one object for a single prompt (a list is for batches)")
        else:
            items = _list("sampling_params", params)
            if len(items) != batch_size:
                raise ValueError(f"sampling_params has {len(items)} entries but the batch has {batch_size} prompts")
            for index, item in enumerate(items):
                if not isinstance(item, SamplingParams):
                    raise ValueError(f"sampling_params[{index}] must be a SamplingParams, got {type(item).__name__}")
            if len({item.n for item in items}) > 1:
                raise ValueError("sampling_params.n must be the same for every item of a batch (SGLang's rule)")
            object.__setattr__(self, "sampling_params", items)

        if self.rid is not None:
            if batch_size is None:
                _str("rid", self.rid)
            else:
                rids = [] if isinstance(self.rid, str) else _list("rid", self.rid)
                if len(rids) != batch_size:
                    raise ValueError(f"rid must be a list of {batch_size} ids (one per prompt), got {self.rid!r}")
                for index, rid in enumerate(rids):
                    _str(f"rid[{index}]", rid)
                object.__setattr__(self, "rid", rids)
        _bool("return_logprob", self.return_logprob)
        _bool("return_sampling_mask", self.return_sampling_mask)
        if self.return_sampling_mask:
            # SGLang 0.5.16 refuses it too: without truncation the support is the whole vocabulary.
            items = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params]
            for index, item in enumerate(items):
                if not (item.truncates_support or item.is_greedy):
                    where = "sampling_params" if len(items) == 1 else f"sampling_params[{index}]"
                    raise ValueError(
                        f"return_sampling_mask needs a truncated sampling support, but {where} has top_k=-1, "
                        "top_p=1 and min_p=0; set top_k, top_p < 1 or min_p > 0, or drop return_sampling_mask"
                    )
        _int("logprob_start_len", self.logprob_start_len, minimum=-1)
        _bool("return_text_in_logprobs", self.return_text_in_logprobs)
        _bool("stream", self.stream)
        _bool("return_logprob_packed", self.return_logprob_packed)
        if self.return_logprob_packed and self.return_text_in_logprobs:
            raise ValueError(
                "return_logprob_packed and return_text_in_logprobs cannot be combined: the packed wire carries the "
                "log-probs alone, without a text per token; drop return_text_in_logprobs (decode output_ids "
                "instead) or drop return_logprob_packed to get [logprob, token_id, text] triples"
            )

    @property
    def is_batch(self) -> bool:
        return self.batch_size is not None

    @property
    def batch_size(self) -> int | None:
        """Number of prompts of a batch request; None for a single prompt."""
        if self.input_ids is not None:
            return len(self.input_ids) if isinstance(self.input_ids[0], list) else None
        return None if isinstance(self.text, str) else len(cast(list, self.text))

    @property
    def n(self) -> int:
        """Samples per prompt (validated equal across a batch)."""
        params = self.sampling_params
        return params.n if isinstance(params, SamplingParams) else params[0].n

    @property
    def num_results(self) -> int:
        return (self.batch_size or 1) * self.n

    @property
    def returns_list(self) -> bool:
        """SGLang answers a list for a batch and for n > 1, a single object otherwise."""
        return self.is_batch or self.n > 1

    def params_for(self, index: int) -> SamplingParams:
        """Sampling parameters of prompt `index` (0 for a single prompt)."""
        params = self.sampling_params
        return params if isinstance(params, SamplingParams) else params[index]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.input_ids is not None:
            out["input_ids"] = self.input_ids
        else:
            out["text"] = self.text
        params = self.sampling_params
        out["sampling_params"] = (
            params.to_dict() if isinstance(params, SamplingParams) else [item.to_dict() for item in params]
        )
        out["return_logprob"] = self.return_logprob
        if self.return_logprob:
            # Explicit because 0 (whole prompt) defeats the prefix cache and older servers defaulted to None.
            out["logprob_start_len"] = self.logprob_start_len
        if self.rid is not None:
            out["rid"] = self.rid
        # Extensions and non-default flags only: older upstream servers may reject keys they do not know.
        if self.return_sampling_mask:
            out["return_sampling_mask"] = True
        if self.return_text_in_logprobs:
            out["return_text_in_logprobs"] = True
        if self.stream:
            out["stream"] = True
        if self.return_logprob_packed:
            out["return_logprob_packed"] = True
        return out

    @classmethod
    def from_dict(cls, data: object) -> GenerateRequest:
        """Validate a `/generate` body as the embedded server receives it."""
        body = _mapping("the /generate body", data)
        own = _field_names(cls)
        kwargs: dict[str, Any] = {}
        for key, value in body.items():
            if key in own:
                if value is not None:
                    kwargs[key] = value
            elif key in _UNSUPPORTED_GENERATE_DEFAULTS:
                default = _UNSUPPORTED_GENERATE_DEFAULTS[key]
                if not _is_default(value, default):
                    raise ValueError(
                        f"{key}={value!r} is not supported by the embedded engine; remove it (default "
                        f"{default!r}) or run a real SGLang server, which implements it"
                    )
            elif key not in _IGNORED_GENERATE_KEYS:
                valid = sorted([*own, *_UNSUPPORTED_GENERATE_DEFAULTS, *_IGNORED_GENERATE_KEYS])
                raise ValueError(f"unknown key {key!r} in the /generate body; valid keys: {valid}")
        if "sampling_params" in kwargs:
            # Entries may already be SamplingParams when a caller parsed them first.
            raw = kwargs["sampling_params"]
            if isinstance(raw, Mapping):
                kwargs["sampling_params"] = SamplingParams.from_dict(raw)
            elif not isinstance(raw, SamplingParams):
                items = _list("sampling_params", raw)
                parsed = []
                for index, item in enumerate(items):
                    try:
                        parsed.append(
                            item if isinstance(item, SamplingParams) else SamplingParams.from_dict(item or {})
                        )
                    except ValueError as exc:
                        raise ValueError(f"sampling_params[{index}]: {exc}") from exc
                kwargs["sampling_params"] = parsed
        if isinstance(kwargs.get("return_logprob"), list):
            # SGLang allows one flag per item; mixed flags would need per-item output shapes we do not build.
            flags = {_bool("return_logprob[]", flag) for flag in kwargs["return_logprob"]}
            if len(flags) > 1:
                raise ValueError("per-item return_logprob values differ; the embedded engine needs one bool")
            kwargs["return_logprob"] = flags.pop() if flags else False
        return cls(**kwargs)


# --------------------------------------------------------------------------------------------------------------
# /generate response


@dataclass(frozen=True, kw_only=True)
class FinishReason:
    """`meta_info.finish_reason`: stop (EOS / stop token id / stop string in `matched`), length, or abort."""

    type: FinishType
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None

    def __post_init__(self) -> None:
        if self.type not in FINISH_TYPES:
            raise ValueError(f"finish_reason.type must be one of {list(FINISH_TYPES)}, got {self.type!r}")
        if self.matched is not None and not (_is_int(self.matched) or isinstance(self.matched, str)):
            raise ValueError(f"finish_reason.matched must be a token id or a string, got {self.matched!r}")
        if self.length is not None:
            _int("finish_reason.length", self.length, minimum=0)
        if self.message is not None:
            _str("finish_reason.message", self.message, allow_empty=True)
        if self.status_code is not None:
            _int("finish_reason.status_code", self.status_code)

    @classmethod
    def from_dict(cls, data: object) -> FinishReason | None:
        """Parse the contract shape; None (unfinished stream chunk) stays None. Unknown extra keys are ignored."""
        if data is None:
            return None
        body = _mapping("finish_reason", data)
        return cls(
            type=body.get("type"),  # type: ignore[arg-type]  # validated in __post_init__
            matched=body.get("matched"),
            length=body.get("length"),
            message=body.get("message"),
            status_code=body.get("status_code"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message or ""
            if self.status_code is not None:
                out["status_code"] = self.status_code
        return out


@dataclass(frozen=True, kw_only=True)
class WeightVersionSpan:
    """Output tokens `[start, end)` were sampled with weight version `version` (hpcrl extension)."""

    version: str
    start: int
    end: int

    def __post_init__(self) -> None:
        _str("weight_versions[].version", self.version)
        start = _int("weight_versions[].start", self.start, minimum=0)
        end = _int("weight_versions[].end", self.end, minimum=0)
        if end <= start:
            raise ValueError(f"weight_versions span must have end > start (half-open), got [{start}, {end})")

    @classmethod
    def from_dict(cls, data: object) -> WeightVersionSpan:
        body = _mapping("weight_versions[]", data)
        return cls(version=body.get("version"), start=body.get("start"), end=body.get("end"))  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return span_object(self.version, self.start, self.end)


def span_object(version: str, start: int, end: int) -> dict[str, Any]:
    """A weight_versions entry as the contract writes it (the embedded server writes its scheduler's spans so)."""
    return {"version": version, "start": start, "end": end}


@dataclass(frozen=True, kw_only=True)
class GenerateResult:
    """One sample of a `/generate` response.

    `output_token_logprobs` holds the log-prob of each output token (from `meta_info.output_token_logprobs`, or
    from `output_token_logprobs_packed` when the request set return_logprob_packed; present when the request set
    return_logprob). `sampling_mask` (the support's token ids per output token) and
    `support_logprobs` (the log-prob renormalised over it) are what the request's return_sampling_mask asked for,
    read under any engine's field names; `weight_versions` is hpcrl's extension. Each is None when the engine did
    not send it.
    """

    text: str | None
    output_ids: list[int]
    rid: str
    finish_reason: FinishReason | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    output_token_logprobs: list[float] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    sampling_mask: list[list[int]] | None = None
    support_logprobs: list[float] | None = None
    num_retractions: int = 0
    e2e_latency_s: float | None = None
    # The raw meta_info, for fields this type does not model (routed_experts, spec-decoding counters, ...).
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        num_tokens = len(self.output_ids)
        for name in ("output_token_logprobs", "sampling_mask", "support_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != num_tokens:
                raise ValueError(f"{name} has {len(values)} entries for {num_tokens} output tokens")
        if self.weight_versions is not None:
            position = 0
            for span in self.weight_versions:
                if span.start != position:
                    raise ValueError(
                        f"weight_versions spans must tile the output tokens in order from 0; a span starts at "
                        f"{span.start} where {position} was expected"
                    )
                position = span.end
            if position != num_tokens:
                raise ValueError(f"weight_versions spans cover {position} tokens, the output has {num_tokens}")

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def aborted(self) -> bool:
        return self.finish_reason is not None and self.finish_reason.type == "abort"

    def token_weight_versions(self) -> list[str | None]:
        """The weight version of every output token: expanded spans, else `weight_version` for all."""
        if self.weight_versions is None:
            return [self.weight_version] * len(self.output_ids)
        out: list[str | None] = []
        for span in self.weight_versions:
            out.extend([span.version] * (span.end - span.start))
        return out

    @classmethod
    def from_response(cls, data: object) -> GenerateResult:
        """Parse one result object of a `/generate` response (see `parse_generate_response` for lists)."""
        body = _mapping("a /generate result", data)
        meta = dict(_mapping("meta_info of a /generate result", body.get("meta_info")))
        raw_logprobs = meta.get("output_token_logprobs")
        packed = meta.get(PACKED_LOGPROBS_KEY)
        logprobs: list[float] | None = None
        output_ids = body.get("output_ids")
        if packed is not None:
            if raw_logprobs is not None:
                # Two copies could disagree, and neither is more right: an engine sends the one it was asked for.
                raise ValueError(
                    f"meta_info carries both output_token_logprobs and {PACKED_LOGPROBS_KEY}; an engine must send "
                    "one (the packed column when the request set return_logprob_packed, else the triples)"
                )
            if output_ids is None:
                raise ValueError(
                    f"meta_info.{PACKED_LOGPROBS_KEY} needs output_ids (the packed column holds the log-probs alone, "
                    "one per output_ids entry), and the result has none"
                )
            logprobs = _unpack_logprobs(packed, len(_list("output_ids", output_ids)))
        elif raw_logprobs is not None:
            entries = _list("meta_info.output_token_logprobs", raw_logprobs)
            logprobs, logprob_ids = _logprob_columns(entries) or _logprob_columns_checked(entries)
            # The token ids next to the log-probs are the ones those log-probs describe, so they are what a
            # trainer must use (Miles reads its tokens from here too); output_ids is a fallback without them.
            output_ids = logprob_ids
        if output_ids is None:
            raise ValueError("a /generate result has neither output_ids nor meta_info.output_token_logprobs")
        spans = meta.get("weight_versions")
        mask = C.read_meta(meta, "output_token_sampling_mask")
        support = C.read_meta(meta, "output_token_sampling_logprobs")
        retractions = C.read_meta(meta, "num_retractions")
        latency = meta.get("e2e_latency")
        version = meta.get("weight_version")
        return cls(
            text=body.get("text"),
            output_ids=_token_ids("output_ids", output_ids, allow_empty=True),
            rid=str(meta.get("id", "")),
            finish_reason=FinishReason.from_dict(meta.get("finish_reason")),
            prompt_tokens=_int("meta_info.prompt_tokens", meta.get("prompt_tokens") or 0, minimum=0),
            completion_tokens=_int("meta_info.completion_tokens", meta.get("completion_tokens") or 0, minimum=0),
            cached_tokens=_int("meta_info.cached_tokens", meta.get("cached_tokens") or 0, minimum=0),
            weight_version=None if version is None else str(version),
            output_token_logprobs=logprobs,
            weight_versions=None
            if spans is None
            else [WeightVersionSpan.from_dict(s) for s in _list("meta_info.weight_versions", spans)],
            sampling_mask=None
            if mask is None
            else [
                _token_ids(f"meta_info.output_token_sampling_mask[{i}]", m, allow_empty=True)
                for i, m in enumerate(_list("meta_info.output_token_sampling_mask", mask))
            ],
            support_logprobs=None
            if support is None
            else [
                _float(f"meta_info.output_token_sampling_logprobs[{i}]", v)
                for i, v in enumerate(_list("meta_info.output_token_sampling_logprobs", support))
            ],
            num_retractions=_int("meta_info.num_retractions", retractions or 0, minimum=0),
            e2e_latency_s=None if latency is None else _float("meta_info.e2e_latency", latency),
            meta_info=meta,
        )

    def to_response(self, *, token_texts: Sequence[str | None] | None = None) -> dict[str, Any]:
        """The contract's JSON object for this result (`result_object` of its fields).

        `token_texts` fills the third element of each output_token_logprobs entry (null unless the request
        set return_text_in_logprobs). The log-probs go as triples.
        """
        triples = None
        if self.output_token_logprobs is not None:
            if token_texts is not None and len(token_texts) != len(self.output_ids):
                raise ValueError(f"token_texts has {len(token_texts)} entries for {len(self.output_ids)} output tokens")
            triples = logprob_triples(self.output_token_logprobs, self.output_ids, token_texts)
        return result_object(
            text=self.text,
            output_ids=self.output_ids,
            rid=self.rid,
            finish_reason=None if self.finish_reason is None else self.finish_reason.to_dict(),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            weight_version=self.weight_version,
            num_retractions=self.num_retractions,
            e2e_latency_s=self.e2e_latency_s,
            logprob_triples=triples,
            weight_versions=None if self.weight_versions is None else [s.to_dict() for s in self.weight_versions],
            sampling_mask=self.sampling_mask,
            support_logprobs=self.support_logprobs,
            extra_meta=self.meta_info,
        )


def logprob_triples(
    logprobs: Sequence[float], output_ids: Sequence[int], token_texts: Sequence[str | None] | None = None
) -> list[tuple[float, int, str | None]]:
    """meta_info.output_token_logprobs: a [logprob, token id, text] entry per output token (text null unless given).

    Tuples built by zip, which JSON writes as the same arrays: at 131k tokens a list each took 4x longer (mostly the
    garbage collections the new lists set off)."""
    texts = token_texts if token_texts is not None else [None] * len(output_ids)
    return list(zip(logprobs, output_ids, texts, strict=True))


def result_object(
    *,
    text: str | None,
    output_ids: list[int],
    rid: str,
    finish_reason: dict[str, Any] | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    weight_version: str | None,
    num_retractions: int = 0,
    e2e_latency_s: float | None = None,
    logprob_triples: list[tuple[float, int, str | None]] | None = None,
    packed_logprobs: str | None = None,
    weight_versions: list[dict[str, Any]] | None = None,
    sampling_mask: list[list[int]] | None = None,
    support_logprobs: list[float] | None = None,
    extra_meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One result of a `/generate` answer as the contract lays it out: the one writer of that layout.

    The parts are JSON-ready and trusted (`finish_reason` as `FinishReason.to_dict` writes it, the spans as
    `WeightVersionSpan.to_dict`): `GenerateResult.to_response` passes its checked fields, and the embedded server
    its scheduler's own records, which it builds in these shapes, without making a checked GenerateResult of each
    first (at 256 results that took most of the answer's time). `packed_logprobs`: `pack_logprobs` of the column,
    sent in place of the triples when the request set return_logprob_packed; `extra_meta`: meta_info fields the
    contract does not name, passed through.
    """
    meta: dict[str, Any] = {k: v for k, v in extra_meta.items() if k not in _META_NOT_COPIED} if extra_meta else {}
    meta.update(
        {
            "id": rid,
            "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": cached_tokens,
            "weight_version": weight_version if weight_version is not None else DEFAULT_WEIGHT_VERSION,
            "num_retractions": num_retractions,
        }
    )
    if e2e_latency_s is not None:
        meta["e2e_latency"] = e2e_latency_s
    if logprob_triples is not None:
        meta["output_token_logprobs"] = logprob_triples
    if packed_logprobs is not None:
        meta[PACKED_LOGPROBS_KEY] = packed_logprobs
    if weight_versions is not None:
        meta["weight_versions"] = weight_versions
    if sampling_mask is not None:
        meta["output_token_sampling_mask"] = sampling_mask
        meta["output_token_sampling_mask_length"] = len(sampling_mask)
    if support_logprobs is not None:
        meta["output_token_sampling_logprobs"] = support_logprobs
    out: dict[str, Any] = {"output_ids": output_ids, "meta_info": meta}
    if text is not None:
        out["text"] = text
    return out


# Older names of the fields to_response writes would otherwise travel next to the canonical ones, and a log-prob
# column of the raw meta_info (a parsed answer's) next to the one written from output_token_logprobs.
_META_NOT_COPIED = frozenset(
    {name for names in C.META_INFO_ALIASES.values() for name in names[1:]}
    | {"output_token_logprobs", PACKED_LOGPROBS_KEY}
)


def pack_logprobs(logprobs: Sequence[float]) -> str:
    """`meta_info.output_token_logprobs_packed` for these log-probs: base64 of little-endian float64, so the client
    gets the engine's doubles bit for bit, without printing and parsing a decimal per token. An `array("d")` (what
    the scheduler keeps) is written as it is."""
    column = logprobs if isinstance(logprobs, array) and logprobs.typecode == "d" else array("d", logprobs)
    if sys.byteorder != "little":
        column = array("d", column)  # a copy: the caller's array stays native
        column.byteswap()
    return base64.b64encode(column.tobytes()).decode("ascii")


class GrowingPackedColumn:
    """`pack_logprobs` of a log-prob column that grows while its row decodes, packed a few values at a time.

    Base64 turns each 3 bytes into 4 characters on its own, so the packing of a column is the packings of its runs
    of 3 float64s (24 bytes) joined: `advance` packs the whole runs added since the last call, and `packed` joins
    them with the rest. The embedded scheduler advances a row's column while the device computes a step, so the
    answer packs only the last few values of each row. A column replaced by another array (a re-score) is packed
    whole.
    """

    __slots__ = ("_chunks", "_done", "_source")

    def __init__(self) -> None:
        self._source: array[float] | None = None
        self._done = 0
        self._chunks: list[str] = []

    @property
    def values_packed(self) -> int:
        """How many of the column's values `advance` has packed."""
        return self._done

    def advance(self, column: array[float]) -> None:
        if column is not self._source:
            self._source, self._done, self._chunks = column, 0, []
        end = self._done + (len(column) - self._done) // 3 * 3
        if end > self._done:
            self._chunks.append(pack_logprobs(column[self._done : end]))
            self._done = end

    def packed(self, column: array[float]) -> str:
        if column is not self._source or len(column) < self._done:
            return pack_logprobs(column)
        return "".join(self._chunks) + pack_logprobs(column[self._done :])


def _unpack_logprobs(value: object, num_tokens: int) -> list[float]:
    """The log-probs of a packed column, checked as the triples are (one finite float per output token)."""
    name = f"meta_info.{PACKED_LOGPROBS_KEY}"
    if not isinstance(value, str):
        raise ValueError(
            f"{name} must be a base64 string of little-endian float64 log-probs, got {type(value).__name__}"
        )
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError as exc:  # binascii.Error, or a str that is not ASCII
        raise ValueError(
            f"{name} is not valid base64 ({exc}); it must be base64 of little-endian float64 log-probs"
        ) from exc
    if len(raw) != 8 * num_tokens:
        raise ValueError(
            f"{name} holds {len(raw)} bytes, but {num_tokens} output tokens need {8 * num_tokens} (one 8-byte "
            "float64 log-prob per output_ids entry)"
        )
    column = array("d", raw)
    if sys.byteorder != "little":
        column.byteswap()
    logprobs = column.tolist()
    if not all(map(math.isfinite, logprobs)):
        index = next(i for i, lp in enumerate(logprobs) if not math.isfinite(lp))
        raise ValueError(f"{name}[{index}] must be a finite log-prob, got {logprobs[index]}")
    return logprobs


def _logprob_columns(entries: list[Any]) -> tuple[list[float], list[int]] | None:
    """The log-probs and token ids of well-formed [logprob, token_id, text] entries, checked in bulk: a 256 x 512
    answer is 131k entries, 0.17 s of checks one by one on a CPU. None: something is off, and the caller's
    per-entry checks find what and where."""
    if not _all_of_type(entries, {list, tuple}) or (entries and min(map(len, entries)) < 2):
        return None
    logprobs = [entry[0] for entry in entries]
    ids = [entry[1] for entry in entries]
    if not _all_of_type(logprobs, {float}) or not all(map(math.isfinite, logprobs)):
        return None
    if not _all_of_type(ids, {int}) or (ids and min(ids) < 0):
        return None
    return logprobs, ids


def _logprob_columns_checked(entries: list[Any]) -> tuple[list[float], list[int]]:
    logprobs, ids = [], []
    for index, entry in enumerate(entries):
        triple = _list(f"meta_info.output_token_logprobs[{index}]", entry)
        if len(triple) < 2:
            raise ValueError(f"meta_info.output_token_logprobs[{index}] must be [logprob, token_id, text]")
        logprobs.append(_float(f"meta_info.output_token_logprobs[{index}][0]", triple[0]))
        ids.append(_int(f"meta_info.output_token_logprobs[{index}][1]", triple[1], minimum=0))
    return logprobs, ids


def parse_generate_response(data: object) -> GenerateResult | list[GenerateResult]:
    """Parse a `/generate` body: an object for one sample, a list for a batch or n > 1."""
    if isinstance(data, list):
        results = []
        for index, item in enumerate(data):
            try:
                results.append(GenerateResult.from_response(item))
            except ValueError as exc:
                raise ValueError(f"result {index}: {exc}") from exc
        return results
    return GenerateResult.from_response(data)


# --------------------------------------------------------------------------------------------------------------
# Control and weight-update requests. Each type names its endpoint and inherits `from_dict` (what the embedded
# server validates) and `to_dict` (what the client sends) from `Message`.


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
