"""The /generate answer: `GenerateResult` parsed from an engine's JSON, and the JSON the embedded engine writes,
with the packed log-prob column (see the package docstring for hpcrl's `meta_info` extensions)."""

from __future__ import annotations

import base64
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from hpcrl.engine import contract as C
from hpcrl.engine.protocol.fields import (
    _all_of_type,
    _float,
    _int,
    _is_int,
    _list,
    _mapping,
    _str,
    _token_ids,
)

# How /generate answers carry log-probs: SGLang's [logprob, token_id, text] triples, or hpcrl's packed column
# (base64 of little-endian float64). The embedded engine lists the wires it speaks in /server_info's `logprob_wire`.
LOGPROB_WIRES = ("triples", "packed")
PACKED_LOGPROBS_KEY = "output_token_logprobs_packed"
INPUT_LOGPROBS_KEY = "input_token_logprobs"
"""meta_info's prompt log-probs from the request's logprob_start_len: [logprob, token id, text] per prompt token,
the first one's logprob null (SGLang's field; a scoring request with max_new_tokens=0 reads it)."""
INPUT_TOP_LOGPROBS_KEY = "input_top_logprobs"
"""meta_info's top-k prompt log-probs (request's top_logprobs_num): one entry per position of input_token_logprobs,
a list of [logprob, token id, text] (most likely first) or null where input_token_logprobs has null."""
FinishType = Literal["stop", "length", "abort"]
FINISH_TYPES: tuple[str, ...] = get_args(FinishType)
# SGLang's `--weight-version` default: what an engine reports before its first weight update.
DEFAULT_WEIGHT_VERSION = "default"


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


def input_token_logprobs(result: GenerateResult) -> list[float | None]:
    """The prompt log-probs a request with logprob_start_len >= 0 asked for (meta_info.input_token_logprobs), one
    per prompt token from that position; None for the first (SGLang 0.5.16 answers null at logprob_start_len,
    whatever it is). Raises when the engine sent none."""
    raw = result.meta_info.get(INPUT_LOGPROBS_KEY)
    if raw is None:
        raise ValueError(
            f"the /generate result has no meta_info.{INPUT_LOGPROBS_KEY}: the engine did not score the prompt; send "
            "return_logprob=true with logprob_start_len >= 0 to an engine that answers it (embedded or SGLang)"
        )
    out: list[float | None] = []
    for index, entry in enumerate(_list(f"meta_info.{INPUT_LOGPROBS_KEY}", raw)):
        triple = _list(f"meta_info.{INPUT_LOGPROBS_KEY}[{index}]", entry)
        if not triple:
            raise ValueError(f"meta_info.{INPUT_LOGPROBS_KEY}[{index}] must be [logprob, token_id, text]")
        out.append(None if triple[0] is None else _float(f"meta_info.{INPUT_LOGPROBS_KEY}[{index}][0]", triple[0]))
    return out


def input_top_logprobs(result: GenerateResult) -> list[list[tuple[float, int]] | None]:
    """The top-k prompt log-probs a request with top_logprobs_num > 0 asked for (meta_info.input_top_logprobs): per
    position from logprob_start_len, (logprob, token id) pairs, or None where nothing predicts the token."""
    raw = result.meta_info.get(INPUT_TOP_LOGPROBS_KEY)
    if raw is None:
        raise ValueError(
            f"the /generate result has no meta_info.{INPUT_TOP_LOGPROBS_KEY}: the engine did not return the prompt's "
            "top-k log-probs; send return_logprob=true, logprob_start_len >= 0 and top_logprobs_num > 0"
        )
    out: list[list[tuple[float, int]] | None] = []
    for index, entry in enumerate(_list(f"meta_info.{INPUT_TOP_LOGPROBS_KEY}", raw)):
        if entry is None:
            out.append(None)
            continue
        where = f"meta_info.{INPUT_TOP_LOGPROBS_KEY}[{index}]"
        pairs = []
        for j, item in enumerate(_list(where, entry)):
            triple = _list(f"{where}[{j}]", item)
            if len(triple) < 2:
                raise ValueError(f"{where}[{j}] must be [logprob, token_id, text]")
            pairs.append((_float(f"{where}[{j}][0]", triple[0]), _int(f"{where}[{j}][1]", triple[1], minimum=0)))
        out.append(pairs)
    return out


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
