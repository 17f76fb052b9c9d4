"""The /generate request: `SamplingParams` and `GenerateRequest`, checked as SGLang checks them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

from hpcrl.engine import contract as C
from hpcrl.engine.contract import Endpoint
from hpcrl.engine.protocol.fields import (
    Message,
    _bool,
    _field_names,
    _float,
    _int,
    _is_default,
    _is_int,
    _list,
    _mapping,
    _str,
    _token_ids,
)

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
    "token_ids_logprob": None,
    "return_hidden_states": False,
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
    top_logprobs_num: int = 0
    """With `return_logprob`: the k most likely ids and their log-probs at every scored position
    (`meta_info.input_top_logprobs` from `logprob_start_len`; the embedded engine answers it on scoring requests,
    `max_new_tokens=0`, only). 0: none."""
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_logprob_packed: bool = False
    return_routed_experts: bool = False
    """Answer `meta_info.routed_experts`: the experts each token was routed to, per decoder layer (MoE models; the
    SGLang server needs --enable-return-routed-experts)."""

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
        _bool("return_routed_experts", self.return_routed_experts)
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
        _int("top_logprobs_num", self.top_logprobs_num, minimum=0)
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
            if self.top_logprobs_num:
                out["top_logprobs_num"] = self.top_logprobs_num
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
        if self.return_routed_experts:
            out["return_routed_experts"] = True
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
