"""Triton kernels for the embedded engine's CUDA decode step.

At batch 256 the eager decode step of a 28-layer model is ~2,000 small launches (RMSNorm alone is
eight elementwise ops in fp32), an attention that expands the grouped K/V heads and a sampler that
runs ~40 passes over [B, V] int64/fp32 tensors. These kernels fuse each of those into one launch:

- `add_rmsnorm`: residual add + RMSNorm (transformers' op order: normalise in fp32, cast, scale);
  `embed_rmsnorm`, the first layer's: the embedding lookup + RMSNorm;
- `qk_norm_rope_store`: per-head QK-norm + RoPE for q (in place) and k, and the K/V cache write,
  reading one fused QKV projection and the RoPE tables at each row's position;
- `decode_attention`: one query token per row against its own cache length (GQA heads share one
  K/V read, and no row reads past its length, so CUDA graphs need no attention-length buckets);
- `silu_mul`: the SwiGLU product of one fused gate/up projection;
- `sample_rows`: `sampling.sample`'s draw (a chunk of ids by its mass, then Gumbel-max inside it, with the
  same counter-based noise as `sampling.counter_uniform`: a pure function of seed, token index and vocab id),
  plus the log-probs at temperature 1 and at the row's temperature, in one kernel over the logits (each chunk
  scanned for its max, then from L1 for its sum-exp) and one over the drawn chunk, without materialising noise.

Every kernel reads its row lengths and positions from device memory, so a decode step has no host
sync and can be captured in a CUDA graph. Triton is optional: without it (CPU installs) `AVAILABLE`
is False and the engine runs the eager model.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from hpcrl.engine.embedded.sampling import CHUNK_COUNTER, SAMPLE_CHUNK_IDS
from hpcrl.engine.kernels_config import KernelsConfig

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    AVAILABLE = True
except ImportError:  # CPU-only installs have no Triton; the engine then decodes eagerly
    triton = None
    tl = None
    libdevice = None
    AVAILABLE = False


SETTINGS = KernelsConfig()
"""The resolved `engine.kernels` this process launches with (`configure`); every launch reads it, so a benchmark
may swap it (dataclasses.replace) to compare two settings in one process, recapturing its graphs."""


def configure(settings: KernelsConfig) -> None:
    """Launch every kernel of this process with `settings` (the engine section's kernels, env overrides applied):
    the kernels are process-wide, like the CUDA graphs that capture them."""
    global SETTINGS
    SETTINGS = settings


# The decode step's o and down GEMMs on the cuBLAS path (KernelsConfig.cublas_split_k), split over K: one
# strided-batch cuBLAS call of fp32 partials that add_rmsnorm sums, as the Triton path's split-K. At batch 256
# their [256, 1024] outputs are too few tiles to fill an H200's 132 multiprocessors. H200, Qwen3-0.6B shape, each
# GEMM with its add_rmsnorm (tools/gpu/decode_gemm_sweep.py --cublas-splits): o 8.2 us whole, 7.2 / 7.4 / 10.0 in
# 2 / 4 / 8 parts; down 9.7 whole, 8.2 / 8.3 / 8.3 / 9.0 / 10.1 in 2 / 3 / 4 / 6 / 8. Above
# CUBLAS_SPLIT_K_MAX_ROWS rows a step keeps whole GEMMs: the same sweep at 1 to 512 rows found 2 parts faster at
# every batch up to 384 (o 7.35 -> 6.40 us at 8 rows, 8.16 -> 7.61 at 384) and slower at 512 (o 8.49 -> 8.91).
CUBLAS_SPLIT_K_DEFAULT = (2, 2)
CUBLAS_SPLIT_K_MAX_ROWS = 384


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """F.linear(x, weight) for parts == 1; else its fp32 partial products [parts, n, N] over `parts` equal shares of
    K (add_rmsnorm sums them), from one strided-batch GEMM over views of x and weight (no copies)."""
    if parts == 1:
        return torch.nn.functional.linear(x, weight)
    (n, k), out_features = x.shape, weight.shape[0]
    if k % parts or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(
            f"split_k_linear: K = {k} must split into {parts} equal parts of contiguous x and weight; set "
            "engine.kernels.cublas_split_k to parts that divide the model's heads x head_dim and intermediate size"
        )
    share = k // parts
    xs = x.view(n, parts, share).transpose(0, 1)  # [parts, n, share], rows k apart
    ws = weight.view(out_features, parts, share).permute(1, 2, 0)  # [parts, share, N]
    if x.is_cuda:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    # CPU builds have no bmm with out_dtype: the same products (a bf16 x bf16 product is exact in fp32).
    return torch.bmm(xs.float(), ws.float())


def nvidia_compiled() -> bool:
    """Whether Triton compiles the kernels for an NVIDIA GPU: not on ROCm, not under Triton's interpreter (which has
    neither tl.extra.cuda nor libdevice's fast functions)."""
    return torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


@functools.cache
def pdl_capable(device_index: int) -> bool:
    """Whether the decode kernels can use PDL on this CUDA device: NVIDIA (ROCm also reports a capability 9, and
    has no griddepcontrol), compute capability 9 or newer, and not under Triton's interpreter."""
    return nvidia_compiled() and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_on(device: torch.device) -> bool:
    """Whether kernels launched on `device` use programmatic dependent launch now."""
    if not SETTINGS.pdl or device.type != "cuda":
        return False
    return pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def _pdl(t: torch.Tensor) -> dict[str, Any]:
    """The launch keywords of one kernel: PDL (its constexpr) and, with it on, Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if pdl_on(t.device) else {"PDL": False}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def supported(head_dim: int, dtype: torch.dtype) -> str | None:
    """None when the fused decode path can run this model, else the reason it cannot."""
    if not AVAILABLE:
        return "triton is not installed"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dtype} is not supported"
    return None


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
    def _pdl_enter(PDL: tl.constexpr):
        # A kernel launched with launch_pdl starts while the kernel before it drains: nothing it reads or writes is
        # safe before the wait. Its dependents may then launch (they wait in turn).
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _add_rmsnorm_kernel(
        X,
        R,
        W,
        Out,
        eps,
        N,
        part_stride,
        Ids,
        HAS_X: tl.constexpr,
        PARTS: tl.constexpr,
        EMBED: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < N
        if EMBED:
            # X is the embedding table: the residual starts as the row of this token's id (F.embedding's copy).
            e = tl.load(X + tl.load(Ids + row).to(tl.int64) * N + offs, mask=m, other=0.0)
            tl.store(R + row * N + offs, e, mask=m)
            x = e.to(tl.float32)
        else:
            x = tl.load(R + row * N + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_X:
            if PARTS > 1:
                # X holds a split-K GEMM's fp32 partial products: their sum, rounded as the GEMM's output would be.
                y = tl.zeros([BLOCK], tl.float32)
                for p in tl.static_range(PARTS):
                    y += tl.load(X + p * part_stride + row * N + offs, mask=m, other=0.0)
                y = y.to(R.dtype.element_ty).to(tl.float32)
            else:
                y = tl.load(X + row * N + offs, mask=m, other=0.0).to(tl.float32)
            # residual = residual + x, rounded to the model dtype as the eager `h = h + f(h)` is.
            x = (x + y).to(R.dtype.element_ty)
            tl.store(R + row * N + offs, x, mask=m)
            x = x.to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        h = (x * (1.0 / tl.sqrt(var + eps))).to(Out.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Out + row * N + offs, (w * h).to(Out.dtype.element_ty), mask=m)

    @triton.jit
    def _qk_norm_rope_store_kernel(
        QKV,
        QW,
        KW,
        Cos,
        Sin,
        Pos,
        KC,
        VC,
        eps,
        stride_row,
        stride_cb,
        stride_ch,
        stride_cn,
        max_len,
        rope_len,
        first_slot,
        rows_per_slot,
        H: tl.constexpr,
        KVH: tl.constexpr,
        HP: tl.constexpr,
        KP: tl.constexpr,
        D: tl.constexpr,
        HAS_NORM: tl.constexpr,
        KV8: tl.constexpr,
        STORE_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_enter(PDL)
        # One program per row: its q heads (rewritten in place), k heads and v heads (to the cache slot
        # first_slot + row // rows_per_slot: a decode step has a row per slot, a prefill a row per prompt token).
        b = tl.program_id(0).to(tl.int64)
        slot = first_slot + b // rows_per_slot
        HALF: tl.constexpr = D // 2
        d = tl.arange(0, D)
        dr = (d + HALF) % D
        sign = tl.where(d < HALF, -1.0, 1.0)[None, :]
        pos = tl.load(Pos + b)
        # The tables' row of this position, read here rather than gathered per row by torch ops before the launch
        # (three kernels a decode step). A finished row's look-ahead step may sit at max_len: its RoPE row is
        # clamped (its K/V write is masked off below).
        rope_row = tl.minimum(pos, rope_len - 1)
        cos = tl.load(Cos + rope_row * D + d).to(tl.float32)[None, :]
        sin = tl.load(Sin + rope_row * D + d).to(tl.float32)[None, :]
        row = QKV + b * stride_row
        dt = QKV.dtype.element_ty
        hq = tl.arange(0, HP)[:, None]
        mq = (hq < H) & (d[None, :] < D)
        x = tl.load(row + hq * D + d[None, :], mask=mq, other=0.0).to(tl.float32)
        xr = tl.load(row + hq * D + dr[None, :], mask=mq, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
            w = tl.load(QW + d).to(tl.float32)[None, :]
            wr = tl.load(QW + dr).to(tl.float32)[None, :]
            x = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xr = (wr * (xr * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        # apply_rope in the model dtype: x*cos and rotate_half(x)*sin are each rounded, then summed.
        out = ((x * cos).to(dt).to(tl.float32) + (sign * xr * sin).to(dt).to(tl.float32)).to(dt)
        tl.store(row + hq * D + d[None, :], out, mask=mq)
        hk = tl.arange(0, KP)[:, None]
        mk = (hk < KVH) & (d[None, :] < D)
        kb = row + H * D
        x = tl.load(kb + hk * D + d[None, :], mask=mk, other=0.0).to(tl.float32)
        xr = tl.load(kb + hk * D + dr[None, :], mask=mk, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
            w = tl.load(KW + d).to(tl.float32)[None, :]
            wr = tl.load(KW + dr).to(tl.float32)[None, :]
            x = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xr = (wr * (xr * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        out = ((x * cos).to(dt).to(tl.float32) + (sign * xr * sin).to(dt).to(tl.float32)).to(dt)
        if STORE_K:
            # A prefill's attention reads k from the QKV output (in the model dtype), not from the cache.
            tl.store(kb + hk * D + d[None, :], out, mask=mk)
        # A finished row's extra look-ahead step may sit at max_len: it must not write out of bounds.
        mc = (hk < tl.where(pos < max_len, KVH, 0)) & (d[None, :] < D)
        off = slot * stride_cb + hk.to(tl.int64) * stride_ch + pos * stride_cn + d[None, :]
        vv = tl.load(row + (H + KVH) * D + hk * D + d[None, :], mask=mc, other=0.0)
        if KV8:
            # e4m3 tops out at 448; saturate explicitly rather than trust each conversion path to.
            kf = tl.minimum(tl.maximum(out.to(tl.float32), -448.0), 448.0)
            vf = tl.minimum(tl.maximum(vv.to(tl.float32), -448.0), 448.0)
            tl.store(KC + off, kf.to(KC.dtype.element_ty), mask=mc)
            tl.store(VC + off, vf.to(VC.dtype.element_ty), mask=mc)
        else:
            tl.store(KC + off, out.to(KC.dtype.element_ty), mask=mc)
            tl.store(VC + off, vv.to(VC.dtype.element_ty), mask=mc)

    @triton.jit
    def _decode_attention_kernel(
        Q,
        KC,
        VC,
        Out,
        Pos,
        sm_scale,
        stride_qb,
        stride_cb,
        stride_ch,
        stride_cn,
        max_len,
        H: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_H: tl.constexpr,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        USE_DOT: tl.constexpr,
        IEEE: tl.constexpr,
        KV8: tl.constexpr,
        K_FIRST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_enter(PDL)
        # One program per (row, kv head): the GROUP query heads that share it read its K/V once.
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        length = tl.minimum(tl.load(Pos + b) + 1, max_len)
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < GROUP
        offs_d = tl.arange(0, D)
        heads = kvh * GROUP + offs_h
        q = tl.load(Q + b * stride_qb + heads[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
        if KV8 and USE_DOT:
            # 8-bit K/V widen to float16 in one hardware conversion (to bfloat16 it takes several); q and p
            # follow, to dot with them. float16 holds q exactly enough: its values are normed, far below 65504.
            q = q.to(tl.float16)
        if not USE_DOT:
            q = q.to(tl.float32)
        if K_FIRST:
            # K is the first, row-major operand (s^T = K q^T): the MMA's rows are the tile's tokens and the
            # grouped heads (GROUP, padded to 16) are the narrow side. On an H200 with e4m3 K/V a kernel of this
            # math took 59 us a layer against 65 us with q first (Nsight Compute); in the engine the step's GPU
            # time fell by 2.1-2.5 us a layer.
            qt = tl.trans(q)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        kbase = KC + b * stride_cb + kvh * stride_ch
        vbase = VC + b * stride_cb + kvh * stride_ch
        for start in range(0, length, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            nmask = offs_n < length
            k = tl.load(kbase + offs_n[:, None] * stride_cn + offs_d[None, :], mask=nmask[:, None], other=0.0)
            v = tl.load(vbase + offs_n[:, None] * stride_cn + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if KV8 and USE_DOT:
                # 8-bit K/V: half the bytes from HBM, widened in registers for the dots.
                k = k.to(tl.float16)
                v = v.to(tl.float16)
            if K_FIRST:
                if IEEE:
                    st = tl.dot(k, qt, input_precision="ieee")
                else:
                    st = tl.dot(k, qt)
                st = tl.where(nmask[:, None], st * sm_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(st, axis=0))
                alpha = tl.exp(m_i - m_new)
                pt = tl.exp(st - m_new[None, :])
                l_i = l_i * alpha + tl.sum(pt, axis=0)
                p = tl.trans(pt.to(v.dtype))
                if IEEE:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p, v)
            else:
                if USE_DOT:
                    if IEEE:
                        s = tl.dot(q, tl.trans(k), input_precision="ieee")
                    else:
                        s = tl.dot(q, tl.trans(k))
                else:
                    # GROUP is small (2 for Qwen3-0.6B): CUDA-core dot products, no 16-row padding.
                    s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
                s = tl.where(nmask[None, :], s * sm_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if USE_DOT:
                    if IEEE:
                        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                    else:
                        pv = tl.dot(p.to(v.dtype), v)
                else:
                    pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            Out + b * (H * D) + heads[:, None] * D + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=hmask[:, None],
        )

    @triton.jit
    def _linear_kernel(
        X,
        W,
        Bias,
        Out,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        part_stride,
        up_rows,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GATED: tl.constexpr,
        IEEE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_enter(PDL)
        # Out [M, N] = X [M, K] @ W[:N]^T (+ bias), over program (m, n)'s tile. With SPLIT_K > 1, program k's share
        # of K goes to Out[k] (fp32 partials that add_rmsnorm sums: at M = 256 an [M, 1024] output has too few tiles
        # to fill the GPU, and the reduction costs no launch of its own there). GATED: W is [gate; up] with the up
        # rows from `up_rows`, and Out gets silu(gate) * up, each product rounded as a separate GEMM's would be.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mm = offs_m[:, None] < M
        mn = offs_n[:, None] < N
        k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        xp = X + offs_m[:, None].to(tl.int64) * stride_xm
        wp = W + offs_n[:, None].to(tl.int64) * stride_wn
        for k0 in range(k_lo, tl.minimum(K, k_lo + k_per), BLOCK_K):
            ks = k0 + offs_k
            mk = ks[None, :] < K
            x = tl.load(xp + ks[None, :], mask=mm & mk, other=0.0)
            w = tl.load(wp + ks[None, :], mask=mn & mk, other=0.0)
            # fp32 models: full-precision products, as cuBLAS's fp32 GEMM (tl.dot would round them to TF32).
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            if GATED:
                wu = tl.load(wp + up_rows * stride_wn + ks[None, :], mask=mn & mk, other=0.0)
                if IEEE:
                    acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(x, tl.trans(wu), acc_up)
        mask = mm & (offs_n[None, :] < N)
        ptrs = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        if SPLIT_K > 1:
            tl.store(ptrs + pid_k * part_stride, acc, mask=mask)
        else:
            dt = Out.dtype.element_ty
            if HAS_BIAS:
                acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            if GATED:
                g = acc.to(dt).to(tl.float32)
                u = acc_up.to(dt).to(tl.float32)
                sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
                tl.store(ptrs, (sg * u).to(dt), mask=mask)
            else:
                tl.store(ptrs, acc.to(dt), mask=mask)

    @triton.jit
    def _silu_mul_kernel(GU, Out, n, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        # GU [rows, 2*inter] = [gate | up] (one GEMM); Out [rows, inter] = silu(gate) * up.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        r = offs // inter
        c = offs % inter
        g = tl.load(GU + r * (2 * inter) + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + r * (2 * inter) + inter + c, mask=m, other=0.0).to(tl.float32)
        dt = Out.dtype.element_ty
        sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(Out + offs, (sg * u).to(dt), mask=m)

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
        _pdl_enter(PDL)
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
        _pdl_enter(PDL)
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


def add_rmsnorm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    """residual += x (if given); out = RMSNorm(residual) * weight. All [n, hidden], contiguous; x may also be a
    split-K `linear`'s fp32 partials [parts, n, hidden], summed here."""
    n, hidden = residual.shape
    parts = x.shape[0] if x is not None and x.dim() == 3 else 1
    _rmsnorm(x if x is not None else residual, residual, weight, eps, out, n * hidden, residual,
             has_x=x is not None, parts=parts, embed=False)  # fmt: skip


def embed_rmsnorm(
    ids: torch.Tensor, table: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    """residual = table[ids] (F.embedding); out = RMSNorm(residual) * weight, in one launch. ids [n] (valid ids:
    nothing checks them on the device), table [vocab, hidden] contiguous, residual and out [n, hidden]."""
    hidden = residual.shape[1]
    if table.shape[1] != hidden or not table.is_contiguous():
        raise ValueError(f"embed_rmsnorm: the table must be contiguous [vocab, {hidden}], got {tuple(table.shape)}")
    _rmsnorm(table, residual, weight, eps, out, 0, ids, has_x=False, parts=1, embed=True)


def _rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    part_stride: int,
    ids: torch.Tensor,
    *,
    has_x: bool,
    parts: int,
    embed: bool,
) -> None:
    n, hidden = residual.shape
    _add_rmsnorm_kernel[(n,)](
        x,
        residual,
        weight,
        out,
        eps,
        hidden,
        part_stride,
        ids,
        HAS_X=has_x,
        PARTS=parts,
        EMBED=embed,
        BLOCK=_next_pow2(hidden),
        num_warps=4 if hidden <= 2048 else 8,
        **_pdl(residual),
    )


def qk_norm_rope_store(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    first_slot: int = 0,
    rows_per_slot: int = 1,
    store_k: bool = False,
) -> None:
    """qkv [n, (H + 2*KVH) * D] (one GEMM's output), rope: the cos and sin tables [positions, D], contiguous: q
    gets QK-norm + RoPE (row min(positions[b], len - 1) of the tables) in place; k (normed, roped) and v of row
    b go to cache slot first_slot + b // rows_per_slot at positions[b]. `store_k` also writes the normed, roped
    k back into qkv (a prefill attends over it)."""
    n = qkv.shape[0]
    has_norm = q_norm is not None
    cos, sin = rope
    if cos.shape != sin.shape or cos.shape[1] != head_dim or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(
            f"qk_norm_rope_store: the RoPE tables must be contiguous [positions, {head_dim}], "
            f"got cos {tuple(cos.shape)} and sin {tuple(sin.shape)}"
        )
    _qk_norm_rope_store_kernel[(n,)](
        qkv,
        q_norm if has_norm else qkv,
        k_norm if has_norm else qkv,
        cos,
        sin,
        positions,
        k_cache,
        v_cache,
        eps,
        qkv.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[2],
        cos.shape[0],
        first_slot,
        rows_per_slot,
        H=num_heads,
        KVH=num_kv_heads,
        HP=_next_pow2(num_heads),
        KP=_next_pow2(num_kv_heads),
        D=head_dim,
        HAS_NORM=has_norm,
        KV8=k_cache.element_size() == 1,
        STORE_K=store_k,
        num_warps=4,
        **_pdl(qkv),
    )


def layer_qk_norm_rope_store(
    attn: Any,
    args: Any,
    qkv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    **placement: Any,
) -> None:
    """`qk_norm_rope_store` for one layer's attention module `attn` of a model with ModelArgs `args` (its QK-norm
    weights when it has them); `placement`: first_slot, rows_per_slot, store_k."""
    qk_norm = bool(args.qk_norm)
    qk_norm_rope_store(
        qkv,
        attn.q_norm.weight if qk_norm else None,
        attn.k_norm.weight if qk_norm else None,
        rope,
        positions,
        k_cache,
        v_cache,
        attn.q_norm.eps if qk_norm else 0.0,
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        **placement,
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    config: tuple[int, ...] | None = None,
) -> None:
    """out[b] = softmax(q[b] K[b, :len_b]^T * scale) V[b, :len_b] with len_b = positions[b] + 1.

    q: rows of H*D values with any row stride (a view of the fused QKV output); out: [n, H*D] contiguous.
    config: (BLOCK_N, num_warps, num_stages, use_dot); use_dot 0: CUDA-core dot products, 1: tensor-core dots
    with q as the first operand, 2: with K first (s^T = K q^T).
    """
    n = q.shape[0]
    group = num_heads // num_kv_heads
    config = config or (SETTINGS.attn_config_kv8 if k_cache.element_size() == 1 else SETTINGS.attn_config)
    block_n, warps, stages, use_dot = config + (1,) * (4 - len(config))
    if use_dot not in (0, 1, 2):
        raise ValueError(f"decode_attention config {config}: use_dot (the 4th value) must be 0, 1 or 2")
    _decode_attention_kernel[(n, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        positions,
        scale,
        q.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[2],
        H=num_heads,
        GROUP=group,
        # tl.dot needs M >= 16: with it the grouped heads are padded to 16 rows.
        BLOCK_H=max(16, _next_pow2(group)) if use_dot else _next_pow2(group),
        D=head_dim,
        BLOCK_N=block_n if head_dim <= 128 else min(block_n, 32),
        USE_DOT=bool(use_dot),
        IEEE=q.dtype == torch.float32,
        KV8=k_cache.element_size() == 1,
        K_FIRST=use_dot == 2,
        num_warps=warps,
        num_stages=stages,
        **_pdl(q),
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, ...],
    gated: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias), as F.linear, on Triton tiles; config = (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
    num_warps, num_stages). SPLIT_K > 1 returns fp32 partials [SPLIT_K, M, N] for `add_rmsnorm` to sum (no
    bias then). gated: weight is [gate; up] (2I rows) and the result is silu(x @ gate.T) * (x @ up.T), [M, I]."""
    bm, bn, bk, split, warps, stages = config
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if split > 1 and (bias is not None or gated):
        raise ValueError(f"linear: SPLIT_K {split} returns partial products, which take no bias or gate; use 1")
    if split > 1:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        n,
        m * n,
        n,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=split,
        HAS_BIAS=bias is not None,
        GATED=gated,
        IEEE=x.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
        **_pdl(x),
    )
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out [n, I] = silu(gate_up[:, :I]) * gate_up[:, I:]."""
    n = out.numel()
    block = 1024
    _silu_mul_kernel[(triton.cdiv(n, block),)](gate_up, out, n, out.shape[1], BLOCK=block, num_warps=4, **_pdl(out))


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
    block, warps, draw_block, draw_warps = _sample_config(config or SETTINGS.sample_config)
    block = min(block, _next_pow2(vocab), SAMPLE_CHUNK_IDS)
    chunks = triton.cdiv(vocab, SAMPLE_CHUNK_IDS)
    # A vocabulary of one chunk (tiny models) is scanned to its next power of two, not 4096 ids.
    chunk = min(SAMPLE_CHUNK_IDS, max(block, _next_pow2(vocab)))
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
        **_pdl(logits),
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
        SP=_next_pow2(chunks),
        CHUNK=chunk,
        CHUNK_COUNTER=CHUNK_COUNTER,
        BLOCK=min(draw_block, chunk),
        UPDATE=update,
        LP_ROWS=logprob_rows,
        FAST_LOG=nvidia_compiled(),  # a Triton launch on CPU tensors is the interpreter, where this is False
        num_warps=draw_warps,
        **_pdl(logits),
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
