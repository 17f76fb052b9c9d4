"""RMSNorm kernels (with the residual add or the embedding lookup) and the per-head QK-norm + RoPE + K/V cache
write of the decode step."""

from __future__ import annotations

from typing import Any

import torch

from hpcrl.engine.embedded.kernels.launch import AVAILABLE, next_pow2, pdl_args, pdl_enter, tl, triton

if AVAILABLE:

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
        pdl_enter(PDL)
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
        pdl_enter(PDL)
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
        BLOCK=next_pow2(hidden),
        num_warps=4 if hidden <= 2048 else 8,
        **pdl_args(residual),
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
        HP=next_pow2(num_heads),
        KP=next_pow2(num_kv_heads),
        D=head_dim,
        HAS_NORM=has_norm,
        KV8=k_cache.element_size() == 1,
        STORE_K=store_k,
        num_warps=4,
        **pdl_args(qkv),
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
