"""Are these weights finite? Asked of every push, by the trainer before it sends and by the engine before it loads."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


class NonFiniteWeightsError(RuntimeError):
    """A weight is NaN or infinite: it must reach neither an engine nor a checkpoint (the message names it)."""


def first_non_finite(named: Iterable[tuple[str, Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or inf, None when all are finite.

    A finite sum proves a tensor finite (NaN and inf propagate through it), so the usual case costs one
    sum per tensor and one check for all of them, several times cheaper than an isfinite pass per tensor
    on a small model's push. A sum that overflows only sends the search to the exact per-tensor test.
    """
    floats = [(name, t) for name, t in named if t.is_floating_point()]
    if not floats:
        return None
    sums = torch.stack([t.sum(dtype=torch.float32) for _, t in floats])  # an empty tensor sums to 0
    if bool(torch.isfinite(sums).all()):
        return None
    for name, tensor in floats:
        if not bool(torch.isfinite(tensor).all()):
            return name
    return None
