"""On-policy distillation's advantage: the per-token reverse KL between the student that sampled and the teacher.

The student sampled token x_t from its policy p (the rollout's log-prob log p(x_t) is recorded); the teacher q scored
the same token. `log p(x_t) - log q(x_t)` is a one-sample estimate of KL(p || q) at that position (its expectation
over x_t ~ p is the full-vocabulary reverse KL). As an advantage, `-(log p - log q)` pushes up the tokens the teacher
likes more than the student does and down the others: the policy gradient of that advantage is the gradient of the
reverse KL (with the estimate held constant), which is what on-policy distillation minimises.

With `distill.top_k = K` the teacher also returns its K most likely ids at each response position, and the loss adds
a sparse forward KL, `coef * sum_{v in top-K} p_T(v) (log p_T(v) - log p_S(v))` per model token (token mean over the
update). The teacher's mass outside its top K is dropped, not renormalised: each term is exactly that token's share
of the full forward KL KL(p_T || p_S), so the gradient, `-coef * sum_{v in top-K} p_T(v) grad log p_S(v)`, is the
full forward KL's gradient restricted to the teacher's K most likely tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import torch
from torch import Tensor

from hpcrl.trainer.batch import TrainBatch

__all__ = ["distill_advantages", "reverse_kl_expectation", "sparse_forward_kl", "with_teacher_topk"]


def distill_advantages(
    batch: TrainBatch,
    teacher_logprobs: Sequence[Sequence[float]],
    *,
    mode: Literal["reverse_kl", "mixed"],
    coef: float,
) -> tuple[TrainBatch, dict[str, float]]:
    """`batch` with per-token advantages `[N, T-1]`: `-coef * (student - teacher)` on each model token, plus the
    sample's group advantage under `mixed`; 0 off the loss mask (prompts, tool results, padding).

    `teacher_logprobs[i]` holds the teacher's log-prob of each response token of row i (entries under a loss mask of
    0 are ignored). The student's are the batch's rollout log-probs: those of the policy that sampled.
    Stats (means over the model tokens): `reverse_kl` (of `student - teacher`), `teacher_logprob_mean`,
    `student_logprob_mean`.
    """
    if mode not in ("reverse_kl", "mixed"):
        raise ValueError(f"mode must be 'reverse_kl' or 'mixed', got {mode!r}")
    if batch.advantages.dim() != 1:
        raise ValueError("distill_advantages takes a batch of per-sample advantages (batch_from_groups')")
    n = len(batch)
    if len(teacher_logprobs) != n:
        raise ValueError(f"{n} sequences but teacher log-probs for {len(teacher_logprobs)}")
    teacher = torch.zeros_like(batch.rollout_logprobs)
    for i, lps in enumerate(teacher_logprobs):
        start, end = int(batch.prompt_lens[i]) - 1, int(batch.lengths[i]) - 1
        if len(lps) != end - start:
            raise ValueError(f"sequence {i}: {len(lps)} teacher log-probs for {end - start} response tokens")
        teacher[i, start:end] = torch.tensor(list(lps), dtype=teacher.dtype)
    mask = batch.loss_mask
    zero = torch.zeros((), dtype=teacher.dtype)
    # where, not multiply: a teacher log-prob of -inf off the mask must not become NaN.
    student = torch.where(mask, batch.rollout_logprobs, zero)
    teacher = torch.where(mask, teacher, zero)
    log_ratio = student - teacher
    base = batch.advantages[:, None] if mode == "mixed" else zero
    advantages = torch.where(mask, base - coef * log_ratio, zero)
    tokens = mask.sum().clamp_min(1)
    values = torch.stack([log_ratio.sum(), teacher.sum(), student.sum()]).double() / tokens
    stats = dict(zip(["reverse_kl", "teacher_logprob_mean", "student_logprob_mean"], values.tolist(), strict=True))
    return replace(batch, advantages=advantages), stats


def reverse_kl_expectation(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """The full-vocabulary reverse KL `sum_v p(v) (log p(v) - log q(v))` per position ([..., V] logits -> [...]):
    what the sampled-token estimate of `distill_advantages` averages to over the student's samples."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # float64 stays float64 (a reference test)
    log_p = torch.log_softmax(student_logits.to(dtype), dim=-1)
    log_q = torch.log_softmax(teacher_logits.to(dtype), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def with_teacher_topk(
    batch: TrainBatch,
    top: Sequence[Sequence[Sequence[tuple[float, int]]]],
    *,
    coef: float,
) -> TrainBatch:
    """`batch` carrying the teacher's top-k for the sparse forward KL: `top[i][j]` holds the (log-prob, id) pairs of
    response token j of row i. The weights `coef * p_T(v)` are 0 off the loss mask (prompts, tool results,
    padding) and on the slots of a position with fewer than K pairs."""
    n = len(batch)
    if len(top) != n:
        raise ValueError(f"{n} sequences but teacher top-k log-probs for {len(top)}")
    k = max((len(pairs) for rows in top for pairs in rows), default=1)
    shape = (*batch.rollout_logprobs.shape, k)
    ids = torch.zeros(shape, dtype=torch.long)
    lps = torch.zeros(shape, dtype=torch.float32)
    valid = torch.zeros(shape, dtype=torch.bool)
    for i, rows in enumerate(top):
        start, end = int(batch.prompt_lens[i]) - 1, int(batch.lengths[i]) - 1
        if len(rows) != end - start:
            raise ValueError(f"sequence {i}: teacher top-k for {len(rows)} positions, {end - start} response tokens")
        for j, pairs in enumerate(rows):
            if pairs:
                lps[i, start + j, : len(pairs)] = torch.tensor([lp for lp, _ in pairs], dtype=torch.float32)
                ids[i, start + j, : len(pairs)] = torch.tensor([t for _, t in pairs], dtype=torch.long)
                valid[i, start + j, : len(pairs)] = True
    valid &= batch.loss_mask[..., None]
    weights = torch.where(valid, coef * lps.exp(), torch.zeros((), dtype=lps.dtype))
    return replace(batch, teacher_topk_ids=ids, teacher_topk_logprobs=lps, teacher_topk_weights=weights)


def sparse_forward_kl(student_topk_logprobs: Tensor, teacher_topk_logprobs: Tensor, weights: Tensor) -> Tensor:
    """Per-position `sum_k w_k (log p_T(v_k) - log p_S(v_k))` ([b, T, K] -> [b, T]), `w = coef * p_T` (0 where a slot
    is off the loss): the sparse forward KL of `with_teacher_topk`'s batch. Its gradient reaches the student through
    `student_topk_logprobs` alone; the teacher's are data."""
    zero = torch.zeros((), dtype=student_topk_logprobs.dtype, device=student_topk_logprobs.device)
    diff = teacher_topk_logprobs.to(student_topk_logprobs.dtype) - student_topk_logprobs
    # where, not multiply: a slot off the loss (weight 0) may hold a student log-prob of -inf.
    return torch.where(weights > 0, weights.to(diff.dtype) * diff, zero).sum(dim=-1)
