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
    `named` is read once keeping no tensor (a push of sharded weights gathers each one as it is read), and a
    second time only where a sum is not finite: pass something that reads again, as a list does.
    """
    names: list[str] = []
    sums: list[Tensor] = []
    for name, tensor in named:
        if tensor.is_floating_point():
            names.append(name)
            sums.append(tensor.sum(dtype=torch.float32))  # an empty tensor sums to 0
    if not sums:
        return None
    finite = torch.isfinite(torch.stack(sums))
    if bool(finite.all()):
        return None
    suspects = {name for name, ok in zip(names, finite.tolist(), strict=True) if not ok}
    for name, tensor in named:
        if name in suspects and not bool(torch.isfinite(tensor).all()):
            return name
    return None
