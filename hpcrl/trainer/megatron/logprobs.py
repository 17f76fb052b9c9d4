"""Token log-probs and entropy from vocab-parallel logits: each TP rank holds logits for a slice of the vocabulary.

The same chunked scheme as `hpcrl.trainer.logprobs.token_logprobs` (never a full fp32 copy of [B*T, V/tp],
backward recomputes the softmax block by block), with the row statistics completed across TP: one
all-reduce of the max, one of (sum of exp, target logit, sum of exp x logit). The backward needs no
communication: a rank's logits get `onehot - p` (and the entropy term) from the global log-sum-exp.

`vocab_parallel_hidden_logprobs` is the fused head (train.logprob_chunk_tokens): the same statistics straight
from the final hidden states and this rank's LM-head shard, chunk by chunk, so not even [B*T, V/tp] logits exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hpcrl.trainer.logprobs import _finite_or_zero, _row_blocks, check_head_args, hidden_token_logprobs


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
    """`hpcrl.trainer.logprobs.support_token_logprobs` (temperature 1) from this rank's logits [B, T, V/tp].

    `support_ids` / `support_valid` [B, T, K] are the whole support (every rank gets the same); each rank
    scores the ids of its own slice. A position without a support gets log-prob 0 and entropy 0."""
    if support_ids.shape[:2] != targets.shape or support_valid.shape != support_ids.shape:
        raise ValueError(f"support_ids / support_valid must be [B, T, K] with [B, T] = {tuple(targets.shape)}")
    lp, ent = _VocabParallelSupportLogprobs.apply(
        logits, targets.long(), support_ids.long(), support_valid, vocab_start, group
    )
    return lp, ent


def vocab_parallel_hidden_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, vocab_start: int, vocab_size: int, group: Any,
    chunk_tokens: int, compiled: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Log-probs of `targets` [N] and entropy [N] (fp32) under softmax over the whole vocabulary of
    `hidden` [N, h] @ W.T, W split by rows over the TP `group`: this rank holds `weight` = W[vocab_start :
    vocab_start + V/tp] (rows >= `vocab_size` are padding and never enter the softmax).

    The fused head of `hpcrl.trainer.logprobs.hidden_token_logprobs`, vocab-parallel: per chunk of `chunk_tokens`
    rows, one GEMM gives this rank's [chunk, V/tp] logits, which are reduced at once to row statistics (max,
    sum of exp, sum of exp x logit, target logit); one all-reduce of the max and one of the rescaled sums
    complete them over TP. Backward recomputes each chunk's logits and sums `hidden`'s gradient over TP (the
    all-reduce Megatron's column-parallel output layer does in its backward). One TP rank: exactly
    `hidden_token_logprobs`. `compiled` runs the per-chunk elementwise work through torch.compile.
    Differentiable w.r.t. `hidden` and `weight` (first order)."""
    check_head_args(hidden, weight, targets, chunk_tokens, rows="V/tp")
    targets = targets.long()
    if dist.get_world_size(group) == 1:
        if weight.shape[0] != vocab_size:
            raise ValueError(f"one TP rank holds the whole vocabulary ({vocab_size}), got {weight.shape[0]} rows")
        lp, ent = hidden_token_logprobs(
            hidden, weight, targets, chunk_tokens=chunk_tokens, with_entropy=True, compiled=compiled
        )
        assert ent is not None
        return lp, ent
    valid = min(max(vocab_size - vocab_start, 0), weight.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        lp, ent = _VocabParallelHeadLogprobs.apply(hidden, weight, targets, vocab_start, valid, group,
                                                   chunk_tokens, compiled)  # fmt: skip
        return lp, ent
    with torch.no_grad():
        lp, _, ent = _head_forward(hidden, weight, targets, vocab_start, valid, group, chunk_tokens, compiled)
    return lp, ent


def _head_local_stats(z: Tensor, local: Tensor, inside: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk's row statistics over this rank's vocabulary slice, from its logits `z` [c, valid], in fp32:
    max m, sum of exp(z - m), sum of exp(z - m) x (z - m), and the target's logit (0 where another rank has it)."""
    x = z.to(torch.float32)
    top = x.amax(dim=-1)
    x = x - top[:, None]
    e = x.exp()
    picked = x.gather(1, local[:, None]).squeeze(1) + top
    return top, e.sum(dim=-1), (e * x).sum(dim=-1), torch.where(inside, picked, torch.zeros_like(picked))


def _head_chunk_grad(
    z: Tensor, lse: Tensor, local: Tensor, inside: Tensor, grad_lp: Tensor | None, ent: Tensor,
    grad_ent: Tensor | None,
) -> Tensor:  # fmt: skip
    """The gradient w.r.t. one chunk's logits `z` [c, valid] of this rank's slice, in z's dtype."""
    logp = z.to(torch.float32) - lse[:, None]
    p = logp.exp()
    g = torch.zeros_like(p)
    if grad_lp is not None:
        # d log p_t / d z = onehot(t) - p; the onehot lands on the rank that holds t.
        g = g - p * grad_lp[:, None]
        hit = torch.where(inside, grad_lp, torch.zeros_like(grad_lp))
        g = g.scatter_add(1, local[:, None], hit[:, None])
    if grad_ent is not None:
        # d H / d z = -p * (log p + H)
        g = g - p * (logp + ent[:, None]) * grad_ent[:, None]
    return g.to(z.dtype)


_compiled_head_fns: dict[str, Callable[..., Any]] = {}


def _head_fn(name: str, compiled: bool) -> Callable[..., Any]:
    fns: dict[str, Callable[..., Any]] = {"stats": _head_local_stats, "grad": _head_chunk_grad}
    if not compiled:
        return fns[name]
    if name not in _compiled_head_fns:  # compiled once per process, on first use
        _compiled_head_fns[name] = torch.compile(fns[name])
    return _compiled_head_fns[name]


def _local_targets(targets: Tensor, vocab_start: int, valid: int) -> tuple[Tensor, Tensor]:
    local = targets - vocab_start
    inside = (local >= 0) & (local < valid)
    return local.clamp(0, max(valid - 1, 0)), inside


def _head_forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, vocab_start: int, valid: int, group: Any, chunk: int,
    compiled: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(log-probs, log-sum-exp, entropy) [N] in fp32."""
    n = hidden.shape[0]
    # Per row: this rank's max, then (sum of exp, sum of exp x logit, target logit) relative to it.
    top = torch.full((n,), -math.inf, dtype=torch.float32, device=hidden.device)
    sums = torch.zeros(3, n, dtype=torch.float32, device=hidden.device)
    local, inside = _local_targets(targets, vocab_start, valid)
    stats = _head_fn("stats", compiled)
    w = weight[:valid]  # the padding rows' logits never exist, so they need no -inf mask
    if valid > 0:
        for r0 in range(0, n, chunk):
            r1 = min(r0 + chunk, n)
            top[r0:r1], sums[0, r0:r1], sums[1, r0:r1], sums[2, r0:r1] = stats(
                hidden[r0:r1] @ w.t(), local[r0:r1], inside[r0:r1]
            )
    # Rescale each rank's sums to the global max M: sum e^(z-M) = a s, sum e^(z-M)(z-M) = a (u + s (m - M)),
    # a = e^(m-M). A rank without real columns (m = -inf) has s = u = 0 and contributes nothing.
    global_top = top.clone()
    dist.all_reduce(global_top, op=dist.ReduceOp.MAX, group=group)
    a = (top - global_top).exp()
    shift = torch.where(a > 0, top - global_top, torch.zeros_like(top))
    sums[1] = a * (sums[1] + sums[0] * shift)
    sums[0] = a * sums[0]
    dist.all_reduce(sums, group=group)
    lse = global_top + sums[0].log()
    return sums[2] - lse, lse, sums[0].log() - sums[1] / sums[0]


class _VocabParallelHeadLogprobs(torch.autograd.Function):
    """`vocab_parallel_hidden_logprobs` with grad: saves hidden, weight and the [N] statistics, never [N, V/tp]."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, vocab_start: int, valid: int, group: Any,
        chunk: int, compiled: bool,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        lp, lse, ent = _head_forward(hidden, weight, targets, vocab_start, valid, group, chunk, compiled)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.setup = (vocab_start, valid, group, chunk, compiled)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_lp: Tensor | None, grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        vocab_start, valid, group, chunk, compiled = ctx.setup
        # Every TP rank runs this backward (the loss is replicated over TP), so each reaches the all-reduce.
        grad_h = torch.zeros_like(hidden)
        want_w = ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        if (grad_lp is not None or grad_ent is not None) and valid > 0:
            local, inside = _local_targets(targets, vocab_start, valid)
            chunk_grad = _head_fn("grad", compiled)
            w = weight[:valid]
            for r0 in range(0, hidden.shape[0], chunk):
                r1 = min(r0 + chunk, hidden.shape[0])
                h = hidden[r0:r1]
                g = chunk_grad(
                    h @ w.t(), lse[r0:r1], local[r0:r1], inside[r0:r1],
                    None if grad_lp is None else grad_lp[r0:r1], ent[r0:r1],
                    None if grad_ent is None else grad_ent[r0:r1],
                )  # fmt: skip
                grad_h[r0:r1] = g @ w
                if grad_w is not None:
                    grad_w[:valid] += (g.t() @ h).to(torch.float32)
        # Each rank's hidden gradient covers its vocabulary slice only; the whole vocabulary's is their sum.
        dist.all_reduce(grad_h, group=group)
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None, None, None
