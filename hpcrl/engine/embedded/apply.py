"""How the embedded engine writes a received update into its model: one class per strategy, picked by name.

A weight-update request (`/update_weights_from_distributed`, `/update_weights_from_tensor`) names its strategy in
`apply_strategy`; absent means `replace`, which is what a stock SGLang server does with every update.
  replace  the tensors are the new values of the named parameters
  delta    the tensors are added to the named parameters (a transport that sends what changed)
  lora     the tensors are low-rank adapters `P.lora_A`, `P.lora_B` of weights P: the engine serves P_base + B' A
Every strategy writes into the parameters' own storage (never re-points them): the runner's fused q/k/v and
gate/up tensors are views of it, and captured graphs hold its addresses. A strategy refuses an update before it
writes anything, so a refused update leaves the model as it was.

A strategy may keep state across updates (the engine makes one of each per process): `lora` keeps a host copy of
every weight it adapts, as loaded, and merges each version's adapter into it once (never subtracting the
previous adapter, whose rounding would accumulate). A new strategy is one class here, listed in STRATEGIES.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Protocol

import torch

from hpcrl.model.lora import adapter_target, check_adapter, merged_weight
from hpcrl.weightwire.finite import first_non_finite

DEFAULT = "replace"


class ApplyStrategy(Protocol):
    name: ClassVar[str]
    receives_in_place: ClassVar[bool]
    """Whether a broadcast may land straight in a parameter (the update is its new value)."""

    def check_names(self, weights: Mapping[str, tuple[int, ...]], named: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Refuse (ValueError) names and shapes this strategy cannot write into a model whose weights have
        `weights`' shapes, before any byte is received."""
        ...

    def apply(self, params: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Write `named` into `params` (scheduler thread, between forward passes); ValueError refuses the update
        before anything is written."""
        ...


def check_weight_names(weights: Mapping[str, tuple[int, ...]], named: Sequence[tuple[str, Sequence[int]]]) -> None:
    """Each name is one of the model's weights, with its shape (the tensors are values or deltas of weights)."""
    for name, shape in named:
        if name not in weights:
            raise ValueError(f"unknown weight {name!r}: the engine's model has no such parameter")
        if tuple(shape) != weights[name]:
            raise ValueError(f"weight {name!r} has shape {tuple(shape)}, the model expects {weights[name]}")


class Replace:
    name: ClassVar[str] = "replace"
    receives_in_place: ClassVar[bool] = True
    check_names = staticmethod(check_weight_names)

    def apply(self, params: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)


class Delta:
    """parameter += delta. The sum is taken in the wider of the two dtypes and rounded to the parameter's once,
    and all of a bucket's sums are checked finite before any is written."""

    name: ClassVar[str] = "delta"
    receives_in_place: ClassVar[bool] = False
    check_names = staticmethod(check_weight_names)

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


class MergeLoRA:
    """P = P_base + B' A for each adapter `P.lora_A` (A [r, in]) and `P.lora_B` (B' [out, r], the scale multiplied
    in), computed by hpcrl/model/lora.py as the trainer computes it. P_base is a host copy of P taken the first time
    an adapter of P arrives (the engine then serves the base it loaded), and every version merges into that copy:
    exactly once per version, never by subtracting the previous adapter. A's and B's halves may arrive in
    different buckets of one push; a weight is written when both of its halves are in."""

    name: ClassVar[str] = "lora"
    receives_in_place: ClassVar[bool] = False

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}  # weight name -> its values as loaded, on the host
        self._halves: dict[str, dict[str, torch.Tensor]] = {}  # weight name -> "A"/"B" waiting for the other

    def check_names(self, weights: Mapping[str, tuple[int, ...]], named: Sequence[tuple[str, Sequence[int]]]) -> None:
        for name, _ in named:
            target = adapter_target(name)
            if target is None:
                raise ValueError(
                    f"{name!r} is not an adapter: apply_strategy lora takes tensors named P.lora_A and P.lora_B for "
                    "weights P of the model; send other weights with apply_strategy replace"
                )
            if target[0] not in weights:
                raise ValueError(f"{name!r} adapts {target[0]!r}, which the engine's model does not have")
        shapes = {name: tuple(shape) for name, shape in named}
        for name, _ in named:
            weight, part = adapter_target(name)  # type: ignore[misc]
            other = f"{weight}.lora_{'B' if part == 'A' else 'A'}"
            if other in shapes:
                a, b = (shapes[name], shapes[other]) if part == "A" else (shapes[other], shapes[name])
                check_adapter(weight, weights[weight], a, b)

    def apply(self, params: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]]) -> None:
        halves = {w: dict(h) for w, h in self._halves.items()}
        for name, tensor in named:
            weight, part = adapter_target(name)  # type: ignore[misc]
            halves.setdefault(weight, {})[part] = tensor
        ready = {w: h for w, h in halves.items() if len(h) == 2}
        with torch.no_grad():
            merged = []
            for weight, h in ready.items():
                param = params[weight]
                check_adapter(weight, tuple(param.shape), tuple(h["A"].shape), tuple(h["B"].shape))
                base = self.base.get(weight)
                base_here = param if base is None else base.to(param.device)
                merged.append((weight, merged_weight(base_here, h["A"].to(param.device), h["B"].to(param.device))))
            bad = first_non_finite(merged)
            if bad is not None:
                raise ValueError(
                    f"weight {bad!r} merged with its adapter holds non-finite values (NaN or inf): nothing of this "
                    "update was loaded. The trainer's adapters diverged; push finite ones (e.g. from the last "
                    "checkpoint)"
                )
            for weight, value in merged:
                if weight not in self.base:
                    self.base[weight] = params[weight].detach().to("cpu", copy=True)
                params[weight].copy_(value)
        # A half that waits for its other half outlives this bucket's buffer (a handover is unmapped after it).
        self._halves = {
            w: {p: t.to("cpu", copy=True) for p, t in h.items()} for w, h in halves.items() if w not in ready
        }


class Xor:
    """parameter bits ^= tensor bits: each tensor is the bitwise XOR of a parameter's old and new values (its dtype
    and shape), what a disk-delta push stores for what changed. The result is exact to the bit (no arithmetic), and
    XOR is its own inverse: applying the same tensors again restores the old bits. Every name, shape and dtype is
    checked before anything is written; the loader checks each result against the writer's checksum."""

    name: ClassVar[str] = "xor"
    receives_in_place: ClassVar[bool] = False
    check_names = staticmethod(check_weight_names)
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


STRATEGIES: dict[str, type[ApplyStrategy]] = {cls.name: cls for cls in (Replace, Delta, MergeLoRA, Xor)}


def strategy(name: str) -> ApplyStrategy:
    """A new strategy called `name`; ValueError naming the valid ones."""
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"apply_strategy {name!r} is not one of {sorted(STRATEGIES)}; absent means {DEFAULT!r}")
    return cls()
