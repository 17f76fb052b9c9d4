"""How the embedded engine writes a received update into its model: one class per strategy, picked by name.

A weight-update request (`/update_weights_from_distributed`, `/update_weights_from_tensor`) names its strategy in
`apply_strategy`; absent means `replace`, which is what a stock SGLang server does with every update.
  replace  the tensors are the new values of the named parameters
  delta    the tensors are added to the named parameters (a transport that sends what changed)
Every strategy writes into the parameters' own storage (never re-points them): the runner's fused q/k/v and
gate/up tensors are views of it, and captured graphs hold its addresses. A strategy refuses an update before it
writes anything, so a refused update leaves the model as it was.

Merging an adapter (LoRA: the model serves base + s·BA, merged once per version from a kept copy of the base,
never by subtracting the previous adapter) is the next strategy; it keeps that base copy as its own state.
A new strategy is one class here, listed in STRATEGIES.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Protocol

import torch

from hpcrl.weightwire.finite import first_non_finite

DEFAULT = "replace"


class ApplyStrategy(Protocol):
    name: ClassVar[str]
    receives_in_place: ClassVar[bool]
    """Whether a broadcast may land straight in a parameter (the update is its new value)."""

    def apply(self, params: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Write `named` into `params` (scheduler thread, between forward passes); ValueError refuses the update
        before anything is written."""
        ...


class Replace:
    name: ClassVar[str] = "replace"
    receives_in_place: ClassVar[bool] = True

    def apply(self, params: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)


class Delta:
    """parameter += delta. The sum is taken in the wider of the two dtypes and rounded to the parameter's once,
    and all of a bucket's sums are checked finite before any is written."""

    name: ClassVar[str] = "delta"
    receives_in_place: ClassVar[bool] = False

    def apply(self, params: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            sums = [(name, params[name] + delta.to(params[name].device)) for name, delta in named]
            bad = first_non_finite(sums)
            if bad is not None:
                raise ValueError(
                    f"weight {bad!r} plus its delta holds non-finite values (NaN or inf): nothing of this update was "
                    "loaded. Push a full update (apply_strategy replace) of finite weights"
                )
            for name, total in sums:
                params[name].copy_(total)


class Xor:
    """parameter bits ^= tensor bits: each tensor is the bitwise XOR of a parameter's old and new values (its dtype
    and shape), what a disk-delta push stores for what changed. The result is exact to the bit (no arithmetic), and
    XOR is its own inverse: applying the same tensors again restores the old bits. Every name, shape and dtype is
    checked before anything is written; the loader checks each result against the writer's checksum."""

    name: ClassVar[str] = "xor"
    receives_in_place: ClassVar[bool] = False
    _BITS: ClassVar[dict[torch.dtype, torch.dtype]] = {
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
        torch.float32: torch.int32,
    }

    def apply(self, params: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, patch in named:
            param = params[name]
            if param.dtype not in self._BITS or patch.dtype != param.dtype or patch.shape != param.shape:
                raise ValueError(
                    f"xor patch of {name!r} is {patch.dtype}{list(patch.shape)}; the parameter is "
                    f"{param.dtype}{list(param.shape)} (a patch has the parameter's dtype, one of "
                    f"{sorted(map(str, self._BITS))}, and shape): nothing of this update was loaded"
                )
        with torch.no_grad():
            for name, patch in named:
                bits = self._BITS[patch.dtype]
                params[name].view(bits).bitwise_xor_(patch.to(params[name].device).view(bits))


STRATEGIES: dict[str, type[ApplyStrategy]] = {cls.name: cls for cls in (Replace, Delta, Xor)}


def strategy(name: str) -> ApplyStrategy:
    """The strategy called `name`; ValueError naming the valid ones."""
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"apply_strategy {name!r} is not one of {sorted(STRATEGIES)}; absent means {DEFAULT!r}")
    return cls()
