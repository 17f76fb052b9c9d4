"""The decode step's attention kernel: one query token per row against its own K/V cache length."""

from __future__ import annotations

import torch

from hpcrl.engine.embedded.kernels import launch
from hpcrl.engine.embedded.kernels.launch import AVAILABLE, next_pow2, pdl_args, pdl_enter, tl, triton

if AVAILABLE:

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
        window,
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
        pdl_enter(PDL)
        # One program per (row, kv head): the GROUP query heads that share it read its K/V once.
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        length = tl.minimum(tl.load(Pos + b) + 1, max_len)
        # A sliding window: the keys at positions first..length-1 (window >= max_len: all of them).
        first = tl.maximum(length - window, 0)
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
        for start in range(first, length, BLOCK_N):
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
    window: int | None = None,
) -> None:
    """out[b] = softmax(q[b] K[b, :len_b]^T * scale) V[b, :len_b] with len_b = positions[b] + 1, or over the last
    `window` of those keys (K[b, len_b - window:len_b]) for a layer with a sliding window.

    q: rows of H*D values with any row stride (a view of the fused QKV output); out: [n, H*D] contiguous.
    config: (BLOCK_N, num_warps, num_stages, use_dot); use_dot 0: CUDA-core dot products, 1: tensor-core dots
    with q as the first operand, 2: with K first (s^T = K q^T).
    """
    n = q.shape[0]
    group = num_heads // num_kv_heads
    config = config or (launch.SETTINGS.attn_config_kv8 if k_cache.element_size() == 1 else launch.SETTINGS.attn_config)
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
        min(window, k_cache.shape[2]) if window else k_cache.shape[2],
        H=num_heads,
        GROUP=group,
        # tl.dot needs M >= 16: with it the grouped heads are padded to 16 rows.
        BLOCK_H=max(16, next_pow2(group)) if use_dot else next_pow2(group),
        D=head_dim,
        BLOCK_N=block_n if head_dim <= 128 else min(block_n, 32),
        USE_DOT=bool(use_dot),
        IEEE=q.dtype == torch.float32,
        KV8=k_cache.element_size() == 1,
        K_FIRST=use_dot == 2,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(q),
    )
