"""Batched sampling whose random choices depend only on (request seed, token index).

This is the reference implementation and the path for top-k/top-p/min-p and sampling-support
requests; plain temperature sampling on CUDA runs the equivalent fused kernel in `kernels.py`.

Each row's uniforms come from a counter-based hash of (seed, token index, vocab id) computed in
tensors, so a request samples the same tokens whatever else shares its batch, on any device, and
with no per-row generator objects. Sampling is Gumbel-max over the filtered, temperature-scaled
logits, which draws exactly from softmax(logits / T) restricted to the support.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    # (x * m) mod 2**32 without overflowing int64: split x into 16-bit halves.
    hi = ((x >> 16) * m) & 0xFFFF
    return ((hi << 16) + (x & 0xFFFF) * m) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # "lowbias32" integer hash (good avalanche, cheap); x holds values in [0, 2**32).
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _np_mix32(x: np.ndarray) -> np.ndarray:
    # _mix32 on uint32 arrays, whose multiplies wrap mod 2**32 by definition: the same bits, in a
    # few single-threaded numpy passes instead of ~20 torch int64 ops.
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _np_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> np.ndarray:
    seed = seeds.numpy().astype(np.int64)
    lo = (seed & _MASK32).astype(np.uint32)
    hi = ((seed >> 32) & _MASK32).astype(np.uint32)
    s = _np_mix32(_np_mix32(lo ^ np.uint32(0x9E3779B9)) ^ hi)
    s = _np_mix32(s ^ (steps.numpy().astype(np.int64) & _MASK32).astype(np.uint32))
    ids = np.arange(vocab_size, dtype=np.uint32)
    x = _np_mix32(_np_mix32(s[:, None] ^ ids[None, :]) ^ np.uint32(0x85EBCA6B))
    return uniform_from_bits_np(x)


def uniform_from_bits_np(x: np.ndarray) -> np.ndarray:
    """The top 23 of 32 hash bits as a uniform in (0, 1): k + 0.5 (k < 2**23) needs 24 mantissa bits,
    exact in float32, so u is never 0 or 1 (with 24 bits, k = 2**24 - 1 rounded to u = 1.0 and an
    infinite Gumbel noise, i.e. a token chosen whatever its probability)."""
    return ((x >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) / np.float32(1 << 23)


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), [B, V] float32, a pure function of (seed, step, vocab id).

    On CUDA one fused kernel computes the same bits (the int64 ops below are ~20 passes over [B, V],
    milliseconds at a 151,936-token vocabulary); on the CPU numpy's wrapping uint32 arithmetic does.
    """
    device = seeds.device
    if device.type == "cuda":
        from hpcrl.engine.embedded import kernels

        if kernels.AVAILABLE:
            return kernels.counter_uniform(seeds.contiguous(), steps.contiguous(), vocab_size)
    if device.type == "cpu":
        return torch.from_numpy(_np_uniform(seeds, steps, vocab_size))
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    s = _mix32(_mix32(lo ^ 0x9E3779B9) ^ hi)
    s = _mix32(s ^ (steps & _MASK32))
    ids = torch.arange(vocab_size, device=device, dtype=torch.int64)
    x = _mix32(_mix32(s[:, None] ^ ids[None, :]) ^ 0x85EBCA6B)
    # 23 bits + 0.5 are exact in float32, so u stays strictly inside (0, 1) (see uniform_from_bits_np).
    return ((x >> 9).to(torch.float32) + 0.5) / float(1 << 23)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-log(-log(u)) for counter_uniform's u, [B, V] float32.

    Every sampling path takes its noise from here, so a row's noise never depends on which path its
    batch took. On the CPU numpy computes it: torch's threaded log on small tensors cost milliseconds
    a step on a busy two-core machine.
    """
    if seeds.device.type == "cpu":
        u = _np_uniform(seeds, steps, vocab_size)
        return torch.from_numpy(-np.log(-np.log(u)))
    return -torch.log(-torch.log(counter_uniform(seeds, steps, vocab_size)))


@dataclass
class RowParams:
    """Per-row sampling parameters as tensors on the model's device."""

    temperature: torch.Tensor  # [B] float32; 0 means greedy
    top_k: torch.Tensor  # [B] int64; <= 0 means all
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, index of the token being sampled

    @property
    def needs_filter(self) -> bool:
        return bool(((self.top_k > 0) | (self.top_p < 1.0) | (self.min_p > 0.0)).any())


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor  # [B] log-prob at temperature 1 of the chosen token
    scaled_logprobs: torch.Tensor  # [B] log-prob under softmax(logits / T) (equals logprobs when T in {0, 1})
    support_logprobs: torch.Tensor | None  # [B] log-prob renormalised over the support, when filtered
    support_mask: torch.Tensor | None  # [B, V] bool, when filtered


def support_mask(scaled: torch.Tensor, p: RowParams) -> torch.Tensor:
    """Which ids survive top-k, top-p and min-p filtering of the scaled logits [B, V]."""
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    keep_sorted = torch.ones_like(sorted_probs, dtype=torch.bool)
    k = torch.where(p.top_k > 0, p.top_k, scaled.shape[-1])
    keep_sorted &= rank < k[:, None]
    # top-p keeps the smallest prefix whose mass reaches p (the first token always stays).
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted &= mass_before < p.top_p[:, None]
    keep_sorted &= sorted_probs >= (p.min_p[:, None] * sorted_probs[:, :1])
    keep_sorted[:, 0] = True
    mask = torch.zeros_like(keep_sorted)
    mask.scatter_(-1, order, keep_sorted)
    return mask


def sample(
    logits: torch.Tensor,
    p: RowParams,
    *,
    want_support: bool,
    unit_temperature: bool = False,
    logprobs: torch.Tensor | None = None,
) -> SampleOutput:
    """Sample one token per row. `unit_temperature` is the caller's promise that every row has
    temperature 1 and no top-k/top-p/min-p (the usual RL setting): the same tokens, fewer ops.

    `logprobs` is the batch-invariant engine's log-softmax row, passed as `logits` too: the token is then
    drawn from that row (softmax(lp / T) = softmax(logits / T)) and the reported log-prob is its entry,
    not a second log-softmax of it."""
    logits = logits.float()
    logprobs_t1 = torch.log_softmax(logits, dim=-1) if logprobs is None else logprobs
    gumbel = gumbel_noise(p.seeds, p.steps, logits.shape[-1])
    if unit_temperature and not want_support:
        # logits / 1 == logits exactly, so this is the general path's arithmetic for such rows.
        chosen = (logits + gumbel).argmax(-1)
        lp = logprobs_t1.gather(-1, chosen[:, None])[:, 0]
        return SampleOutput(token_ids=chosen, logprobs=lp, scaled_logprobs=lp, support_logprobs=None, support_mask=None)
    greedy = p.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(p.temperature), p.temperature)
    scaled = logits / temp[:, None]
    mask = support_mask(scaled, p) if p.needs_filter else None
    noisy = scaled + gumbel
    if mask is not None:
        noisy = noisy.masked_fill(~mask, float("-inf"))
    chosen = torch.where(greedy, logits.argmax(-1), noisy.argmax(-1))
    idx = chosen[:, None]
    scaled_lp = torch.log_softmax(scaled, dim=-1).gather(-1, idx)[:, 0]
    support_lp = None
    if want_support and mask is not None and logprobs is not None:
        # The batch-invariant engine: the trainer renormalises the same row entries in the same order.
        support_lp = _invariant_support_logprobs(logprobs, mask, chosen)
    elif want_support and mask is not None:
        support_lp = torch.log_softmax(scaled.masked_fill(~mask, float("-inf")), dim=-1).gather(-1, idx)[:, 0]
    elif want_support:
        support_lp = scaled_lp
    return SampleOutput(
        token_ids=chosen,
        logprobs=logprobs_t1.gather(-1, idx)[:, 0],
        scaled_logprobs=torch.where(greedy, logprobs_t1.gather(-1, idx)[:, 0], scaled_lp),
        support_logprobs=support_lp,
        support_mask=mask,
    )


def _invariant_support_logprobs(lp_rows: torch.Tensor, mask: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """invariant.support_logprobs on the rows' supports, their ids ascending as the engine reports them."""
    from hpcrl.model.invariant import support_logprobs

    sizes = mask.sum(dim=-1)
    k = max(int(sizes.max().item()), 1)
    rows, ids = mask.nonzero(as_tuple=True)  # row-major: each row's ids ascending
    slot = torch.arange(ids.numel(), device=ids.device) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)
    entries = torch.zeros(mask.shape[0], k, dtype=torch.float32, device=lp_rows.device)
    valid = torch.zeros(mask.shape[0], k, dtype=torch.bool, device=lp_rows.device)
    entries[rows, slot] = lp_rows[rows, ids]
    valid[rows, slot] = True
    return support_logprobs(entries, valid, lp_rows.gather(-1, chosen[:, None])[:, 0])
