"""What rollout produces and the trainer consumes: prompts (`Example`), samples and their groups.

The bottom of hpcrl's import graph: it imports nothing of hpcrl but the sampling supports beside it, so the
data sources, the rollout (single- and multi-turn), the buffer and the trainer all build on the same types
without importing one another (tests/unit/test_layers.py keeps it so).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from hpcrl.samples.support import TokenSupports

__all__ = ["DataError", "Example", "Group", "Sample", "sample_seed"]


class DataError(ValueError):
    """A user error in a dataset file, a data source name or a data checkpoint."""


@dataclass(frozen=True, slots=True)
class Example:
    """One prompt and the reference answer that the reward function compares a response against."""

    prompt: str
    answer: str
    meta: str = ""
    """JSON that a reward taking `meta` receives (a reasoning-gym entry's identity); empty for plain data."""


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int, namespace: str = "") -> int:
    # A namespace (evaluation's "eval/") draws from seeds no training sample can have.
    key = f"{namespace}{seed}/{step}/{prompt_index}/{sample_index}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # non-negative and inside int63


@dataclass
class Sample:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    text: str
    finish: str  # stop | length | abort
    weight_versions: list[int | None]  # per output token (hpcrl/samples/versions.py); None: not sampled, or unknown
    reward: float = 0.0
    reward_error: str | None = None
    supports: TokenSupports | None = None
    """Per output token, the ids top-k/top-p let the engine draw from (None without filtering); `logprobs`
    are then renormalised over them. Plain arrays for a buffer or checkpoint: `supports.to_arrays()`."""
    sampled_logprobs: list[float] | None = None  # engine.logprobs: recompute: what `logprobs` replaced
    loss_mask: list[int] | None = None
    """Over output_ids, for multi-turn samples: 1 on sampled tokens, 0 on tool and template tokens (None: all 1)."""
    routed_experts: np.ndarray | None = None
    """Mixture-of-experts models with routing replay: the experts the engine routed each token to, int32
    [prompt + output - 1 tokens, decoder layers, top-k] (-1 on dense layers); the trainer forces them."""


@dataclass
class Group:
    example: Example
    samples: list[Sample] = field(default_factory=list)
