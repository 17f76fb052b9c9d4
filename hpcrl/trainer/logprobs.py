"""Token log-probs for the trainer: from logits, from hidden states through a fused chunked LM head, and under a
recorded sampling support.

Shapes: ``B`` sequences, ``T`` positions, ``V`` vocabulary, ``N`` flattened positions, ``H`` hidden size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "check_head_args",
    "hidden_token_logprobs",
    "support_mask_from_ids",
    "support_token_logprobs",
    "token_logprobs",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 for bf16/fp16/fp32 logits; float64 stays float64 so gradcheck-style tests can run exactly.
    return torch.promote_types(dtype, torch.float32)


def _row_blocks(logits: Tensor, chunk_rows: int) -> list[tuple[int, int, Tensor]]:
    """``(first_row, last_row, [rows, V] view)`` blocks covering ``logits`` [B, T, V] in flat row order.

    Views only: ``logits[:, :-1]`` (the usual next-token shift) cannot be flattened without a full copy,
    so such tensors are walked one sequence at a time instead.
    """
    b, t, v = logits.shape
    try:
        segments = [(0, logits.view(b * t, v))]
    except RuntimeError:
        segments = [(i * t, logits[i]) for i in range(b)]
    blocks = []
    for offset, seg in segments:
        for start in range(0, seg.shape[0], chunk_rows):
            stop = min(start + chunk_rows, seg.shape[0])
            blocks.append((offset + start, offset + stop, seg[start:stop]))
    return blocks


def _block_logits(rows: Tensor, support: Tensor | None, temperature: float) -> Tensor:
    """Scaled logits of one block in the compute dtype, with ids outside the support at -inf."""
    # Always a fresh tensor: callers edit it in place, and .to() of fp32 logits would alias them.
    if temperature != 1.0:
        x = rows.to(_compute_dtype(rows.dtype)) / temperature
    else:
        x = rows.to(_compute_dtype(rows.dtype), copy=True)
    if support is not None:
        # A row without any recorded support (prompt, padding) is left unrestricted instead of becoming
        # an all -inf row whose NaNs would reach the gradient through masked-out positions.
        allowed = support | ~support.any(dim=-1, keepdim=True)
        x.masked_fill_(~allowed, -math.inf)
    return x


def _finite_or_zero(logp: Tensor) -> Tensor:
    # p * log p is 0 * -inf = NaN outside the support; its limit is 0.
    return logp.masked_fill(logp == -math.inf, 0.0)


def _logprobs_forward(
    logits: Tensor,
    targets: Tensor,
    support: Tensor | None,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Chunked forward: ``logits`` [B, T, V], ``targets`` [N], ``support`` [N, V] | None, N = B*T.

    Returns (logprobs [N], logsumexp [N], entropy [N] | None).
    """
    n = targets.shape[0]
    cdt = _compute_dtype(logits.dtype)
    lp = torch.empty(n, dtype=cdt, device=logits.device)
    lse = torch.empty(n, dtype=cdt, device=logits.device)
    ent = torch.empty(n, dtype=cdt, device=logits.device) if with_entropy else None
    for r0, r1, rows in _row_blocks(logits, chunk_rows):
        x = _block_logits(rows, None if support is None else support[r0:r1], temperature)
        block_lse = torch.logsumexp(x, dim=-1)
        lse[r0:r1] = block_lse
        lp[r0:r1] = x.gather(1, targets[r0:r1, None]).squeeze(1) - block_lse
        if ent is not None:
            logp = x.sub_(block_lse[:, None])
            ent[r0:r1] = -(logp.exp() * _finite_or_zero(logp)).sum(dim=-1)
    return lp, lse, ent


class _ChunkedLogprobs(torch.autograd.Function):
    """Log-probs (and entropy) whose backward recomputes softmax chunk by chunk.

    Plain autograd would keep every chunk's fp32 softmax alive until backward, i.e. a full fp32 copy
    of ``[B*T, V]`` (the largest activation in LM training); here only the ``[N]`` log-sum-exp and
    entropy are saved and the gradient is written straight into one tensor of the logits' dtype.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        support: Tensor | None,
        temperature: float,
        with_entropy: bool,
        chunk_rows: int,
    ) -> tuple[Tensor, Tensor]:
        lp, lse, ent = _logprobs_forward(logits, targets, support, temperature, with_entropy, chunk_rows)
        ctx.save_for_backward(logits, targets, support, lse, ent)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        ctx.set_materialize_grads(False)
        if ent is None:
            # autograd.Function outputs must be tensors; an empty one stands for "no entropy".
            ent = lp.new_empty(0)
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_lp: Tensor | None, grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, targets, support, lse, ent = ctx.saved_tensors
        if ent is None:
            grad_ent = None
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None, None
        temperature: float = ctx.temperature
        # Contiguous even when logits is a strided slice, so the flat row view below always exists.
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_rows = grad_logits.view(-1, logits.shape[-1])
        for r0, r1, rows in _row_blocks(logits, ctx.chunk_rows):
            logp = _block_logits(rows, None if support is None else support[r0:r1], temperature)
            logp.sub_(lse[r0:r1, None])
            p = logp.exp()
            g = torch.zeros_like(p)
            if grad_lp is not None:
                # d log p_t / d x = onehot(t) - p
                g_lp = grad_lp[r0:r1, None]
                g.addcmul_(p, g_lp, value=-1.0)
                g.scatter_add_(1, targets[r0:r1, None], g_lp)
            if grad_ent is not None:
                # d H / d x = -p * (log p + H)
                h = ent[r0:r1, None]
                g.addcmul_(p * (_finite_or_zero(logp) + h), grad_ent[r0:r1, None], value=-1.0)
            if temperature != 1.0:
                g.div_(temperature)
            grad_rows[r0:r1] = g
        return grad_logits, None, None, None, None, None


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    support_mask: Tensor | None = None,
    with_entropy: bool = False,
    chunk_rows: int = 1024,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` under ``softmax(logits / temperature)``, computed in float32.

    Never holds more than ``chunk_rows * V`` fp32 elements of scratch at a time, in forward and in
    backward (which recomputes the softmax instead of storing it); the input is not copied, even when
    it is a slice such as ``logits[:, :-1]``.

    Args:
        logits: ``[B, T, V]`` in any float dtype; ``logits[:, t]`` predicts ``targets[:, t]`` (the caller
            does the one-position shift).
        targets: ``[B, T]`` token ids in ``[0, V)``; padding positions still need a valid id.
        temperature: the sampling temperature, so the log-probs match what the engine sampled from.
        support_mask: optional ``[B, T, V]`` bool; True marks the ids the sampler could draw (top-k /
            top-p sampling-support replay). The distribution is renormalised over them, i.e. logits
            outside are -inf. A position whose row is all False (prompt, padding) is left unrestricted;
            a position whose non-empty support lacks its target is a data error and raises.
        with_entropy: also return the entropy of the (renormalised) distribution per position.
        chunk_rows: rows of ``B*T`` processed at a time.

    Returns:
        ``(logprobs [B, T], entropy [B, T] | None)`` in float32 (float64 for float64 logits). With grad
        enabled both are differentiable w.r.t. ``logits`` (first order only).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    b, t, v = logits.shape
    if targets.shape != (b, t):
        raise ValueError(f"targets must be [B, T] = {(b, t)}, got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    flat_targets = targets.reshape(-1).long()
    if flat_targets.numel() and (flat_targets.min() < 0 or flat_targets.max() >= v):
        raise ValueError(f"targets must lie in [0, {v}), got range [{flat_targets.min()}, {flat_targets.max()}]")
    flat_support: Tensor | None = None
    if support_mask is not None:
        if support_mask.shape != logits.shape or support_mask.dtype != torch.bool:
            raise ValueError(
                f"support_mask must be bool {tuple(logits.shape)}, got {support_mask.dtype} {tuple(support_mask.shape)}"
            )
        flat_support = support_mask.reshape(-1, v)
        has_support = flat_support.any(dim=-1)
        target_ok = flat_support.gather(1, flat_targets[:, None]).squeeze(1)
        if bool((has_support & ~target_ok).any()):
            raise ValueError("support_mask excludes the target token at a position with a non-empty support")

    if torch.is_grad_enabled() and logits.requires_grad:
        lp, ent_or_empty = _ChunkedLogprobs.apply(
            logits, flat_targets, flat_support, float(temperature), with_entropy, chunk_rows
        )
        ent = ent_or_empty if with_entropy else None
    else:
        lp, _, ent = _logprobs_forward(
            logits.detach(), flat_targets, flat_support, float(temperature), with_entropy, chunk_rows
        )
    return lp.view(b, t), (ent.view(b, t) if ent is not None else None)


def check_head_args(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int, *, rows: str = "V") -> None:
    """The fused head's inputs: hidden [N, H], weight [rows, H], targets [N], chunk_tokens >= 1."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [N, H] and weight [{rows}, H] needed, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


def hidden_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int,
    with_entropy: bool = False,
    compiled: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` under ``softmax(hidden @ weight.T)`` without the ``[N, V]`` logits in memory.

    The LM head and the log-softmax fused and cut into chunks of ``chunk_tokens`` rows: the forward keeps one
    chunk's logits at a time, the backward recomputes them chunk by chunk (one extra head GEMM) and writes the
    gradients of ``hidden`` and ``weight`` directly (``weight``'s summed over chunks in fp32). Temperature 1,
    no support restriction: the trainer's plain scoring. ``compiled`` runs each chunk's softmax statistics and
    gradient (everything but the GEMMs) through ``torch.compile``, which reads the chunk's logits once instead
    of once per elementwise op (train.torch_compile).

    Args:
        hidden: ``[N, H]`` final hidden states (after the final norm); ``hidden[i]`` predicts ``targets[i]``.
        weight: ``[V, H]`` the LM head (the tied embedding for Qwen3-0.6B).
        targets: ``[N]`` ids in ``[0, V)``.

    Returns:
        ``(logprobs [N], entropy [N] | None)`` in float32, differentiable w.r.t. ``hidden`` and ``weight``.
    """
    check_head_args(hidden, weight, targets, chunk_tokens)
    targets = targets.long()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        lp, ent = _HeadLogprobs.apply(hidden, weight, targets, chunk_tokens, with_entropy, compiled)
        return lp, (ent if with_entropy else None)
    with torch.no_grad():
        lp, _, ent = _head_forward(hidden, weight, targets, chunk_tokens, with_entropy, compiled)
    return lp, ent


def _chunk_stats(z: Tensor, targets: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk's (log-prob of its target, log-sum-exp, entropy) from its logits ``z`` [c, V], in fp32."""
    x = z.to(_compute_dtype(z.dtype))
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(1, targets[:, None]).squeeze(1) - lse
    if not with_entropy:
        return lp, lse, None
    logp = x.sub_(lse[:, None])  # z is the chunk's fresh GEMM output: nobody else reads it
    return lp, lse, -(logp.exp() * logp).sum(dim=-1)


def _chunk_grad(
    z: Tensor, lse: Tensor, targets: Tensor, grad_lp: Tensor | None, ent: Tensor | None, grad_ent: Tensor | None
) -> Tensor:
    """The gradient w.r.t. one chunk's logits ``z`` [c, V], in z's dtype."""
    logp = z.to(lse.dtype).sub_(lse[:, None])
    p = logp.exp()
    g = torch.zeros_like(p)
    if grad_lp is not None:
        # d log p_t / d z = onehot(t) - p
        g.addcmul_(p, grad_lp[:, None], value=-1.0)
        g.scatter_add_(1, targets[:, None], grad_lp[:, None])
    if grad_ent is not None and ent is not None:
        # d H / d z = -p * (log p + H)
        g.addcmul_(p * (logp + ent[:, None]), grad_ent[:, None], value=-1.0)
    return g.to(z.dtype)


_compiled_chunk_fns: dict[str, Any] = {}


def _chunk_fn(name: str, compiled: bool) -> Callable[..., Any]:
    fns: dict[str, Callable[..., Any]] = {"stats": _chunk_stats, "grad": _chunk_grad}
    fn = fns[name]
    if not compiled:
        return fn
    if name not in _compiled_chunk_fns:  # compiled once per process, on first use
        _compiled_chunk_fns[name] = torch.compile(fn)
    return _compiled_chunk_fns[name]


def _head_forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, with_entropy: bool, compiled: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    n = hidden.shape[0]
    cdt = _compute_dtype(hidden.dtype)
    lp = torch.empty(n, dtype=cdt, device=hidden.device)
    lse = torch.empty(n, dtype=cdt, device=hidden.device)
    ent = torch.empty(n, dtype=cdt, device=hidden.device) if with_entropy else None
    stats = _chunk_fn("stats", compiled)
    for r0 in range(0, n, chunk):
        r1 = min(r0 + chunk, n)
        block_lp, block_lse, block_ent = stats(hidden[r0:r1] @ weight.t(), targets[r0:r1], with_entropy)
        lp[r0:r1], lse[r0:r1] = block_lp, block_lse
        if ent is not None:
            ent[r0:r1] = block_ent
    return lp, lse, ent


class _HeadLogprobs(torch.autograd.Function):
    """`hidden_token_logprobs` with grad: saves hidden, weight and the [N] log-sum-exp, never [N, V]."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, with_entropy: bool, compiled: bool
    ) -> tuple[Tensor, Tensor]:
        lp, lse, ent = _head_forward(hidden, weight, targets, chunk, with_entropy, compiled)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.chunk, ctx.compiled = chunk, compiled
        ctx.set_materialize_grads(False)
        if ent is None:
            ent = lp.new_empty(0)
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_lp: Tensor | None, grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        if ent is None:
            grad_ent = None
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None, None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device) if want_w else None
        n, chunk = hidden.shape[0], ctx.chunk
        chunk_grad = _chunk_fn("grad", ctx.compiled)
        for r0 in range(0, n, chunk):
            r1 = min(r0 + chunk, n)
            h = hidden[r0:r1]
            g = chunk_grad(
                h @ weight.t(), lse[r0:r1], targets[r0:r1],
                None if grad_lp is None else grad_lp[r0:r1],
                None if ent is None else ent[r0:r1],
                None if grad_ent is None else grad_ent[r0:r1],
            )  # fmt: skip
            if grad_h is not None:
                grad_h[r0:r1] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ h).to(grad_w.dtype)
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None


def support_token_logprobs(
    logits: Tensor,
    targets: Tensor,
    support_ids: Tensor,
    support_valid: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` under ``softmax(logits / temperature)`` restricted to each position's support.

    Sampling-support replay: top-k/top-p drew token t from ``exp(z_t / T) / sum_{j in S} exp(z_j / T)``, so the
    trainer scores exactly that, with its own logits ``z``. The support (distinct ids) is given compactly, as
    ``support_ids`` ``[B, T, K]`` (any id where ``support_valid`` ``[B, T, K]`` is False), K being the largest
    support (about top_k), so nothing of size ``[B, T, V]`` is built but the gradient of ``logits``. A position without
    any valid slot (prompt, padding) gets log-prob 0 and entropy 0 (a singleton support of its target), never
    NaN; a position whose support lacks its target raises.

    Returns ``(logprobs [B, T], entropy [B, T] | None)`` in float32 (float64 for float64 logits),
    differentiable w.r.t. ``logits``.
    """
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"logits must be floating [B, T, V], got {logits.dtype} {tuple(logits.shape)}")
    b, t, v = logits.shape
    if targets.shape != (b, t):
        raise ValueError(f"targets must be [B, T] = {(b, t)}, got {tuple(targets.shape)}")
    if support_ids.dim() != 3 or support_ids.shape[:2] != (b, t) or support_valid.shape != support_ids.shape:
        raise ValueError(
            f"support_ids and support_valid must both be [B, T, K] with [B, T] = {(b, t)}, got "
            f"{tuple(support_ids.shape)} and {tuple(support_valid.shape)}"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    targets = targets.long()
    ids = support_ids.long()
    if bool(support_valid.any()) and (ids[support_valid].min() < 0 or ids[support_valid].max() >= v):
        raise ValueError(f"support ids must lie in [0, {v})")
    has = support_valid.any(dim=-1)
    if bool((has & ~((ids == targets[..., None]) & support_valid).any(dim=-1)).any()):
        raise ValueError("a sampling support excludes its target token")
    # A position without a support becomes the singleton {target}: log 1 = 0 with finite gradients.
    empty = ~has
    slot0 = torch.zeros_like(support_valid)
    slot0[..., 0] = True
    valid = support_valid | (empty[..., None] & slot0)
    ids = torch.where(empty[..., None] & slot0, targets[..., None], ids.clamp(0, v - 1))
    cdt = _compute_dtype(logits.dtype)
    z = logits.gather(-1, ids).to(cdt) / temperature
    z = z.masked_fill(~valid, -math.inf)
    lse = torch.logsumexp(z, dim=-1)
    # The target's logit from the same gather (it is in its support): one [B, T, V] gradient, not two.
    at_target = (ids == targets[..., None]) & valid
    lp = torch.where(at_target, z, torch.zeros_like(z)).sum(dim=-1) - lse
    if not with_entropy:
        return lp, None
    logp = z - lse[..., None]
    entropy = -(logp.exp() * _finite_or_zero(logp)).sum(dim=-1)
    return lp, entropy


def support_mask_from_ids(
    ids_per_token: list[list[int]], vocab_size: int, *, device: torch.device | str | None = None
) -> Tensor:
    """Bool ``[len(ids_per_token), vocab_size]`` mask, True at each token's sampling-support ids.

    Engines report the support as id lists; reshape the result to ``[B, T, V]`` for ``token_logprobs``.
    An empty list yields an all-False row, i.e. "no restriction recorded" for that position.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    counts = torch.tensor([len(ids) for ids in ids_per_token], dtype=torch.long)
    cols = torch.tensor([i for ids in ids_per_token for i in ids], dtype=torch.long)
    if cols.numel() and (cols.min() < 0 or cols.max() >= vocab_size):
        raise ValueError(f"support ids must lie in [0, {vocab_size}), got range [{cols.min()}, {cols.max()}]")
    rows = torch.repeat_interleave(torch.arange(len(ids_per_token)), counts)
    mask = torch.zeros(len(ids_per_token), vocab_size, dtype=torch.bool)
    mask[rows, cols] = True
    return mask.to(device) if device is not None else mask
