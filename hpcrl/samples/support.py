"""Sampling supports: for every generated token, the token ids the engine's top-k/top-p filter let it draw from.

The trainer renormalises its distribution over these ids (sampling-support replay, docs/sampling-replay.md), so
they travel with the sample from the engine to the trainer ranks. They travel ragged (CSR: `offsets` into one
int32 `ids` array, about top_k ids per token at most), never as a dense [tokens x vocab] mask.

A token the model did not sample (a tool result or user turn spliced into a multi-turn sample) has the singleton
support {token}: its renormalised log-prob is log 1 = 0, whatever the weights. `TokenSupports.singletons` makes
those, and `TokenSupports.concat` joins the spans of one sample in token order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["TokenSupports"]


@dataclass(frozen=True, eq=False)
class TokenSupports:
    """Supports of `num_tokens` consecutive tokens: token i's ids are `ids[offsets[i]:offsets[i + 1]]`."""

    offsets: np.ndarray  # int64 [num_tokens + 1], offsets[0] == 0, non-decreasing
    ids: np.ndarray  # int32 [offsets[-1]]

    def __post_init__(self) -> None:
        offsets = np.ascontiguousarray(self.offsets, dtype=np.int64)
        ids = np.ascontiguousarray(self.ids, dtype=np.int32)
        if offsets.ndim != 1 or ids.ndim != 1 or offsets.size < 1 or offsets[0] != 0:
            raise ValueError("supports need 1-d offsets starting at 0 and 1-d ids")
        if bool((np.diff(offsets) < 0).any()) or offsets[-1] != ids.size:
            raise ValueError(f"support offsets must be non-decreasing and end at len(ids)={ids.size}")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "ids", ids)

    # ----- building -----
    @classmethod
    def from_lists(cls, ids_per_token: Sequence[Sequence[int]]) -> TokenSupports:
        """From one id list per token (what an engine's `output_token_sampling_mask` holds)."""
        sizes = np.fromiter((len(s) for s in ids_per_token), dtype=np.int64, count=len(ids_per_token))
        offsets = np.zeros(len(ids_per_token) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        flat = np.fromiter((i for s in ids_per_token for i in s), dtype=np.int64, count=int(offsets[-1]))
        if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(np.int32).max):
            raise ValueError(f"support ids must be token ids in [0, 2**31), got range [{flat.min()}, {flat.max()}]")
        return cls(offsets=offsets, ids=flat.astype(np.int32))

    @classmethod
    def singletons(cls, token_ids: Sequence[int]) -> TokenSupports:
        """The support {token} for each of `token_ids`: tokens the model did not sample (tool results, user turns)."""
        return cls(offsets=np.arange(len(token_ids) + 1, dtype=np.int64), ids=np.asarray(token_ids, dtype=np.int32))

    @classmethod
    def concat(cls, parts: Sequence[TokenSupports]) -> TokenSupports:
        """The supports of consecutive spans of one sample (e.g. model turn, tool result, model turn), in order."""
        if not parts:
            return cls(offsets=np.zeros(1, dtype=np.int64), ids=np.zeros(0, dtype=np.int32))
        starts = np.cumsum([0] + [p.ids.size for p in parts[:-1]])
        offsets = np.concatenate(
            [np.zeros(1, np.int64)] + [p.offsets[1:] + s for p, s in zip(parts, starts, strict=True)]
        )
        return cls(offsets=offsets, ids=np.concatenate([p.ids for p in parts]))

    def split(self, num_tokens: Sequence[int]) -> list[TokenSupports]:
        """The inverse of `concat`: consecutive parts of `num_tokens[i]` tokens each (they must add up)."""
        if sum(num_tokens) != self.num_tokens:
            raise ValueError(f"split into {sum(num_tokens)} tokens, but the supports cover {self.num_tokens}")
        parts, start = [], 0
        for n in num_tokens:
            lo, hi = self.offsets[start], self.offsets[start + n]
            parts.append(TokenSupports(offsets=self.offsets[start : start + n + 1] - lo, ids=self.ids[lo:hi].copy()))
            start += n
        return parts

    # ----- reading -----
    @property
    def num_tokens(self) -> int:
        return int(self.offsets.size - 1)

    def sizes(self) -> np.ndarray:
        """Support size of every token, int64 [num_tokens]."""
        return np.diff(self.offsets)

    def of(self, index: int) -> np.ndarray:
        return self.ids[self.offsets[index] : self.offsets[index + 1]]

    def check_tokens(self, token_ids: Sequence[int], *, where: str) -> None:
        """Raise ValueError unless there is one non-empty support per token and each holds its token."""
        if self.num_tokens != len(token_ids):
            raise ValueError(f"{where}: {self.num_tokens} sampling supports for {len(token_ids)} tokens")
        sizes = self.sizes()
        if sizes.size and sizes.min() < 1:
            first = int(np.argmin(sizes))
            raise ValueError(f"{where}: token {first} has an empty sampling support")
        rows = np.repeat(np.arange(self.num_tokens), sizes)
        order = np.lexsort((self.ids, rows))
        same = (np.diff(rows[order]) == 0) & (np.diff(self.ids[order]) == 0)
        if same.any():
            first = int(rows[order][1:][same][0])
            raise ValueError(f"{where}: the sampling support of token {first} lists an id twice")
        hit = np.zeros(self.num_tokens, dtype=bool)
        hit[rows[self.ids == np.asarray(token_ids, dtype=np.int64)[rows]]] = True
        if not hit.all():
            first = int(np.argmin(hit))
            raise ValueError(
                f"{where}: the sampling support of token {first} does not hold the sampled token {token_ids[first]}"
            )

    # ----- plain-array form (checkpoints, buffers) -----
    def to_arrays(self, prefix: str = "support_") -> dict[str, np.ndarray]:
        """`{prefix}offsets` (int64) and `{prefix}ids` (int32): plain arrays an HDF5 file or npz holds as they are."""
        return {f"{prefix}offsets": self.offsets, f"{prefix}ids": self.ids}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], prefix: str = "support_") -> TokenSupports:
        """The inverse of `to_arrays` (validated)."""
        return cls(offsets=np.asarray(arrays[f"{prefix}offsets"]), ids=np.asarray(arrays[f"{prefix}ids"]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenSupports):
            return NotImplemented
        return bool(np.array_equal(self.offsets, other.offsets) and np.array_equal(self.ids, other.ids))

    def __repr__(self) -> str:
        return f"TokenSupports(num_tokens={self.num_tokens}, num_ids={self.ids.size})"
