"""The fused sampler: `sampling.sample`'s draw and log-probs for plain temperature sampling, and the
counter-based uniform noise, in Triton."""

from __future__ import annotations

import torch

from hpcrl.engine.embedded.kernels import launch
from hpcrl.engine.embedded.kernels.launch import (
    AVAILABLE,
    libdevice,
    next_pow2,
    nvidia_compiled,
    pdl_args,
    pdl_enter,
    tl,
    triton,
)
from hpcrl.engine.embedded.sampling import CHUNK_COUNTER, SAMPLE_CHUNK_IDS
from hpcrl.engine.kernels_config import KernelsConfig

if AVAILABLE:

    @triton.jit
    def _mix32(x):
        # "lowbias32" on uint32 lanes; multiplies wrap mod 2**32 exactly as sampling._mul32 computes.
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _row_key(seed, step):
        # Same as sampling.counter_uniform's per-row key: seeds are int64 >= 0, steps int64 >= 0.
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        s = _mix32(_mix32(lo ^ 0x9E3779B9) ^ hi)
        return _mix32(s ^ (step & 0xFFFFFFFF).to(tl.uint32))

    @triton.jit
    def _gumbel(u, FAST_LOG: tl.constexpr):
        # -log(-log(u)), u in [2**-24, 1): both logs of normal numbers, so the hardware's approximate log2 (a few
        # ulp, flushing denormals that cannot occur) does; tl.log is libdevice's exact logf, ~40 instructions
        # inlined, and two of them a logit made the sampler's loop compute-bound (benchmarks/decode_h200_2026-12.md).
        if FAST_LOG:
            return -libdevice.fast_logf(-libdevice.fast_logf(u))
        else:
            return -tl.log(-tl.log(u))

    @triton.jit
    def _exp_to_one(x, FAST_EXP: tl.constexpr):
        # exp(x) for x <= 0, summed against an exp(0) = 1: the hardware's exp2 that flushes a denormal result to 0
        # (below 1e-38, nothing next to that 1) where tl.exp spends three more instructions keeping denormals (a
        # test and two scalings: 213 -> 165 instructions in the loop, kernel_sass.py), the loop the pass is bound by.
        if FAST_EXP:
            return libdevice.fast_expf(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _sample_partial_kernel(
        Logits,
        stride_row,
        V,
        Temp,
        Part,
        PartI,
        NSPLIT: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        FAST_EXP: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        # Program (row, chunk) scans logits[row, chunk*CHUNK : (chunk+1)*CHUNK] (sampling.SAMPLE_CHUNK_IDS ids)
        # twice: its max, then its sum-exp under that max, at T=1 and, for a row at another temperature, at T;
        # the first arg-max only for a greedy row. Chunks are merged by _sample_combine_kernel. Two plain passes
        # (the second from L1) take about a third of the instructions of one online pass (which rescales its sum
        # at every id), and the pass is bound by instructions, not by its bytes. No noise here either: the combine
        # kernel hashes it for the one chunk it draws.
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        t = tl.load(Temp + row)
        greedy = t <= 0.0
        tt = tl.where(greedy, 1.0, t)
        base = Logits + row * stride_row
        lanes = tl.arange(0, BLOCK)
        neg = float("-inf")
        lo = split * CHUNK
        full = lo + CHUNK <= V  # every chunk but a vocabulary's last: no mask a load
        mv = tl.full([BLOCK], neg, tl.float32)
        for start in range(lo, lo + CHUNK, BLOCK):
            if full:
                x = tl.load(base + start + lanes).to(tl.float32)
            else:
                x = tl.load(base + start + lanes, mask=start + lanes < V, other=neg).to(tl.float32)
            mv = tl.where(x > mv, x, mv)  # a NaN never wins (tl.maximum's NaN rule differs under the interpreter)
        mx1 = tl.max(mv, axis=0)
        shift1 = tl.where(mx1 == neg, 0.0, mx1)  # a chunk of all -inf: sum 0, not NaN
        sv1 = tl.zeros([BLOCK], tl.float32)
        sv2 = tl.zeros([BLOCK], tl.float32)
        # The first arg-max, for a greedy row: the lowest id holding the max (V where none does: all NaN).
        av = tl.full([BLOCK], V, tl.int32)
        t_one = tt == 1.0
        mx2 = tl.where(t_one, mx1, mx1 / tt)  # x / T rounds monotonically: max(x / T) is max(x) / T exactly
        shift2 = tl.where(mx2 == neg, 0.0, mx2)
        for start in range(lo, lo + CHUNK, BLOCK):
            offs = start + lanes
            if full:
                x = tl.load(base + offs).to(tl.float32)
            else:
                x = tl.load(base + offs, mask=offs < V, other=neg).to(tl.float32)
            sv1 += _exp_to_one(x - shift1, FAST_EXP)
            if not t_one:
                # At temperature 1 (and greedy) the tempered sum is the plain one: skipped, not repeated.
                sv2 += _exp_to_one(x / tt - shift2, FAST_EXP)
            if greedy:
                av = tl.minimum(av, tl.where(x == mx1, offs, V))
        sum1 = tl.sum(sv1, axis=0)
        sum2 = tl.where(t_one, sum1, tl.sum(sv2, axis=0))
        out = Part + (row * NSPLIT + split) * 4
        tl.store(out, mx1)
        tl.store(out + 1, sum1)
        tl.store(out + 2, mx2)
        tl.store(out + 3, sum2)
        # A chunk with no id equal to its max (all NaN) reports its first id: a row of no finite logit then draws
        # id 0, as torch.argmax gives.
        first = tl.min(av, axis=0)
        tl.store(PartI + row * NSPLIT + split, tl.where(first == V, lo, first))

    @triton.jit
    def _sample_combine_kernel(
        Logits,
        stride_row,
        V,
        Temp,
        Seeds,
        Steps,
        Part,
        PartI,
        OutTok,
        OutLp,
        Tokens,
        Positions,
        NSPLIT: tl.constexpr,
        SP: tl.constexpr,
        CHUNK: tl.constexpr,
        CHUNK_COUNTER: tl.constexpr,
        BLOCK: tl.constexpr,
        UPDATE: tl.constexpr,
        LP_ROWS: tl.constexpr,
        FAST_LOG: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        # sampling.choose_tokens: a chunk drawn by its mass at T, then Gumbel-max inside it.
        row = tl.program_id(0).to(tl.int64)
        neg = float("-inf")
        k = tl.arange(0, SP)
        km = k < NSPLIT
        part = Part + (row * NSPLIT + k) * 4
        m1 = tl.load(part, mask=km, other=neg)
        s1 = tl.load(part + 1, mask=km, other=0.0)
        m2 = tl.load(part + 2, mask=km, other=neg)
        s2 = tl.load(part + 3, mask=km, other=0.0)
        arg1 = tl.load(PartI + row * NSPLIT + k, mask=km, other=V)
        mx1 = tl.max(m1, axis=0)
        lse1 = mx1 + tl.log(tl.sum(s1 * tl.exp(m1 - mx1), axis=0))
        mx2 = tl.max(m2, axis=0)
        mass = tl.where(km, s2 * tl.exp(m2 - mx2), 0.0)
        lse2 = mx2 + tl.log(tl.sum(mass, axis=0))
        t = tl.load(Temp + row)
        greedy = t <= 0.0
        tt = tl.where(greedy, 1.0, t)
        key = _row_key(tl.load(Seeds + row), tl.load(Steps + row))
        h0 = _mix32(_mix32(key ^ CHUNK_COUNTER) ^ 0x85EBCA6B)
        u0 = ((h0 >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        cum = tl.cumsum(mass, axis=0)
        total = tl.max(cum, axis=0)
        # sampling.choose_tokens' rule: the first chunk of mass whose cumulative mass passes u * total, else the
        # last chunk of mass (a chunk of no mass never: its Gumbel-max would find no id).
        has_mass = (mass > 0) & km
        first = tl.min(tl.where((cum > u0 * total) & has_mass, k, SP), axis=0)
        chosen = tl.where(first < SP, first, tl.max(tl.where(has_mass, k, 0), axis=0))
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], neg, tl.float32)
        lo = chosen * CHUNK
        best_i = tl.zeros([BLOCK], tl.int32) + lo  # as arg1: a chunk of no finite score draws its first id
        base = Logits + row * stride_row
        for start in range(lo, lo + CHUNK, BLOCK):
            offs = start + lanes
            msk = offs < V
            x = tl.load(base + offs, mask=msk, other=neg).to(tl.float32)
            h = _mix32(_mix32(key ^ offs.to(tl.uint32)) ^ 0x85EBCA6B)
            # 23 bits: k + 0.5 is exact in fp32, u < 1. Times 2**-23, not / 2**23: the same value (a power of two
            # scales exactly).
            u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
            score = tl.where(msk, x / tt + _gumbel(u, FAST_LOG), neg)
            better = score > best  # strict: a lane keeps its first maximum, as torch.argmax does
            best = tl.where(better, score, best)
            best_i = tl.where(better, offs, best_i)
        top = tl.max(best, axis=0)
        drawn = tl.min(tl.where(best == top, best_i, V), axis=0)
        # Greedy: the first chunk holding the row's maximum, and its first maximum (torch.argmax's id).
        idx = tl.where(greedy, tl.min(tl.where(m1 == mx1, arg1, V), axis=0), drawn)
        xc = tl.load(Logits + row * stride_row + idx).to(tl.float32)
        if LP_ROWS:
            # The rows are the batch-invariant log-softmax itself: its entry is the log-prob the trainer
            # computes, bit for bit; xc - lse1 would add a rounding of its own (lse1 is only ~0).
            lp = xc
            slp = tl.where(greedy | (t == 1.0), lp, xc / tt - lse2)
        else:
            lp = xc - lse1
            slp = tl.where(greedy, lp, xc / tt - lse2)
        tl.store(OutTok + row, idx.to(tl.int64))
        tl.store(OutLp + row * 2, lp)
        tl.store(OutLp + row * 2 + 1, slp)
        if UPDATE:
            # Advance the row's decode state on the device: the next step needs no host round trip.
            tl.store(Tokens + row, idx.to(tl.int64))
            tl.store(Positions + row, tl.load(Positions + row) + 1)
            tl.store(Steps + row, tl.load(Steps + row) + 1)

    @triton.jit
    def _uniform_kernel(Seeds, Steps, Out, V, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        key = _row_key(tl.load(Seeds + row), tl.load(Steps + row))
        h = _mix32(_mix32(key ^ offs.to(tl.uint32)) ^ 0x85EBCA6B)
        tl.store(Out + row * V + offs, ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07, mask=offs < V)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    out_tok: torch.Tensor,
    out_lp: torch.Tensor,
    tokens: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,
    logprob_rows: bool = False,
) -> None:
    """Sample each row of logits [n, V] as `sampling.sample` does (no top-k/top-p/min-p): a chunk of
    SAMPLE_CHUNK_IDS ids by its mass, then Gumbel-max inside it (`sampling.choose_tokens`).

    Writes out_tok [n] and out_lp [n, 2] (log-prob at T=1, log-prob under softmax(logits/T)). With
    tokens/positions given, also sets tokens[b] = chosen and advances positions[b] and steps[b].
    config: (BLOCK, num_warps) of the pass over the logits[, (BLOCK, num_warps) of the draw inside the chunk].
    On NVIDIA GPUs the noise's two logs are the hardware's approximate log2 (a few ulp), and each chunk's mass is
    summed in another order than torch's: a token can differ from the torch sampler's only where two noisy scores
    lie within ~1e-6 of each other, or the chunk uniform within ~1e-6 of a boundary between chunks' masses.
    `logprob_rows`: the rows are already log-softmax(logits) (the batch-invariant engine's): the T=1 log-prob
    reported is the chosen entry as it is, and at T=1 the scaled one too.
    """
    n, vocab = logits.shape
    update = tokens is not None
    block, warps, draw_block, draw_warps = _sample_config(config or launch.SETTINGS.sample_config)
    block = min(block, next_pow2(vocab), SAMPLE_CHUNK_IDS)
    chunks = triton.cdiv(vocab, SAMPLE_CHUNK_IDS)
    # A vocabulary of one chunk (tiny models) is scanned to its next power of two, not 4096 ids.
    chunk = min(SAMPLE_CHUNK_IDS, max(block, next_pow2(vocab)))
    part = torch.empty(n, chunks, 4, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(n, chunks, dtype=torch.int32, device=logits.device)
    _sample_partial_kernel[(n, chunks)](
        logits,
        logits.stride(0),
        vocab,
        temperature,
        part,
        part_i,
        NSPLIT=chunks,
        CHUNK=chunk,
        BLOCK=block,
        FAST_EXP=nvidia_compiled(),
        num_warps=warps,
        **pdl_args(logits),
    )
    _sample_combine_kernel[(n,)](
        logits,
        logits.stride(0),
        vocab,
        temperature,
        seeds,
        steps,
        part,
        part_i,
        out_tok,
        out_lp,
        tokens if update else out_tok,
        positions if update else out_tok,
        NSPLIT=chunks,
        SP=next_pow2(chunks),
        CHUNK=chunk,
        CHUNK_COUNTER=CHUNK_COUNTER,
        BLOCK=min(draw_block, chunk),
        UPDATE=update,
        LP_ROWS=logprob_rows,
        FAST_LOG=nvidia_compiled(),  # a Triton launch on CPU tensors is the interpreter, where this is False
        num_warps=draw_warps,
        **pdl_args(logits),
    )


def _sample_config(config: tuple[int, ...]) -> tuple[int, int, int, int]:
    """An explicit sample_rows config (a benchmark's): (BLOCK, num_warps) of the pass, then of the draw (the
    default's, when only two are given), checked by KernelsConfig's rule."""
    full = config + KernelsConfig().sample_config[2:] if len(config) == 2 else config
    if len(full) != 4:
        raise ValueError(f"sample_rows config {config}: expected BLOCK,num_warps[,BLOCK,num_warps of the draw]")
    return KernelsConfig(sample_config=(full[0], full[1], full[2], full[3])).sample_config


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """sampling.counter_uniform in one kernel (same bits)."""
    n = seeds.shape[0]
    out = torch.empty(n, vocab_size, dtype=torch.float32, device=seeds.device)
    block = 1024
    _uniform_kernel[(n, triton.cdiv(vocab_size, block))](seeds, steps, out, vocab_size, BLOCK=block, num_warps=4)
    return out
