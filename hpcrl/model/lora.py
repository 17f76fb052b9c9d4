"""The weight a low-rank adapter serves: one function, shared by the trainer's forward and the engine's merge.

A layer with an adapter serves W + B' @ A, where W is the layer's weight as loaded, A [r, in] and B' [out, r] the
adapter with the scale alpha / r already multiplied into B' (what a push sends: the engine needs no setting of
its own). The trainer's batch-invariant forward and the embedded engine both compute the served weight here, from
the same tensors with the same operations, so they hold the same bits (the on-policy guarantee extends to LoRA).
"""

from __future__ import annotations

import torch
from torch import Tensor


def merged_weight(base: Tensor, lora_a: Tensor, lora_b_scaled: Tensor) -> Tensor:
    """W + B' @ A in fp32, rounded once to W's dtype (differentiable in A and B')."""
    delta = torch.mm(lora_b_scaled.float(), lora_a.float())
    return (base.float() + delta).to(base.dtype)


def check_adapter(name: str, base_shape: tuple[int, ...], a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> None:
    """A [r, in] and B' [out, r] for a weight [out, in]; ValueError naming the weight otherwise."""
    if len(base_shape) != 2 or len(a_shape) != 2 or len(b_shape) != 2:
        raise ValueError(f"an adapter of {name!r} needs 2-D tensors; the weight has shape {list(base_shape)}")
    out_f, in_f = base_shape
    if a_shape[1] != in_f or b_shape[0] != out_f or a_shape[0] != b_shape[1] or a_shape[0] < 1:
        raise ValueError(
            f"the adapter of {name!r} has A {list(a_shape)} and B {list(b_shape)}; a weight of shape "
            f"{list(base_shape)} needs A [r, {in_f}] and B [{out_f}, r] with the same r >= 1"
        )


LORA_A, LORA_B = ".lora_A", ".lora_B"
"""A push names the adapter of weight P `P.lora_A` (A) and `P.lora_B` (B', the scale multiplied in)."""


def adapter_target(name: str) -> tuple[str, str] | None:
    """(the weight's name, "A" or "B") for a pushed adapter tensor's name; None for any other name."""
    for suffix, part in ((LORA_A, "A"), (LORA_B, "B")):
        if name.endswith(suffix):
            return name.removesuffix(suffix), part
    return None
