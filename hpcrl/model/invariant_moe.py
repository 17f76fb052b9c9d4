"""The batch-invariant forward of a Qwen3-MoE sparse block (see invariant.py for the guarantee and how it is kept).

A token's experts and output come out of the same operations whatever its batch, so with the invariant forward on
both sides the engine's routes and log-probs are the trainer's, bit for bit, with or without routing replay:
- the router and every expert GEMM are `invariant.linear` (fixed [CHUNK_ROWS, K] x [K, N] products; an expert's
  tokens are gathered and zero-padded to whole chunks, and a row's result does not depend on its place in a chunk);
- the softmax is exp(logit - row max) over a `tree_sum`; the top-k is a stable descending sort (ties go to the lower
  expert id), which only compares values; norm_topk_prob divides by a `tree_sum` of the k weights;
- a token's output sums its experts' weighted outputs in ascending expert order, as the plain block does.
The experts run one after another over the tokens routed to them (host syncs: no CUDA graph for an MoE step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hpcrl.model.invariant import linear, pad_rows, swiglu, tree_sum
from hpcrl.model.moe import SparseMoeBlock
from hpcrl.model.qwen3 import ModelArgs


def unsupported(args: ModelArgs) -> str | None:
    """None when the invariant forward covers this model's experts, else why not (odd widths would leave ATen's
    vectorised exp and silu a scalar tail whose place depends on the row count, as for the dense widths)."""
    moe = args.moe
    if moe is None:
        return None
    odd = [
        f"{k}={v}"
        for k, v in (("num_experts", moe.num_experts), ("moe_intermediate_size", moe.moe_intermediate_size))
        if v % 2
    ]
    if odd:
        return f"the batch-invariant forward needs even expert widths, this model has {', '.join(odd)}"
    return None


def sparse_block(block: SparseMoeBlock, h: Tensor, rows: int) -> Tensor:
    """The block's output for normed token rows h [Mpad, hidden] (the first `rows` real; the rest zero rows that
    route nowhere and get zeros). `Routing.replay` [B, T, layers, k] with B * T == rows forces experts, as in the
    plain block."""
    k = block.moe.top_k
    logits = linear(h, block.gate.weight)[:rows]
    scores = logits.float()
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    probs = e / tree_sum(e)[:, None]
    own = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    replay = block.routing.replay
    b, t = (rows, 1) if replay is None else (replay.shape[0], replay.shape[1])
    if b * t != rows:
        raise ValueError(f"routes for {b} x {t} tokens do not fit this forward of {rows} tokens")
    chosen, weights = block.route(logits, probs, own, probs.gather(1, own), b, t, row_sum=tree_sum)
    out = torch.zeros_like(h)
    hit = torch.bincount(chosen.reshape(-1), minlength=block.moe.num_experts)
    for expert in torch.nonzero(hit).flatten().tolist():
        token, slot = torch.where(chosen == expert)
        ex = block.experts[expert]
        x = pad_rows(h[token])
        y = linear(swiglu(linear(x, ex.gate_proj.weight), linear(x, ex.up_proj.weight)), ex.down_proj.weight)
        out = out.index_add(0, token, (y[: token.numel()] * weights[token, slot, None]).to(out.dtype))
    return out
