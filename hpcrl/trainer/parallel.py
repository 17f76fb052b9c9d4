"""How the torch backend spreads its model over ranks: a parallelism is a function applied to the built model.

`parallelize(root, model, name, plan)` returns the module the training forward runs through. `root` is the module
whose forward computes the log-probs (the model inside it, the LM head and the log-softmax with it), `model` the
causal LM in it, which keeps its parameter names (those of pushes, exports and checkpoints) and is what the
optimizer and the weight calls read. A new strategy is one `apply_*` function and one line in `PARALLELISMS`; the
torch backend looks the name up and knows nothing else about it.

- `ddp`: every rank holds the whole model; DistributedDataParallel averages gradients during backward.
- `fsdp2`: torch's `fully_shard` on every decoder layer and on the root: parameters, gradients and AdamW state
  are DTensors sharded over the ranks (over a group of `fsdp.shard_group_size` ranks and replicated across the
  groups: hybrid sharding), each layer's weights gathered (and cast to the compute dtype) just before it runs.
  A mixture-of-experts layer's experts are a unit of their own, gathered only while they run.

Activation checkpointing and layer compilation live here too: they are applied per decoder layer before the model
is wrapped, as torchtitan's `parallelize` functions apply them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hpcrl.model.moe import SparseMoeBlock
from hpcrl.model.qwen3 import CausalLM
from hpcrl.trainer.config import TrainConfig, fsdp_dtypes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ParallelPlan:
    """Where a model runs: the trainer's settings, its device, the ranks, and whether this copy trains (the
    frozen reference copy of train.kl_coef does not: no gradients to average)."""

    cfg: TrainConfig
    device: torch.device
    world_size: int
    trains: bool = True


Parallelize = Callable[[nn.Module, CausalLM, ParallelPlan], nn.Module]


def apply_ddp(root: nn.Module, model: CausalLM, plan: ParallelPlan) -> nn.Module:
    """Every rank holds the whole model; gradients are averaged over ranks during backward.

    Parameters that do not train (a frozen module) are left out of the gradient reduction by DDP itself."""
    if plan.world_size == 1 or not plan.trains:
        return root  # nothing to average: a wrapper would only cost a copy of every gradient
    device = plan.device
    # Every parameter gets a gradient, an expert no token was routed to too (zeros: hpcrl.model.moe.Experts).
    return DistributedDataParallel(root, device_ids=None if device.type == "cpu" else [device])


def apply_fsdp2(root: nn.Module, model: CausalLM, plan: ParallelPlan) -> nn.Module:
    """`fully_shard` each decoder layer, then the root (the embedding, final norm and LM head are its group); in a
    mixture-of-experts layer its experts first, as a group of their own (the layer's group keeps the attention,
    the norms and the router).

    Sharded in place: `model`'s parameters become DTensors, `root` becomes an FSDP module and is returned. One
    group's weights are whole at a time in forward and backward (prefetch aside), so a rank holds 1/N of the
    model, its gradients and AdamW state plus one group gathered: for an MoE layer the larger of its attention
    with the router and its experts, never both (hpcrl.trainer.memory_plan counts it)."""
    param_dtype, reduce_dtype = fsdp_dtypes(plan.cfg)
    offload: OffloadPolicy = CPUOffloadPolicy() if plan.cfg.fsdp.offload else OffloadPolicy()
    kwargs: dict[str, Any] = {
        "mesh": fsdp_mesh(plan.device.type, plan.world_size, plan.cfg.fsdp.shard_group_size),
        "mp_policy": MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype]),
        "offload_policy": offload,
    }
    for layer in model.model.decoder_layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            fully_shard(layer.mlp.experts, **kwargs)
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    return root


PARALLELISMS: dict[str, Parallelize] = {"ddp": apply_ddp, "fsdp2": apply_fsdp2}


def parallelize(root: nn.Module, model: CausalLM, name: str, plan: ParallelPlan) -> nn.Module:
    if name not in PARALLELISMS:
        raise ValueError(f"unknown parallelism {name!r}; valid: {', '.join(PARALLELISMS)}")
    return PARALLELISMS[name](root, model, plan)


@functools.cache
def fsdp_mesh(device_type: str, world_size: int, shard_group_size: int | None) -> DeviceMesh:
    """The ranks as FSDP2 sees them: 1-D (shard over all) or 2-D (replicate across groups, shard inside one).

    Cached: the policy and the reference copy share one mesh (a mesh creates process groups, collectively)."""
    if not dist.is_initialized():
        # One rank: FSDP2 still needs a process group (its collectives are then local copies).
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    size = shard_group_size or world_size
    if size == world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world_size // size, size), mesh_dim_names=("replicate", "shard"))


def apply_compile(model: CausalLM) -> None:
    """`torch.compile` each decoder layer in place.

    Per layer rather than the whole model: the layers share one graph (compiled once); the LM head, the loss
    and a reference copy stay eager; parameter names stay those of pushes and checkpoints (Module.compile
    wraps no module)."""
    for layer in model.model.decoder_layers:
        layer.compile()


# ----- activation checkpointing -----

# `selective` keeps what is expensive to recompute: the outputs of the matrix products and of attention.
_SAVED_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    }
)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed(forward: Callable[..., torch.Tensor], selective: bool, *args: Any) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return forward(*args)  # a scoring pass keeps no activations anyway
    if selective:
        out = checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts)
    else:
        out = checkpoint(forward, *args, use_reentrant=False)
    return out


def apply_activation_checkpointing(model: CausalLM, mode: str) -> None:
    """Checkpoint every decoder layer's forward (train.activation_checkpointing): `full` keeps only the layer's
    input and runs the layer again in backward; `selective` also keeps its matmul and attention outputs and
    recomputes only the element-wise ops.

    The layer's own forward is replaced, not the module wrapped: parameter names stay those of pushes and
    checkpoints, and FSDP2's hooks on the layer still gather its weights (for the recomputation too: they are
    gathered again before the layer's backward)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown activation_checkpointing {mode!r}; valid: none, full, selective")
    for layer in model.model.decoder_layers:
        layer.forward = functools.partial(_checkpointed, layer.forward, mode == "selective")  # type: ignore[method-assign]
