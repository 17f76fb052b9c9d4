"""One sequence the embedded engine generates (`SeqRequest`: its prompt, sampling settings, outputs and finish), and
the errors and pause modes of the engine's control operations."""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from hpcrl.engine.embedded.detokenize import RowText
from hpcrl.engine.embedded.step_output import RowState
from hpcrl.engine.protocol.answers import GrowingPackedColumn

PauseMode = Literal["abort", "retract", "in_place"]


class EngineStateError(RuntimeError):
    """A request that the engine's current state forbids (maps to HTTP 400)."""


@dataclass
class SeqRequest:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    return_logprob: bool
    return_sampling_mask: bool
    on_done: Callable[[SeqRequest], object]
    logprob_scaled: bool = False  # report the temperature-scaled log-probs (return_scaled_logprob)
    # Score the prompt from this position (logprob_start_len; -1: not asked): input_logprobs holds one entry per
    # prompt token from there, None for that first one (SGLang's layout: its logits start there).
    logprob_start_len: int = -1
    input_logprobs: list[float | None] | None = None
    # top_logprobs_num > 0: input_top_logprobs holds, per entry of input_logprobs, the k most likely (logprob, id).
    top_logprobs_num: int = 0
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_ids: list[int] = field(default_factory=list)
    # Doubles stored inline, not float objects: a row's log-probs arrive one a step, between every other row's, so
    # as list items they lie scattered over the heap and the answer that walks them waits on memory. H200 host,
    # 256 x 512 answer: 125 ms of CPU a pass with lists, 57 ms with arrays.
    logprobs: array[float] = field(default_factory=lambda: array("d"))
    scaled_logprobs: array[float] = field(default_factory=lambda: array("d"))
    support_logprobs: list[float] = field(default_factory=list)
    support_ids: list[list[int]] = field(default_factory=list)
    version_spans: list[list[Any]] = field(default_factory=list)  # [version, start, end)
    finish_reason: dict[str, Any] | None = None
    num_retractions: int = 0
    created_s: float = field(default_factory=time.monotonic)
    finished_s: float | None = None
    answered_s: float | None = None  # handed to on_done: after any re-score, which finished_s precedes
    cached_len: int = 0  # tokens of prompt+output whose K/V are in the cache
    sampled_logprobs: list[float] | None = None  # the sampled log-probs, when `logprobs` holds a re-score
    text: RowText = field(default_factory=RowText)  # the output's text so far (the scheduler's TextDecoder)
    # The reported log-prob column packed so far, when the request asked for the packed wire (None: not asked).
    packed_column: GrowingPackedColumn | None = None
    return_routed_experts: bool = False
    # Per forward that ran this row's tokens, the experts they were routed to, [tokens, layers, k] int32 (MoE models):
    # token i's routes are fixed by the forward that first ran it; a re-prefill after a retraction adds none.
    routes: list[np.ndarray] = field(default_factory=list)
    routes_len: int = 0

    def add_routes(self, routes: np.ndarray, first: int) -> None:
        """Routes of this row's tokens first..first+len(routes)-1; those of tokens already recorded are dropped."""
        skip = self.routes_len - first
        if skip < len(routes):
            self.routes.append(routes[max(skip, 0) :])
            self.routes_len += len(routes) - max(skip, 0)

    @property
    def reported_logprobs(self) -> array[float]:
        """The log-prob column the answer reports: the temperature-scaled one for return_scaled_logprob."""
        return self.scaled_logprobs if self.logprob_scaled else self.logprobs

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def row_state(self) -> RowState:
        return RowState(
            token=self.output_ids[-1] if self.output_ids else self.prompt_ids[-1],
            position=self.cached_len,
            seed=self.seed,
            step=len(self.output_ids),
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
        )
