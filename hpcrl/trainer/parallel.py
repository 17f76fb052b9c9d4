"""How the torch backend spreads its model over ranks: a parallelism is a function applied to the built model.

`parallelize(model, name, ...)` returns the module the training forward runs through; the model itself keeps
its parameter names (those of pushes, exports and checkpoints) and is what the optimizer and the weight calls
read. A new strategy (FSDP2's `fully_shard` per decoder layer, say) is one `apply_*` function and one line in
`PARALLELISMS`; the torch backend looks the name up and knows nothing else about it.

Layer compilation lives here too: it is applied per decoder layer before the model is wrapped, as
torchtitan's `parallelize` functions apply it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpcrl.model.qwen3 import CausalLM

Parallelize = Callable[[CausalLM, torch.device, int], nn.Module]


def apply_ddp(model: CausalLM, device: torch.device, world_size: int) -> nn.Module:
    """Every rank holds the whole model; gradients are averaged over ranks during backward.

    Parameters that do not train (a frozen module) are left out of the gradient reduction by DDP itself."""
    if world_size == 1:
        return model  # nothing to average: a wrapper would only cost a copy of every gradient
    # An expert no token of a rank's micro-batch was routed to gets no gradient there: DDP must look for such
    # parameters each backward (a dense model has none, and skips that walk).
    return DistributedDataParallel(
        model, device_ids=None if device.type == "cpu" else [device], find_unused_parameters=model.args.moe is not None
    )


PARALLELISMS: dict[str, Parallelize] = {"ddp": apply_ddp}


def parallelize(model: CausalLM, name: str, *, device: torch.device, world_size: int) -> nn.Module:
    if name not in PARALLELISMS:
        raise ValueError(f"unknown parallelism {name!r}; valid: {', '.join(PARALLELISMS)}")
    return PARALLELISMS[name](model, device, world_size)


def apply_compile(model: CausalLM) -> None:
    """`torch.compile` each decoder layer in place.

    Per layer rather than the whole model: the layers share one graph (compiled once); the LM head, the loss
    and a reference copy stay eager; parameter names stay those of pushes and checkpoints (Module.compile
    wraps no module)."""
    for layer in model.model.decoder_layers:
        layer.compile()
