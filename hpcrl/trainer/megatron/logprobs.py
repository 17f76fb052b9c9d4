"""Token log-probs and entropy from vocab-parallel logits: each TP rank holds logits for a slice of the vocabulary.

The same chunked scheme as `hpcrl.trainer.loss.token_logprobs` (never a full fp32 copy of [B*T, V/tp],
backward recomputes the softmax block by block), with the row statistics completed across TP: one
all-reduce of the max, one of (sum of exp, target logit, sum of exp x logit). The backward needs no
communication: a rank's logits get `onehot - p` (and the entropy term) from the global log-sum-exp.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hpcrl.trainer.loss import _finite_or_zero, _row_blocks


def _block(rows: Tensor, vocab_start: int, vocab_size: int) -> Tensor:
    """fp32 copy of one block of logits, with the vocab padding columns at -inf."""
    x = rows.to(torch.float32, copy=True)
    pad_from = vocab_size - vocab_start
    if pad_from < x.shape[-1]:
        x[:, max(pad_from, 0) :] = -math.inf
    return x


def _forward(
    logits: Tensor, targets: Tensor, vocab_start: int, vocab_size: int, group: Any, chunk_rows: int
) -> tuple[Tensor, Tensor, Tensor]:
    n, width = targets.shape[0], logits.shape[-1]
    blocks = _row_blocks(logits, chunk_rows)
    top = torch.empty(n, dtype=torch.float32, device=logits.device)
    for r0, r1, rows in blocks:
        top[r0:r1] = _block(rows, vocab_start, vocab_size).max(dim=-1).values
    if dist.get_world_size(group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    # Rows: sum of exp(x - top), the target's logit (0 on ranks without it), sum of exp(x - top) * (x - top).
    stats = torch.zeros(3, n, dtype=torch.float32, device=logits.device)
    local = targets - vocab_start
    inside = (local >= 0) & (local < width)
    for r0, r1, rows in blocks:
        x = _block(rows, vocab_start, vocab_size).sub_(top[r0:r1, None])
        e = x.exp()
        stats[0, r0:r1] = e.sum(dim=-1)
        picked = x.gather(1, local[r0:r1].clamp(0, width - 1)[:, None]).squeeze(1) + top[r0:r1]
        stats[1, r0:r1] = torch.where(inside[r0:r1], picked, torch.zeros_like(picked))
        stats[2, r0:r1] = (e * _finite_or_zero(x)).sum(dim=-1)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    lse = top + stats[0].log()
    entropy = stats[0].log() - stats[2] / stats[0]
    return stats[1] - lse, lse, entropy


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, vocab_start: int, vocab_size: int, group: Any, chunk_rows: int
    ) -> tuple[Tensor, Tensor]:
        lp, lse, ent = _forward(logits, targets, vocab_start, vocab_size, group, chunk_rows)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.vocab = (vocab_start, vocab_size)
        ctx.chunk_rows = chunk_rows
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_lp: Tensor | None, grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, targets, lse, ent = ctx.saved_tensors
        vocab_start, vocab_size = ctx.vocab
        width = logits.shape[-1]
        local = targets - vocab_start
        inside = (local >= 0) & (local < width)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_rows = grad_logits.view(-1, width)
        for r0, r1, rows in _row_blocks(logits, ctx.chunk_rows):
            logp = _block(rows, vocab_start, vocab_size).sub_(lse[r0:r1, None])
            p = logp.exp()
            g = torch.zeros_like(p)
            if grad_lp is not None:
                # d log p_t / d x = onehot(t) - p; the onehot lands on the rank that holds t.
                g_lp = grad_lp[r0:r1, None]
                g.addcmul_(p, g_lp, value=-1.0)
                hit = torch.where(inside[r0:r1, None], g_lp, torch.zeros_like(g_lp))
                g.scatter_add_(1, local[r0:r1].clamp(0, width - 1)[:, None], hit)
            if grad_ent is not None:
                # d H / d x = -p * (log p + H)
                g.addcmul_(p * (_finite_or_zero(logp) + ent[r0:r1, None]), grad_ent[r0:r1, None], value=-1.0)
            grad_rows[r0:r1] = g
        return grad_logits, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: Tensor, targets: Tensor, *, vocab_start: int, vocab_size: int, group: Any, chunk_rows: int = 1024
) -> tuple[Tensor, Tensor]:
    """Log-probs of `targets` [B, T] and entropy [B, T] (fp32) from this rank's logits [B, T, V/tp].

    `vocab_start` is the first token id of this rank's slice; ids >= `vocab_size` are padding and never
    enter the softmax. Differentiable w.r.t. `logits` (first order)."""
    b, t, _ = logits.shape
    flat = targets.reshape(-1).long()
    if logits.requires_grad and torch.is_grad_enabled():
        lp, ent = _VocabParallelLogprobs.apply(logits, flat, vocab_start, vocab_size, group, chunk_rows)
    else:
        lp, _, ent = _forward(logits.detach(), flat, vocab_start, vocab_size, group, chunk_rows)
    return lp.view(b, t), ent.view(b, t)


class _VocabParallelSupportLogprobs(torch.autograd.Function):
    """Log-probs and entropy over each position's sampling support, the support's ids spread over TP ranks.

    Forward: every rank gathers the logits of the support ids in its slice (at most K per position), then
    one all-reduce of the max and one of (sum of exp, target logit, sum of exp x logit) complete the row, as
    in `_forward`. Backward needs no communication: the support's softmax q is known on every rank, and a
    rank's logits get `onehot - q` (and the entropy term) at the ids it holds, 0 elsewhere.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, ids: Tensor, valid: Tensor, vocab_start: int, group: Any
    ) -> tuple[Tensor, Tensor]:
        width = logits.shape[-1]
        local = ids - vocab_start
        inside = valid & (local >= 0) & (local < width)
        local = local.clamp(0, width - 1)
        z = logits.gather(-1, local).to(torch.float32).masked_fill(~inside, -math.inf)  # [B, T, K]
        has = valid.any(dim=-1)
        top = z.max(dim=-1).values
        if dist.get_world_size(group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        top = torch.where(has, top, torch.zeros_like(top))  # a position without support: nothing to normalise
        x = z - top[..., None]
        e = x.exp()
        t_local = targets - vocab_start
        t_inside = (t_local >= 0) & (t_local < width)
        t_local = t_local.clamp(0, width - 1)
        picked = logits.gather(-1, t_local[..., None]).squeeze(-1).to(torch.float32)
        stats = torch.stack(
            [e.sum(dim=-1), torch.where(t_inside, picked, torch.zeros_like(picked)), (e * _finite_or_zero(x)).sum(-1)]
        )
        if dist.get_world_size(group) > 1:
            dist.all_reduce(stats, group=group)
        total = torch.where(has, stats[0], torch.ones_like(stats[0]))
        lse = top + total.log()
        lp = torch.where(has, stats[1] - lse, torch.zeros_like(lse))
        entropy = torch.where(has, total.log() - stats[2] / total, torch.zeros_like(lse))
        ctx.save_for_backward(z, lse, entropy, local, inside, t_local, t_inside & has)
        ctx.logits_meta = (logits.shape, logits.dtype, logits.device)
        ctx.set_materialize_grads(False)
        return lp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_lp: Tensor | None, grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        z, lse, entropy, local, inside, t_local, t_hit = ctx.saved_tensors
        shape, dtype, device = ctx.logits_meta
        logq = z - lse[..., None]
        q = logq.exp()  # 0 at ids this rank does not hold (and at padding slots)
        g = torch.zeros_like(q)
        if grad_lp is not None:
            g.addcmul_(q, grad_lp[..., None], value=-1.0)
        if grad_ent is not None:
            # d H / d z = -q * (log q + H)
            g.addcmul_(q * (_finite_or_zero(logq) + entropy[..., None]), grad_ent[..., None], value=-1.0)
        g = torch.where(inside, g, torch.zeros_like(g))
        grad_logits = torch.zeros(shape, dtype=torch.float32, device=device)
        grad_logits.scatter_add_(-1, local, g)
        if grad_lp is not None:
            hit = torch.where(t_hit, grad_lp, torch.zeros_like(grad_lp))
            grad_logits.scatter_add_(-1, t_local[..., None], hit[..., None])
        return grad_logits.to(dtype), None, None, None, None, None


def vocab_parallel_support_logprobs(
    logits: Tensor, targets: Tensor, support_ids: Tensor, support_valid: Tensor, *, vocab_start: int, group: Any
) -> tuple[Tensor, Tensor]:
    """`hpcrl.trainer.loss.support_token_logprobs` (temperature 1) from this rank's logits [B, T, V/tp].

    `support_ids` / `support_valid` [B, T, K] are the whole support (every rank gets the same); each rank
    scores the ids of its own slice. A position without a support gets log-prob 0 and entropy 0."""
    if support_ids.shape[:2] != targets.shape or support_valid.shape != support_ids.shape:
        raise ValueError(f"support_ids / support_valid must be [B, T, K] with [B, T] = {tuple(targets.shape)}")
    lp, ent = _VocabParallelSupportLogprobs.apply(
        logits, targets.long(), support_ids.long(), support_valid, vocab_start, group
    )
    return lp, ent
