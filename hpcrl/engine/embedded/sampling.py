"""Batched sampling whose random choices depend only on (request seed, token index).

This is the reference implementation and the path for top-k/top-p/min-p and sampling-support
requests; plain temperature sampling on CUDA runs the equivalent fused kernel in `kernels/sampler.py`.

Each row's uniforms come from a counter-based hash of (seed, token index, vocab id) computed in
tensors, so a request samples the same tokens whatever else shares its batch, on any device, and
with no per-row generator objects. Sampling draws exactly from softmax(logits / T) restricted to the
support, in two levels (`choose_tokens`): a chunk of `SAMPLE_CHUNK_IDS` vocabulary ids by its mass, then
Gumbel-max inside that chunk. P(chunk) * P(id | chunk) = P(id), and only one chunk a row needs noise: the
fused kernel's pass over the logits is then a plain sum-exp, with no hash and no logs per id (0.087 ->
0.052 ms a step on an H200, benchmarks/decode_h200_2026-12.md). A vocabulary of one chunk (tiny models) is plain
Gumbel-max over it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

_MASK32 = 0xFFFFFFFF
# The first level's unit: a fixed part of the semantics (a row's token depends on it), not a launch knob.
SAMPLE_CHUNK_IDS = 4096
# The counter of the uniform that picks the chunk: past every vocabulary id's, so it never repeats an id's noise.
CHUNK_COUNTER = _MASK32


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
    return _np_uniform_at(seeds, steps, np.arange(vocab_size, dtype=np.uint32))


def _np_uniform_at(seeds: torch.Tensor, steps: torch.Tensor, ids: np.ndarray) -> np.ndarray:
    seed = seeds.numpy().astype(np.int64)
    lo = (seed & _MASK32).astype(np.uint32)
    hi = ((seed >> 32) & _MASK32).astype(np.uint32)
    s = _np_mix32(_np_mix32(lo ^ np.uint32(0x9E3779B9)) ^ hi)
    s = _np_mix32(s ^ (steps.numpy().astype(np.int64) & _MASK32).astype(np.uint32))
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
        from hpcrl.engine.embedded.kernels import launch, sampler

        if launch.AVAILABLE:
            return sampler.counter_uniform(seeds.contiguous(), steps.contiguous(), vocab_size)
    if device.type == "cpu":
        return torch.from_numpy(_np_uniform(seeds, steps, vocab_size))
    return uniform_at(row_keys(seeds, steps), torch.arange(vocab_size, device=device, dtype=torch.int64))


def chunk_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The uniform that picks each row's chunk, [B] float32: counter_uniform's bits at id CHUNK_COUNTER."""
    if seeds.device.type == "cpu":
        return torch.from_numpy(_np_uniform_at(seeds, steps, np.array([CHUNK_COUNTER], dtype=np.uint32))[:, 0])
    return chunk_uniform_at(row_keys(seeds, steps))


def chunk_uniform_at(keys: torch.Tensor) -> torch.Tensor:
    """chunk_uniform for rows of `row_keys`, in torch ops (traceable by torch.compile), [B] float32."""
    return uniform_at(keys, torch.full((1,), CHUNK_COUNTER, device=keys.device, dtype=torch.int64))[:, 0]


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's hash key from (seed, token index), [B] int64 holding 32 bits; traceable by torch.compile."""
    s = _mix32(_mix32((seeds & _MASK32) ^ 0x9E3779B9) ^ ((seeds >> 32) & _MASK32))
    return _mix32(s ^ (steps & _MASK32))


def uniform_at(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """counter_uniform's bits for rows of `row_keys` at vocabulary ids (or CHUNK_COUNTER) `ids` [C] or [B, C]."""
    x = _mix32(_mix32(keys[:, None] ^ (ids if ids.dim() == 2 else ids[None, :])) ^ 0x85EBCA6B)
    # 23 bits + 0.5 are exact in float32, so u stays strictly inside (0, 1) (see uniform_from_bits_np).
    return ((x >> 9).to(torch.float32) + 0.5) / float(1 << 23)


def choose_tokens(scaled: torch.Tensor, noise: torch.Tensor, u_chunk: torch.Tensor) -> torch.Tensor:
    """The sampled id of each row of `scaled` [B, V] float32 (temperature-scaled logits, -inf outside the support),
    given each id's Gumbel noise [B, V] and the chunk uniform [B] (`chunk_uniform`).

    First a chunk of SAMPLE_CHUNK_IDS ids is drawn by its share of softmax(scaled), then Gumbel-max picks inside
    it. The fused kernel computes the same: it sums each chunk's mass in its kernel over the logits and hashes
    noise for the chosen chunk only. Traceable by torch.compile."""
    # float32 whatever the logits' dtype: chunk masses summed in bfloat16 would bias the draw.
    scaled = scaled.float()
    rows, vocab = scaled.shape
    if vocab <= SAMPLE_CHUNK_IDS:
        return (scaled + noise).argmax(-1)
    chunks = -(-vocab // SAMPLE_CHUNK_IDS)
    pad = chunks * SAMPLE_CHUNK_IDS - vocab
    mass = torch.exp(scaled - scaled.amax(-1, keepdim=True))
    mass = F.pad(mass, (0, pad)).view(rows, chunks, SAMPLE_CHUNK_IDS).sum(-1)  # [B, chunks]
    cum = mass.cumsum(-1)
    # The first chunk of mass whose cumulative mass passes u * total, else (u * total rounded up to the total)
    # the last chunk of mass. "Of mass" matters where a parallel scan (CUDA's cumsum, the kernel's) rounds a
    # chunk of no mass to a sum above its predecessor's: a count of the sums <= u * total could then land on it.
    index = torch.arange(chunks, device=scaled.device)
    has_mass = mass > 0
    first = torch.where((cum > u_chunk[:, None] * cum[:, -1:]) & has_mass, index, chunks).amin(-1)
    last = torch.where(has_mass, index, 0).amax(-1)
    chosen = torch.where(first < chunks, first, last)
    ids = chosen[:, None] * SAMPLE_CHUNK_IDS + torch.arange(SAMPLE_CHUNK_IDS, device=scaled.device)[None, :]
    valid = ids < vocab
    ids = ids.clamp(max=vocab - 1)
    scores = (scaled.gather(-1, ids) + noise.gather(-1, ids)).masked_fill(~valid, float("-inf"))
    return ids.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]


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
    u_chunk = chunk_uniform(p.seeds, p.steps)
    if unit_temperature and not want_support:
        # logits / 1 == logits exactly, so this is the general path's arithmetic for such rows.
        chosen = choose_tokens(logits, gumbel, u_chunk)
        lp = logprobs_t1.gather(-1, chosen[:, None])[:, 0]
        return SampleOutput(token_ids=chosen, logprobs=lp, scaled_logprobs=lp, support_logprobs=None, support_mask=None)
    greedy = p.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(p.temperature), p.temperature)
    scaled = logits / temp[:, None]
    mask = support_mask(scaled, p) if p.needs_filter else None
    support = scaled if mask is None else scaled.masked_fill(~mask, float("-inf"))
    chosen = torch.where(greedy, logits.argmax(-1), choose_tokens(support, gumbel, u_chunk))
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
