"""Mixture-of-experts layers (Qwen3-MoE): a softmax top-k router over SwiGLU experts, the load-balancing
auxiliary loss, and rollout routing replay.

Parameter names equal the Hugging Face checkpoints' (`mlp.gate.weight`, `mlp.experts.E.gate_proj.weight`, ...):
one module per expert, the layout Qwen3-MoE checkpoints are published in and SGLang loads. transformers 5 fuses
the experts into `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] in memory;
`split_fused_experts` reads such a state dict too.

Routing replay (R3): the engine records which experts each token was routed to while it sampled; the trainer
forces those experts (`Routing.replay`) while the gate weights are still the softmax of the router's own logits
at the forced experts, so the router keeps its gradient and only the discrete choice is taken from the rollout.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROUTE_DTYPE = np.int32
"""Routed expert ids on the wire: int32, as SGLang's `meta_info.routed_experts` (base64 of the raw bytes)."""


@dataclass(frozen=True, kw_only=True)
class MoeArgs:
    """The expert settings of a Qwen3-MoE config."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    sparse_layers: tuple[bool, ...] = ()
    """Per decoder layer, whether its MLP is the sparse expert block (else a dense SwiGLU MLP)."""

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MoeArgs:
        num_layers = int(cfg["num_hidden_layers"])
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
        top_k = int(cfg.get("num_experts_per_tok", 0) or 0)
        step = int(cfg.get("decoder_sparse_step", 1) or 0)
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1 for a qwen3_moe model, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
        dense = cfg.get("mlp_only_layers") or []
        bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layer indices 0..{num_layers - 1}")
        for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
            if cfg.get(key):
                raise ValueError(f"{key} is not supported: hpcrl's Qwen3-MoE block has no shared expert")
        if cfg.get("scoring_func", "softmax") != "softmax":
            raise ValueError(f"scoring_func {cfg['scoring_func']!r} is not supported: hpcrl's router is softmax top-k")
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001) or 0.0),
            sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        )


@dataclass
class Routing:
    """What one forward of an MoE model routes: per sparse layer the router logits [N, E] and the experts used
    [N, k] (N = B*T tokens); and, when set before the forward, the experts to force (`replay`).

    The model owns one; a forward clears and fills it, so it describes the latest forward only.
    """

    replay: torch.Tensor | None = None
    """[B, T, L, k] expert ids per token and decoder layer (-1: route the token with the model's own router), used
    by every forward until reset."""
    force: bool = True
    """Route by `replay` (False: only compare the model's own routes with it, for `route_stats`)."""
    record_logits: bool = False
    """Keep each layer's router logits (with their graph) for the auxiliary loss; off where nobody reads them."""
    logits: list[torch.Tensor] = field(default_factory=list)
    chosen: list[torch.Tensor] = field(default_factory=list)
    """Per sparse layer, the experts each token used [N, k] (the replayed ones where replay was given)."""
    own: list[torch.Tensor] = field(default_factory=list)
    """Per sparse layer, the experts the model's own router picks [N, k] (before replay)."""
    replayed: list[torch.Tensor] = field(default_factory=list)
    """Per sparse layer, which tokens [N] had a complete replay row (forced, or compared without `force`)."""
    given: list[torch.Tensor] = field(default_factory=list)
    """Per sparse layer, the replay rows [N, k] (own routes where a row was incomplete)."""

    def clear(self) -> None:
        """Forget the previous forward's routes (every forward of the model starts with this); `replay` stays
        until the caller resets it."""
        self.logits.clear()
        self.chosen.clear()
        self.own.clear()
        self.replayed.clear()
        self.given.clear()


class Expert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """One sparse layer's experts (children named 0..E-1, so the parameter names stay the checkpoints'
    `mlp.experts.E.*`), called as one module: FSDP2 shards them as a unit of their own (`train.parallelism:
    fsdp2`), gathered only while they run. Not an nn.ModuleList: torch before 2.13 refuses to fully_shard any
    ModuleList, also one with a forward of its own."""

    def __init__(self, hidden_size: int, moe: MoeArgs) -> None:
        super().__init__()
        for e in range(moe.num_experts):
            self.add_module(str(e), Expert(hidden_size, moe.moe_intermediate_size))
        self.num_experts = moe.num_experts
        self._stack_cache: tuple[tuple[tuple[int, int], ...], torch.Tensor, torch.Tensor] | None = None

    def __getitem__(self, e: int) -> Expert:
        return cast(Expert, self._modules[str(e)])

    def __iter__(self) -> Iterator[Expert]:
        return (cast(Expert, m) for m in self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def forward(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each expert over the tokens routed to it: grouped GEMMs for bf16 on CUDA (`grouped_experts`), else the
        plain per-expert path (the CPU, fp32)."""
        if flat.is_cuda and flat.dtype == torch.bfloat16 and grouped_mm_on(flat.device):
            return grouped_experts(flat, chosen, weights, *self.stacked())
        return self.plain(flat, chosen, weights)

    def plain(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each expert in turn over the tokens routed to it. Where autograd records, an expert no token was routed
        to runs too, over zero rows: every expert then has a gradient (zeros), as under the grouped GEMMs, so DDP
        and FSDP2 reduce the same set of gradients on every rank and AdamW treats the expert alike under both."""
        out = torch.zeros_like(flat)
        if torch.is_grad_enabled() and any(p.requires_grad for p in self[0].parameters()):
            experts: list[int] = list(range(self.num_experts))
        else:
            experts = torch.nonzero(torch.bincount(chosen.reshape(-1), minlength=self.num_experts)).flatten().tolist()
        for e in experts:
            token, slot = torch.where(chosen == e)
            y = self[e](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weights as grouped-GEMM operands: gate and up [E, hidden, 2I], down [E, I, hidden]. Stacked
        on every forward where autograd records (the gradients flow to each expert's parameters); kept between
        forwards under inference mode (the engine's decode) until a parameter is replaced or written in place."""
        experts = list(self)
        inference = torch.is_inference_mode_enabled()
        key = tuple(
            (p.data_ptr(), p._version)
            for ex in experts
            for p in (ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight)
        )
        if inference and self._stack_cache is not None and self._stack_cache[0] == key:
            return self._stack_cache[1], self._stack_cache[2]
        gate_up = torch.stack([torch.cat([ex.gate_proj.weight, ex.up_proj.weight]) for ex in experts])
        down = torch.stack([ex.down_proj.weight for ex in experts])
        # [E, N, K] transposed to [E, K, N]: the column-major operand the grouped kernel reads without a copy.
        stacked = gate_up.transpose(1, 2), down.transpose(1, 2)
        self._stack_cache = (key, *stacked) if inference else None
        return stacked


class SparseMoeBlock(nn.Module):
    """Softmax over the router's logits, the top-k experts per token (renormalised with norm_topk_prob), the
    weighted sum of those experts' SwiGLU outputs: transformers' Qwen3MoeSparseMoeBlock, op for op in fp32."""

    def __init__(self, hidden_size: int, moe: MoeArgs, layer: int, routing: Routing) -> None:
        super().__init__()
        self.moe = moe
        self.layer = layer
        self.routing = routing
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(hidden_size, moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        logits = self.gate(flat)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_p, own = torch.topk(probs, self.moe.top_k, dim=-1)
        chosen, weights = self.route(logits, probs, own, top_p, b, t)
        return self.experts(flat, chosen, weights).reshape(b, t, h)

    def route(
        self,
        logits: torch.Tensor,
        probs: torch.Tensor,
        own: torch.Tensor,
        top_p: torch.Tensor,
        b: int,
        t: int,
        row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts [N, k] each of the B*T tokens runs and their gate weights (logits' dtype), from the router's
        logits [N, E], its fp32 probabilities, its own top-k `own` and their probabilities `top_p`: the replayed
        experts where `Routing.replay` forces them. Recorded in `routing` for the statistics and the routes.
        `row_sum` sums each row of k weights for norm_topk_prob (the batch-invariant forward passes its own)."""
        chosen = own
        replay = self.routing.replay
        if replay is not None:
            forced = self._forced(replay, b, t)
            known = (forced >= 0).all(dim=-1, keepdim=True)
            given = torch.where(known, forced, own)
            self.routing.replayed.append(known[:, 0])
            self.routing.given.append(given)
            if self.routing.force:
                chosen = given
                # The forced experts' gate weights from this router's own probabilities: the router keeps its gradient.
                top_p = probs.gather(1, chosen)
        if self.moe.norm_topk_prob:
            top_p = top_p / (row_sum(top_p) if row_sum is not None else top_p.sum(dim=-1))[:, None]
        weights = top_p.to(logits.dtype)
        if self.routing.record_logits:
            self.routing.logits.append(logits)
        self.routing.own.append(own.detach())
        self.routing.chosen.append(chosen.detach())
        return chosen, weights

    def _forced(self, replay: torch.Tensor, b: int, t: int) -> torch.Tensor:
        return forced_routes(replay, self.layer, b, t, self.moe, self.gate.weight.device)


def forced_routes(replay: torch.Tensor, layer: int, b: int, t: int, moe: MoeArgs, device: torch.device) -> torch.Tensor:
    """Decoder layer `layer`'s rows of the routes to replay [B, T, layers, k], as [B*T, k] expert ids (long) on
    `device`; -1 where a token has no route. A shape or an expert id that does not fit the model is an error."""
    if replay.shape[:2] != (b, t) or replay.shape[3] != moe.top_k or replay.dim() != 4:
        raise ValueError(
            f"routes of shape {tuple(replay.shape)} do not fit this forward: expected [{b}, {t}, layers, "
            f"{moe.top_k}] (tokens x decoder layers x top-k)"
        )
    forced = replay[:, :, layer].reshape(b * t, moe.top_k).to(device=device)
    over = forced >= moe.num_experts
    if bool(over.any()):
        raise ValueError(f"routes name expert {int(forced.max())}, but layer {layer} has {moe.num_experts} experts")
    return forced.long()


def grouped_mm_on(device: torch.device) -> bool:
    """Whether `torch._grouped_mm` (torch >= 2.8, bf16) runs on this CUDA device: compute capability 9.0 or newer."""
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device)[0] >= 9


GROUP_ROWS = 16
"""Each expert's rows start on a multiple of 16 (bf16: 32 bytes), the alignment the grouped kernels ask of the
group offsets, also for the weight gradients where the groups split the contracted dimension."""


def grouped_experts(
    flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The sparse block's expert sum for tokens flat [N, hidden] routed to chosen [N, k] with gate weights [N, k],
    as two grouped GEMMs over all experts (gate_up [E, hidden, 2I], down [E, I, hidden]): the token x slot rows
    sorted by expert, each expert's group zero-padded to GROUP_ROWS, no host sync. Equal to the per-expert path up
    to the GEMMs' rounding (bf16 tolerance, not bitwise: the batch-invariant forward keeps its own path)."""
    n, k = chosen.shape
    e = gate_up.shape[0]
    idx = chosen.reshape(-1)
    order = torch.argsort(idx, stable=True)
    sorted_e = idx[order]
    counts = torch.bincount(idx, minlength=e)
    padded = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    pos = (ends - padded)[sorted_e] + torch.arange(n * k, device=flat.device) - starts[sorted_e]
    token = order // k
    rows = n * k + e * (GROUP_ROWS - 1)  # a bound on the padded total that needs no sync
    x = flat.new_zeros(rows, flat.shape[1]).index_copy(0, pos, flat[token])
    offs = ends.to(torch.int32)
    h = torch._grouped_mm(x, gate_up, offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, down, offs=offs)[pos]
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros_like(flat).index_add(0, token, y.to(flat.dtype))


def aux_loss(routing: Routing, moe: MoeArgs, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer load-balancing loss over all sparse layers of the latest forward, as transformers'
    `load_balancing_loss_func` (the top-k of the router's own softmax, real tokens only): num_experts * sum_e
    (share of routed slots on e) * (mean router probability of e). Not multiplied by router_aux_loss_coef."""
    if not routing.logits:
        raise ValueError("aux_loss needs a forward with routing.record_logits on")
    e, k = moe.num_experts, moe.top_k
    device = routing.logits[0].device
    counts = torch.zeros(e, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(e, dtype=torch.float32, device=device)
    mask = None if token_mask is None else token_mask.reshape(-1).to(device=device, dtype=torch.float32)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in routing.logits:
        probs = torch.softmax(logits.float(), dim=-1)
        selected = torch.topk(probs, k, dim=-1).indices.reshape(-1)
        w = torch.ones(probs.shape[0], device=device) if mask is None else mask
        counts = counts + torch.zeros(e, device=device).scatter_add_(0, selected, w.repeat_interleave(k))
        prob_sum = prob_sum + (probs * w[:, None]).sum(dim=0)
        rows = rows + w.sum()
    return (counts / rows * (prob_sum / rows)).sum() * e


def route_stats(routing: Routing, moe: MoeArgs, token_mask: torch.Tensor | None = None) -> dict[str, float]:
    """`moe/route_agreement`: of the token x layer top-k sets given to the forward (`Routing.replay`), the share
    where the model's own router picked the same set (before replay; NaN when none was given); `moe/expert_load_cv`: the
    coefficient of variation of the tokens each expert received, averaged over sparse layers."""
    mask = None if token_mask is None else token_mask.reshape(-1).bool()
    agree = total = 0
    cvs = []
    for i, (own, chosen) in enumerate(zip(routing.own, routing.chosen, strict=True)):
        rows = torch.ones(own.shape[0], dtype=torch.bool, device=own.device) if mask is None else mask.to(own.device)
        load = torch.bincount(chosen[rows].reshape(-1), minlength=moe.num_experts).float()
        cvs.append(float(load.std(unbiased=False) / load.mean().clamp_min(1e-9)))
        if i < len(routing.replayed):
            counted = rows & routing.replayed[i]
            same = (own.sort(dim=-1).values == routing.given[i].sort(dim=-1).values).all(dim=-1)
            agree += int((same & counted).sum())
            total += int(counted.sum())
    out = {"moe/expert_load_cv": sum(cvs) / max(len(cvs), 1)}
    out["moe/route_agreement"] = agree / total if total else float("nan")
    return out


def routes_of(routing: Routing, moe: MoeArgs, b: int, t: int) -> torch.Tensor:
    """The experts each token of the latest forward [B, T] used, per decoder layer: [B, T, layers, k] int32, -1 on
    dense layers (the layout `meta_info.routed_experts` carries, one row per token)."""
    layers = len(moe.sparse_layers)
    device = routing.chosen[0].device if routing.chosen else torch.device("cpu")
    out = torch.full((b, t, layers, moe.top_k), -1, dtype=torch.int32, device=device)
    it: Iterator[torch.Tensor] = iter(routing.chosen)
    for layer, sparse in enumerate(moe.sparse_layers):
        if sparse:
            out[:, :, layer] = next(it).reshape(b, t, moe.top_k).to(torch.int32)
    return out


def encode_routes(routes: np.ndarray) -> str:
    """[tokens, layers, k] expert ids as base64 of their int32 bytes (SGLang's `routed_experts` encoding)."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype=ROUTE_DTYPE).tobytes()).decode("ascii")


def decode_routes(text: str, num_layers: int, top_k: int) -> np.ndarray:
    """The [tokens, layers, k] int32 array that `encode_routes` (or SGLang) wrote; a length that is not a whole
    number of tokens x layers x k is an error naming both shapes."""
    flat = np.frombuffer(base64.b64decode(text), dtype=ROUTE_DTYPE)
    per_token = num_layers * top_k
    if flat.size % per_token:
        raise ValueError(
            f"routed_experts holds {flat.size} ids, not a whole number of tokens x {num_layers} layers x "
            f"{top_k} experts per token: the routes come from a model of another shape"
        )
    return flat.reshape(-1, num_layers, top_k)


def split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with transformers 5's fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]) as one module per expert (the checkpoint layout hpcrl keeps)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def replayed_routes_shape(model_dir: Any, routing_replay: str) -> tuple[int, int] | None:
    """(decoder layers, top-k) of the routes a run asks its engines for: a mixture-of-experts model under
    `train.routing_replay: rollout` or `observe`; None for a dense model or replay off."""
    from hpcrl.model.qwen3 import ModelArgs

    args = ModelArgs.from_dir(model_dir).moe
    if args is None or routing_replay == "off":
        return None
    return len(args.sparse_layers), args.top_k
