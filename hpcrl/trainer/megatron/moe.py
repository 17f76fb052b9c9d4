"""Qwen3-MoE on megatron-core: the MoE layer's settings, and the routers' hook that replays the rollout's routes.

Megatron's MoELayer (TopKRouter, a token dispatcher, SequentialMLP experts) computes Qwen3-MoE's routing when
`moe_router_pre_softmax` is the opposite of `norm_topk_prob`: pre-softmax is softmax over all experts, then the top-k
probabilities as they are (norm_topk_prob: false); without it, the top-k logits' softmax, which equals the top-k
probabilities renormalised to sum 1 (norm_topk_prob: true).

Megatron's own load-balancing loss is off: its switch loss divides by top-k and counts padding tokens, so it is not
Qwen3-MoE's. The routers record their logits instead and the trainer adds `router_aux_loss_coef` x
`hpcrl.model.moe.aux_loss` (transformers' formula, real tokens only), as the torch backend does.

Routing replay goes through Megatron's own hook: `topk_routing_with_score_function` (megatron-core 0.16 and 0.19)
asks `router.router_replay.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)` for the
top-k. Megatron's RouterReplay replays whole [tokens, k] index tensors set before the forward; hpcrl's routes mark
tokens without a route with -1 (the router's own choice then) and the trainer needs the router's own top-k for
moe/route_agreement, so `RouteHook` takes the hook's place: it computes the router's own top-k, records it, and
hands Megatron the forced experts' scores gathered from this router's scores, so the router keeps its gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hpcrl.model.moe import MoeArgs, Routing, forced_routes

TopK = Callable[..., tuple[Tensor, Tensor]]

DISPATCHER = "allgather"
"""Megatron's token dispatcher for hpcrl's MoE layers. `allgather` runs on gloo and NCCL; megatron-core 0.16's
`alltoall` builds a CUDA stream in its constructor, so it cannot exist on a CPU."""


def moe_config(moe: MoeArgs, *, ep_size: int) -> dict[str, Any]:
    """TransformerConfig arguments of a Qwen3-MoE model's sparse layers."""
    if not all(moe.sparse_layers):
        dense = [i for i, sparse in enumerate(moe.sparse_layers) if not sparse]
        raise ValueError(
            f"the megatron backend builds every decoder layer as an MoE layer, but this model's layers {dense} are "
            "dense (mlp_only_layers / decoder_sparse_step); train it with train.backend: torch"
        )
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.moe_intermediate_size,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",  # hpcrl adds Qwen3-MoE's own (module docstring)
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=DISPATCHER,
        expert_model_parallel_size=ep_size,
        moe_grouped_gemm=False,
    )


class RouteHook:
    """One router's top-k (in Megatron's RouterReplay place): the router's own, recorded in `routing`, or the
    replayed experts where `routing.replay` forces them. Megatron's tokens are [s, b] (sequence-major); `routing`
    holds hpcrl's [b, s] order, as the torch backend's model records it."""

    def __init__(self, routing: Routing, moe: MoeArgs, shape: list[int]) -> None:
        self.routing, self.moe = routing, moe
        self.shape = shape  # [B, T] of the current forward, set by the model's forward pre-hook
        self.layer_number = 0  # Megatron's 1-based global layer number (set_layer_number)

    def _batch_major(self, x: Tensor) -> Tensor:
        b, t = self.shape
        return x.reshape(t, b, -1).transpose(0, 1).reshape(b * t, -1)

    def _sequence_major(self, x: Tensor) -> Tensor:
        b, t = self.shape
        return x.reshape(b, t, -1).transpose(0, 1).reshape(b * t, -1)

    def get_replay_topk(
        self, scores: Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        assert default_compute_topk is not None
        values, own = default_compute_topk(scores, topk, num_groups, group_topk)
        routing = self.routing
        own_b = self._batch_major(own)
        chosen = own_b
        if routing.replay is not None:
            b, t = self.shape
            forced = forced_routes(routing.replay, self.layer_number - 1, b, t, self.moe, own.device)
            known = (forced >= 0).all(dim=-1, keepdim=True)
            given = torch.where(known, forced, own_b)
            routing.replayed.append(known[:, 0])
            routing.given.append(given)
            if routing.force:
                chosen = given
        routing.own.append(own_b.detach())
        routing.chosen.append(chosen.detach())
        if chosen is own_b:
            return values, own
        index = self._sequence_major(chosen)
        # The forced experts' scores from this router's own: Megatron turns them into gate weights with its
        # softmax (or takes them as they are, pre-softmax), so the router keeps its gradient.
        return scores.gather(1, index), index


def attach_routing(model: Any, moe: MoeArgs) -> Routing:
    """Give a built GPTModel a `routing` (hpcrl.model.moe.Routing) that each forward clears and fills: every
    router's top-k goes through a RouteHook, its logits are recorded for the load-balancing loss."""
    from megatron.core.transformer.moe.router import TopKRouter

    routing = Routing()
    shape = [0, 0]
    model.routing = routing

    def start(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        shape[:] = list(ids.shape)
        routing.clear()

    model.register_forward_pre_hook(start, with_kwargs=True)
    for module in model.modules():
        if isinstance(module, TopKRouter):
            hook = RouteHook(routing, moe, shape)
            hook.layer_number = module.layer_number
            module.router_replay = hook
            _record_logits(module, hook)
    return routing


def _record_logits(router: Any, hook: RouteHook) -> None:
    """Wrap the router's gating (its logits [s, b, E]) to keep them, batch-major, for the load-balancing loss.

    On a CPU the gating is computed here: megatron-core 0.16's `gating` moves a CPU router weight to
    `torch.cuda.current_device()` on first use."""
    gating = router.gating

    def recorded(input: Tensor) -> Tensor:
        if router.weight.device.type == "cpu":
            logits = F.linear(input, router.weight.to(input.dtype))
        else:
            logits = gating(input)
        if hook.routing.record_logits:
            hook.routing.logits.append(hook._batch_major(logits.reshape(-1, logits.shape[-1])))
        return logits

    router.gating = recorded


class ExpertBatch:
    """The allgather dispatcher's all-gather and reduce-scatter need the same number of tokens on every rank of an
    expert-parallel group, but each data-parallel replica trims its micro-batches to their own longest row. With
    expert_parallel_size > 1 each forward is padded to the group's largest [b, T] (right padding: causal attention
    keeps the real tokens' outputs, a padding row or column routes with the model's own router and is dropped
    after), and what the forward recorded in `routing` is trimmed back to the micro-batch's own [b, T]."""

    def __init__(self, group: Any, ep_size: int) -> None:
        self.group, self.ep_size = group, ep_size

    def pad(self, ids: Tensor, routing: Routing | None) -> tuple[Tensor, tuple[int, int], Tensor | None]:
        """The padded ids, the micro-batch's own [b, T], and the routes to restore after the forward."""
        import torch.distributed as dist

        b, t = ids.shape
        if self.ep_size == 1:
            return ids, (b, t), None
        size = torch.tensor([b, t], dtype=torch.long, device=ids.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self.group)
        big_b, big_t = (int(x) for x in size.tolist())
        padded = ids.new_zeros(big_b, big_t)
        padded[:b, :t] = ids
        replay = routing.replay if routing is not None else None
        if routing is not None and replay is not None:
            if replay.shape[:2] != (b, t):
                raise ValueError(
                    f"routes of shape {tuple(replay.shape)} do not fit this forward: expected [{b}, {t}, layers, "
                    "top-k] (tokens x decoder layers x top-k)"
                )
            routes = replay.new_full((big_b, big_t, *replay.shape[2:]), -1)
            routes[:b, :t] = replay
            routing.replay = routes
        return padded, (b, t), replay

    @staticmethod
    def trim(routing: Routing, own: tuple[int, int], padded: tuple[int, int], replay: Tensor | None) -> None:
        """Cut the forward's records from the padded [B, T] back to the micro-batch's [b, T] (token-major rows)."""
        (b, t), (big_b, big_t) = own, padded
        if (b, t) == (big_b, big_t):
            return
        for records in (routing.logits, routing.own, routing.chosen, routing.replayed, routing.given):
            records[:] = [r.reshape(big_b, big_t, *r.shape[1:])[:b, :t].reshape(b * t, *r.shape[1:]) for r in records]
        routing.replay = replay


def gloo_expert_collectives() -> None:
    """Let the allgather dispatcher's collectives run on CPU tensors over gloo.

    megatron-core (0.16 and 0.19) allocates their outputs on `torch.cuda.current_device()`, and gloo has no
    reduce-scatter; on CPU tensors these replacements gather into a list and reduce-scatter as an all-reduce and a
    slice (the same sums). CUDA tensors take megatron-core's own functions. Installed once per process."""
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings, "_hpcrl_cpu_collectives", False):
        return
    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_cpu(
        input_: Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False
    ) -> Tensor:
        import torch.distributed as dist

        if input_.is_cuda or group.size() == 1 or output_split_sizes is not None:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        parts = [torch.empty_like(input_) for _ in range(group.size())]
        dist.all_gather(parts, input_.contiguous(), group=group)
        return torch.cat(parts)

    def reduce_scatter_cpu(input_: Tensor, group: Any, input_split_sizes: Any = None,
                           use_global_buffer: bool = False) -> Tensor:  # fmt: skip
        import torch.distributed as dist

        if input_.is_cuda or group.size() == 1 or input_split_sizes is not None:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.chunk(group.size())[group.rank()].contiguous()

    mappings._gather_along_first_dim = gather_cpu
    mappings._reduce_scatter_along_first_dim = reduce_scatter_cpu
    mappings._hpcrl_cpu_collectives = True
