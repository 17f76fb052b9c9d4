"""Triton kernels for the batch-invariant forward on CUDA: GEMM (+ residual), RMSNorm, QK-norm + RoPE, attention,
SwiGLU, log-softmax.

The plain-torch invariant forward (`hpcrl.model.invariant`) is launch-bound on a GPU: every GEMM is a loop of
16-row products, RMSNorm a tree of ten elementwise adds, RoPE eight elementwise ops per projection, and
attention walks key tiles in Python with about thirty launches per tile and a host sync for the length. These
kernels do each in one launch, and keep what makes the forward batch-invariant:

- One program computes one fixed-size output tile (GEMM, `SETTINGS.matmul`), one row (RMSNorm, log-softmax), one
  (row, head) pair (QK-norm + RoPE) or one (row, kv head) pair (attention). The GEMM walks K from 0 without
  split-K and its tile never depends on M, so a row's products are the same instructions in any batch. The
  others read only their own row and, for attention, the keys 0..its own position; nothing depends on the other
  rows, on how many there are, or on how long the key buffer is. So a token's bits are the same decoded alone,
  decoded beside 255 others, or scored by the trainer inside a padded micro-batch.
- Every reduction has one fixed shape: RMSNorm sums one [BLOCK] vector; attention walks key tiles from key 0 in
  order with a running max and sum, its q.k and p.v as `tl.dot`s of the row's query heads (a [16, D] block)
  against each tile; the log-softmax sums one [BLOCK] accumulator. A key tile past the row's position is never
  visited, and the tail of its last tile is masked.
- Positions are read from device memory: a decode step has no host sync and is captured in a CUDA graph.

The engine and the trainer call these same kernels with the same compile-time parameters, so both sides
run the same instructions per row. Their layouts are kept alike too (K and V contiguous in their last two
dimensions on both sides), since Triton picks a reduction's thread layout from the tensors' contiguity.
The backward (training) uses standard torch: only the forward's values must match the engine's.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from hpcrl.model.invariant_config import ATTENTION_DEFAULT, InvariantKernelsConfig

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU installs: the invariant forward runs its plain-torch path
    triton = None
    tl = None
    AVAILABLE = False

KV_TILE = ATTENTION_DEFAULT[0]
"""Keys per attention tile: the plain-torch path's, and the attention kernel's default (`SETTINGS.attention`)."""


def usable(x: Tensor, head_dim: int | None = None) -> bool:
    """True when these kernels can run on x: Triton, a CUDA tensor (or Triton's interpreter, which the CPU tests
    use), and for the per-head kernels (QK-norm + RoPE, attention) a power-of-two `head_dim` of at least 16."""
    device_ok = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    head_ok = head_dim is None or (head_dim >= 16 and head_dim & (head_dim - 1) == 0)
    return AVAILABLE and device_ok and head_ok


SETTINGS = InvariantKernelsConfig()
"""The tiles this process launches with (`configure`): the engine's engine.kernels.invariant_*, the trainer's
train.invariant_kernels, each with its HPCRL_INVARIANT_* overrides applied. Fixed for the process, never chosen
from the batch, so a row's products run the same instructions at any batch size."""


def configure(settings: InvariantKernelsConfig) -> None:
    """Launch every batch-invariant kernel of this process with `settings` (process-wide, like the CUDA graphs that
    capture the engine's invariant decode step)."""
    global SETTINGS
    SETTINGS = settings


def launch_config() -> InvariantKernelsConfig:
    """The tiles the next launch uses: `SETTINGS.matmul` for every GEMM, `SETTINGS.attention` for the attention."""
    return SETTINGS


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if AVAILABLE:

    @triton.jit
    def _rms_norm_kernel(X, W, Out, eps, N, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        # The cast points of transformers' RMSNorm: normalise in fp32, cast to the model dtype, scale.
        h = (x * (1.0 / tl.sqrt_rn(var + eps))).to(Out.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Out + row * N + offs, (w * h).to(Out.dtype.element_ty), mask=m)

    @triton.jit
    def _qk_norm_rope_kernel(X, W, Cos, Sin, Out, eps, stride_xr, stride_xh, HAS_NORM: tl.constexpr, D: tl.constexpr):
        # One (row, head): the head's RMSNorm (QK-norm) and RoPE from the row's fp32 cos/sin, in one pass.
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        HALF: tl.constexpr = D // 2
        d = tl.arange(0, D)
        dr = (d + HALF) % D
        dt = Out.dtype.element_ty
        base = X + r * stride_xr + h * stride_xh
        x = tl.load(base + d).to(tl.float32)
        xr = tl.load(base + dr).to(tl.float32)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
            x = (tl.load(W + d).to(tl.float32) * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xr = (tl.load(W + dr).to(tl.float32) * (xr * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        cos = tl.load(Cos + r * D + d)
        sin = tl.load(Sin + r * D + d)
        sign = tl.where(d < HALF, -1.0, 1.0)
        tl.store(Out + (r * tl.num_programs(1) + h) * D + d, (x * cos + sign * xr * sin).to(dt))

    @triton.jit
    def _attention_kernel(
        Q, K, V, Out, RowBatch, RowPos, scale, window,
        stride_qr, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        G: tl.constexpr, QP: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # One (query row, kv head): the row's G query heads of that kv head as the rows of one [QP, D] block (zero
        # rows up to QP, tl.dot's minimum), so each key tile is read once for all of them, in one pass: a running
        # max and rescale, tile after tile from key 0. A head's scores and output come from its own q row only.
        r = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        b = tl.load(RowBatch + r).to(tl.int64)
        pos = tl.load(RowPos + r).to(tl.int64)
        g = tl.arange(0, QP)
        d = tl.arange(0, D)
        n = tl.arange(0, TILE)
        heads = kvh * G + g
        real = g < G
        q = tl.load(Q + r * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=real[:, None], other=0.0)
        kb = K + b * stride_kb + kvh * stride_kh
        vb = V + b * stride_vb + kvh * stride_vh
        m = tl.full([QP], float("-inf"), tl.float32)
        total = tl.zeros([QP], tl.float32)
        acc = tl.zeros([QP, D], tl.float32)
        # Tiles from the one holding the row's oldest key in its window (key 0 without one) up to its own position;
        # keys outside are masked. The first visited tile holds a visible key, so the running max is finite from it
        # on. Which tiles a row visits depends on its position alone, never on the batch.
        oldest = tl.maximum(pos - window + 1, 0)
        for t in range(oldest // TILE, pos // TILE + 1):
            keys = t * TILE + n
            seen = (keys <= pos) & (keys >= oldest)
            k = tl.load(kb + keys[:, None] * stride_kn + d[None, :], mask=seen[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(seen[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(vb + keys[:, None] * stride_vn + d[None, :], mask=seen[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        o = acc / total[:, None]
        out_at = Out + (r * tl.num_programs(1) * G + heads[:, None]) * D + d[None, :]
        tl.store(out_at, o.to(Out.dtype.element_ty), mask=real[:, None])

    @triton.jit
    def _store_kv_kernel(
        Kn, Vn, KC, VC, Pos, stride_kr, stride_kh, stride_vr, stride_vh, stride_cb, stride_ch, stride_cn,
        D: tl.constexpr,
    ):  # fmt: skip
        # One (row, kv head) of a decode step: its new K and V rows into cache slot `row` at the row's position.
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        pos = tl.load(Pos + r).to(tl.int64)
        d = tl.arange(0, D)
        at = r * stride_cb + h * stride_ch + pos * stride_cn + d
        tl.store(KC + at, tl.load(Kn + r * stride_kr + h * stride_kh + d))
        tl.store(VC + at, tl.load(Vn + r * stride_vr + h * stride_vh + d))

    @triton.jit
    def _matmul_kernel(
        X, W, Out, Res, M, N, K, stride_xm, stride_wn, stride_om, stride_rm, IEEE: tl.constexpr,
        HAS_RES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        # Out[M, N] = X[M, K] @ W[N, K].T (+ Res). One program per [BM, BN] output tile; K walked in BK steps
        # from 0, never split: an output element's sum has one order, whatever M is and wherever its row sits.
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (pn * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            x = tl.load(
                X + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
            )
            w = tl.load(
                W + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0
            )
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        dt = Out.dtype.element_ty
        out = acc.to(dt)
        inside = (rm[:, None] < M) & (rn[None, :] < N)
        if HAS_RES:
            # The residual stream's add, as torch adds two tensors of the model dtype: the product rounded to
            # the dtype first, the sum in fp32, rounded once more. It saves a launch and a pass per layer.
            res = tl.load(Res + rm[:, None] * stride_rm + rn[None, :], mask=inside, other=0.0)
            out = (res.to(tl.float32) + out.to(tl.float32)).to(dt)
        tl.store(Out + rm[:, None] * stride_om + rn[None, :], out, mask=inside)

    @triton.jit
    def _silu_mul_kernel(G, U, Out, N, stride_g, stride_u, BLOCK: tl.constexpr):
        # One [BLOCK] piece of a row: silu(gate) * up with torch's cast points (silu in fp32, rounded to the
        # dtype, then the product in fp32, rounded): what F.silu(gate) * up does in two launches.
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        dt = Out.dtype.element_ty
        g = tl.load(G + r * stride_g + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + r * stride_u + offs, mask=m, other=0.0).to(tl.float32)
        sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(Out + r * N + offs, (sg * u).to(dt), mask=m)

    @triton.jit
    def _log_softmax_kernel(X, Out, V, stride_x, BLOCK: tl.constexpr):
        # One row: its exact max, then exp(x - max) summed into a [BLOCK] accumulator chunk by chunk from
        # vocab id 0 and reduced once, then x - max - log(sum). Nothing depends on the number of rows.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK):
            x = tl.load(X + row * stride_x + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
            mx = tl.maximum(mx, x)
        m = tl.max(mx, axis=0)
        total = tl.zeros([BLOCK], tl.float32)
        for v0 in range(0, V, BLOCK):
            x = tl.load(X + row * stride_x + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
            total += tl.where(v0 + offs < V, tl.exp(x - m), 0.0)
        lse = m + tl.log(tl.sum(total, axis=0))
        for v0 in range(0, V, BLOCK):
            x = tl.load(X + row * stride_x + v0 + offs, mask=v0 + offs < V, other=0.0).to(tl.float32)
            tl.store(Out + row * V + v0 + offs, x - lse, mask=v0 + offs < V)


LOG_SOFTMAX_BLOCK = 2048


def matmul(x: Tensor, w: Tensor, residual: Tensor | None = None) -> Tensor:
    """x [M, K] @ w.T (w [N, K], an nn.Linear weight) on fixed tiles without split-K; the result in x's dtype.
    fp32 inputs multiply in IEEE fp32 (no TF32). `residual` [M, N] is added to the rounded product in the same
    launch, with the bits of `residual + product` in torch."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    if residual is not None and (residual.shape != (m, n) or residual.stride(-1) != 1):
        raise ValueError(f"matmul: a residual of shape {tuple(residual.shape)} for a [{m}, {n}] product")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res = out if residual is None else residual
    bm, bn, bk, warps, stages = SETTINGS.matmul
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _matmul_kernel[grid](
        x, w, out, res, m, n, k, x.stride(0), w.stride(0), out.stride(0), res.stride(0),
        IEEE=x.dtype == torch.float32, HAS_RES=residual is not None, BM=bm, BN=bn, BK=bk, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for gate, up [M, I] (rows may be strided views of one [gate | up] product), one launch;
    the result in gate's dtype."""
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("silu_mul needs gate and up contiguous in their last dimension")
    rows, n = gate.shape
    out = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    if rows == 0:
        return out
    block = min(1024, _next_pow2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=block, num_warps=4
    )
    return out


def log_softmax(x: Tensor) -> Tensor:
    """fp32 log-softmax over the last dim of x [..., V], one program per row."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    _log_softmax_kernel[(rows.shape[0],)](rows, out, shape[-1], rows.stride(0), BLOCK=LOG_SOFTMAX_BLOCK, num_warps=8)
    return out.view(shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of x (any leading shape), one program per row; the result in x's dtype."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n = shape[-1]
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out, eps, n, rows.stride(0), BLOCK=_next_pow2(n), num_warps=4 if n <= 2048 else 8
    )
    return out.view(shape)


def qk_norm_rope(x: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """x [R, H, D] (one projection's heads): RMSNorm per head (when `weight` is given), then RoPE with the rows'
    fp32 cos and sin [R, D]. Returns a new [R, H, D] tensor in x's dtype."""
    rows, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, heads, d, dtype=x.dtype, device=x.device)
    _qk_norm_rope_kernel[(rows, heads)](
        x, weight if weight is not None else x, cos, sin, out, eps, x.stride(0), x.stride(1),
        HAS_NORM=weight is not None, D=d, num_warps=1,
    )  # fmt: skip
    return out


def attention(
    q: Tensor, k: Tensor, v: Tensor, row_batch: Tensor, row_pos: Tensor, scale: float, window: int | None = None
) -> Tensor:
    """Causal attention of query rows q [R, H, D] against k, v [B, KVH, L, D] (last dim contiguous).

    Row r belongs to sequence row_batch[r] and sits at position row_pos[r]; it sees keys 0..row_pos[r], or within
    a sliding window only the keys row_pos[r] - window + 1..row_pos[r].
    Returns [R, H, D] in q's dtype.
    """
    rows, heads, d = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("attention needs K and V contiguous in their last dimension")
    out = torch.empty(rows, heads, d, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    kv_heads = k.shape[1]
    group = heads // kv_heads
    tile, warps, stages = SETTINGS.attention
    _attention_kernel[(rows, kv_heads)](
        q, k, v, out, row_batch, row_pos, scale, min(window or k.shape[2], k.shape[2]),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        G=group, QP=max(16, _next_pow2(group)), D=d, TILE=tile, IEEE=q.dtype == torch.float32, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor) -> None:
    """A decode step's new rows k, v [n, KVH, D] into cache slots 0..n-1 of k_cache, v_cache [slots, KVH, L, D]
    (one layer's views, alike in strides) at `positions` [n], in one launch."""
    n, kv_heads, d = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("store_kv needs rows and caches contiguous in their last dimension, the caches alike")
    if n == 0:
        return
    _store_kv_kernel[(n, kv_heads)](
        k, v, k_cache, v_cache, positions, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), D=d, num_warps=1,
    )  # fmt: skip
