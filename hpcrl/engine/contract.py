"""The engine contract as data: every endpoint hpcrl calls, with its method, paths, retry rule and reply shape,
and the names SGLang versions give the same response field.

`EngineClient.call(endpoint, body)` reads everything it needs from an `Endpoint`; the request types in
`protocol/` name their endpoint (`UpdateWeightVersion.endpoint`). A new endpoint is one entry here, one
request type if it has a body, and a thin typed helper on the client.

Retry rules (the client's failure model):
- `CONNECT`: re-sent only when the connection could not be established, i.e. the request provably never left.
  `generate` (a duplicate burns engine time and may return a sample twice) and memory release/resume.
- `IDEMPOTENT`: also re-sent on 503 and on a connection dropped mid-request: reads, health, flush,
  pause/continue, abort, version stamps.
- `NEVER`: weight-update calls. Each pairs with collectives on the trainer side; a second call would wait for
  broadcasts that never come.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ABORT_REQUEST",
    "CONTINUE_GENERATION",
    "DESTROY_WEIGHTS_UPDATE_GROUP",
    "ENDPOINTS",
    "FLUSH_CACHE",
    "GENERATE",
    "GET_WEIGHTS_BY_NAME",
    "GET_WEIGHT_VERSION",
    "HEALTH",
    "HEALTH_GENERATE",
    "INIT_WEIGHTS_UPDATE_GROUP",
    "META_INFO_ALIASES",
    "MODEL_INFO",
    "PAUSE_GENERATION",
    "RELEASE_MEMORY_OCCUPATION",
    "RESUME_MEMORY_OCCUPATION",
    "SERVER_INFO",
    "UPDATE_WEIGHTS_FROM_DELTA",
    "UPDATE_WEIGHTS_FROM_DISTRIBUTED",
    "UPDATE_WEIGHTS_FROM_TENSOR",
    "UPDATE_WEIGHT_VERSION",
    "Endpoint",
    "Reply",
    "Retry",
    "read_meta",
]


class Retry(enum.Enum):
    """When a call may be re-sent (see the module docstring)."""

    NEVER = "never"
    CONNECT = "connect"
    IDEMPOTENT = "idempotent"


class Reply(enum.Enum):
    """What a 2xx answer of an endpoint carries, and so how the client checks it."""

    ANY = "any"  # JSON or nothing (None); the caller interprets it
    OBJECT = "object"  # a JSON object, else the engine is broken
    SUCCESS = "success"  # {"success": bool, "message": str}; success false is an error
    MAYBE_SUCCESS = "maybe_success"  # empty/null (SGLang) or an object that may say success false (embedded)
    GENERATE = "generate"  # one /generate result object, or a list of them
    IGNORED = "ignored"  # plain text or empty: only the status matters


@dataclass(frozen=True)
class Endpoint:
    """One HTTP endpoint of the contract.

    `paths` lists the current SGLang name first and older names after: the client tries them in order when the
    engine answers 404 and remembers the one that worked.
    """

    name: str
    method: str
    paths: tuple[str, ...]
    retry: Retry
    reply: Reply

    @property
    def path(self) -> str:
        return self.paths[0]

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


GENERATE = Endpoint("generate", "POST", ("/generate",), Retry.CONNECT, Reply.GENERATE)
HEALTH = Endpoint("health", "GET", ("/health",), Retry.IDEMPOTENT, Reply.IGNORED)
HEALTH_GENERATE = Endpoint("health_generate", "GET", ("/health_generate",), Retry.IDEMPOTENT, Reply.IGNORED)
# SGLang 0.5.16 answers /model_info and /server_info; older servers only the get_ names.
MODEL_INFO = Endpoint("model_info", "GET", ("/model_info", "/get_model_info"), Retry.IDEMPOTENT, Reply.OBJECT)
SERVER_INFO = Endpoint("server_info", "GET", ("/server_info", "/get_server_info"), Retry.IDEMPOTENT, Reply.OBJECT)
# Older servers only; newer ones report weight_version in /model_info and answer this with 404.
GET_WEIGHT_VERSION = Endpoint("get_weight_version", "GET", ("/get_weight_version",), Retry.IDEMPOTENT, Reply.ANY)
FLUSH_CACHE = Endpoint("flush_cache", "POST", ("/flush_cache",), Retry.IDEMPOTENT, Reply.IGNORED)
ABORT_REQUEST = Endpoint("abort_request", "POST", ("/abort_request",), Retry.IDEMPOTENT, Reply.IGNORED)
PAUSE_GENERATION = Endpoint("pause_generation", "POST", ("/pause_generation",), Retry.IDEMPOTENT, Reply.ANY)
CONTINUE_GENERATION = Endpoint("continue_generation", "POST", ("/continue_generation",), Retry.IDEMPOTENT, Reply.ANY)
RELEASE_MEMORY_OCCUPATION = Endpoint(
    "release_memory_occupation", "POST", ("/release_memory_occupation",), Retry.CONNECT, Reply.MAYBE_SUCCESS
)
RESUME_MEMORY_OCCUPATION = Endpoint(
    "resume_memory_occupation", "POST", ("/resume_memory_occupation",), Retry.CONNECT, Reply.MAYBE_SUCCESS
)
INIT_WEIGHTS_UPDATE_GROUP = Endpoint(
    "init_weights_update_group", "POST", ("/init_weights_update_group",), Retry.NEVER, Reply.SUCCESS
)
DESTROY_WEIGHTS_UPDATE_GROUP = Endpoint(
    "destroy_weights_update_group", "POST", ("/destroy_weights_update_group",), Retry.NEVER, Reply.SUCCESS
)
UPDATE_WEIGHTS_FROM_DISTRIBUTED = Endpoint(
    "update_weights_from_distributed", "POST", ("/update_weights_from_distributed",), Retry.NEVER, Reply.SUCCESS
)
UPDATE_WEIGHTS_FROM_TENSOR = Endpoint(
    "update_weights_from_tensor", "POST", ("/update_weights_from_tensor",), Retry.NEVER, Reply.SUCCESS
)
# hpcrl's extension (embedded engine): apply a disk-delta version named by its manifest (hpcrl/weightwire/delta.py).
# Unlike the other weight updates it pairs with no collective, and an engine that already holds the version does
# nothing: a re-sent call is safe.
UPDATE_WEIGHTS_FROM_DELTA = Endpoint(
    "update_weights_from_delta", "POST", ("/update_weights_from_delta",), Retry.IDEMPOTENT, Reply.SUCCESS
)
UPDATE_WEIGHT_VERSION = Endpoint(
    "update_weight_version", "POST", ("/update_weight_version",), Retry.IDEMPOTENT, Reply.SUCCESS
)
GET_WEIGHTS_BY_NAME = Endpoint("get_weights_by_name", "POST", ("/get_weights_by_name",), Retry.IDEMPOTENT, Reply.ANY)

ENDPOINTS: Mapping[str, Endpoint] = {
    e.name: e
    for e in (
        GENERATE,
        HEALTH,
        HEALTH_GENERATE,
        MODEL_INFO,
        SERVER_INFO,
        GET_WEIGHT_VERSION,
        FLUSH_CACHE,
        ABORT_REQUEST,
        PAUSE_GENERATION,
        CONTINUE_GENERATION,
        RELEASE_MEMORY_OCCUPATION,
        RESUME_MEMORY_OCCUPATION,
        INIT_WEIGHTS_UPDATE_GROUP,
        DESTROY_WEIGHTS_UPDATE_GROUP,
        UPDATE_WEIGHTS_FROM_DISTRIBUTED,
        UPDATE_WEIGHTS_FROM_TENSOR,
        UPDATE_WEIGHTS_FROM_DELTA,
        UPDATE_WEIGHT_VERSION,
        GET_WEIGHTS_BY_NAME,
    )
}

# `meta_info` keys of a /generate result whose name differs between engines: the canonical name (what SGLang
# 0.5.16 sends, and so what the embedded engine sends too) first, the names readers also accept after it.
META_INFO_ALIASES: Mapping[str, tuple[str, ...]] = {
    # Older SGLang called it total_retractions.
    "num_retractions": ("num_retractions", "total_retractions"),
    # SGLang 0.5.16 with return_sampling_mask; hpcrl's embedded engine before it used sampling_mask.
    "output_token_sampling_mask": ("output_token_sampling_mask", "sampling_mask"),
    # One support-normalised log-prob per output token; the embedded engine used support_logprobs.
    "output_token_sampling_logprobs": ("output_token_sampling_logprobs", "support_logprobs"),
}


def read_meta(meta: Mapping[str, object], key: str) -> object:
    """The value of canonical `key` in a result's meta_info under whichever name the engine used (None if absent)."""
    for name in META_INFO_ALIASES.get(key, (key,)):
        value = meta.get(name)
        if value is not None:
            return value
    return None
