"""Where the 8-bit decode-attention kernel's time goes: variants that leave a stage out or do it another way.

    PYTHONPATH=. python3 tools/gpu/attention_kv8_variants.py [--batch 256] [--attn-len 384] [--only NAME,...]

Qwen3-0.6B's attention shape (16 heads, 8 KV heads, head_dim 128), one layer, every row at the same length. Each
figure is device time per launch from CUDA-graph replays rotating through several K/V copies (as the engine's graphs
run it: events around one eager launch also time Triton's host-side launch, tens of microseconds). Variants, one
program per (row, KV head) unless said:

- `engine`, `engine_bf16`: the engine's kernel (`kernels.decode_attention`), q the first dot operand (use_dot 1);
- `engine_kfirst`, `engine_kfirst_bf16`: the engine's kernel with K first (use_dot 2, the 8-bit default);
  `engine_kfirst_nopdl` (not by default): the same launched without programmatic dependent launch;
- `floor`, `floor_bf16`: the same loads only (K and V as int32 words, xor-summed): what this access pattern reaches;
- `load_cvt`: the loads plus the e4m3 -> float16 widening, summed: what the conversion adds;
- `k_first`: this script's own kernel with s^T = K q^T and out = (p^T)^T V (what the engine's use_dot 2 became);
- `kv_first`: as `k_first`, and out^T = V^T p^T with V stored transposed ([D, len] a head), read along tokens;
- `vt_tiles` (not by default): as `k_first`, with V stored tile-transposed (each BLOCK_N tokens of a head one
  contiguous [D, BLOCK_N] tile), so the widened V needs no transpose for the MMA; `vt_tiles_a`: the same tiles
  as the first operand (out^T = V^T p^T);
- `splitN` (not by default): flash-decoding, each row's length in N spans of programs of their own, merged by a
  second kernel;
- `persistN` (not by default): N programs per multiprocessor, each looping over every P-th (row, KV head): no
  partial last wave;
- `cvt_vt` (not by default): the float16 dots with V stored transposed ([D, len] a head), V the K-major operand;
- `mma8` (not by default): no widening: q and p split into two e4m3 parts each (hi + lo, ~8 bits together) and
  both dots e4m3 x e4m3 MMAs on the 8-bit K and transposed V;
- `mma8_qk` (not by default): only q.K in e4m3 (q hi + lo), p.V widened as in the engine.

Prints ms, GB/s of K/V read and, for the attention variants, ||out - ref|| / ||ref|| against float32 SDPA on
the same (dequantised) values. Configs: BLOCK_N, num_warps, num_stages.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from decode_microbench import graph_ms  # noqa: E402 - a sibling script: this folder is on sys.path when run

from hpcrl.engine.embedded import kernels  # noqa: E402

DEFAULT = ("engine", "engine_kfirst", "floor", "load_cvt", "k_first")


@triton.jit
def _loads_kernel(KC, VC, Out, Pos, stride_cb, stride_ch, stride_cn, max_len, KVH: tl.constexpr, W: tl.constexpr,
                  BLOCK_N: tl.constexpr, WIDEN: tl.constexpr):  # fmt: skip
    # The attention kernel's loads and nothing else: W words of each K/V row, xor-summed (`floor`), or, with WIDEN,
    # the W e4m3 values of a row widened to float16 and summed (`load_cvt`).
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    length = tl.minimum(tl.load(Pos + b) + 1, max_len)
    offs_w = tl.arange(0, W)
    acc = tl.zeros([BLOCK_N, W], tl.float16 if WIDEN else tl.int32)
    kbase = KC + b * stride_cb + kvh * stride_ch
    vbase = VC + b * stride_cb + kvh * stride_ch
    for start in range(0, length, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < length
        kp = kbase + offs_n[:, None] * stride_cn + offs_w[None, :]
        vp = vbase + offs_n[:, None] * stride_cn + offs_w[None, :]
        if WIDEN:
            k = tl.load(kp, mask=nmask[:, None], other=0.0)
            v = tl.load(vp, mask=nmask[:, None], other=0.0)
            acc += k.to(tl.float16) + v.to(tl.float16)
        else:
            acc += tl.load(kp, mask=nmask[:, None], other=0) ^ tl.load(vp, mask=nmask[:, None], other=0)
    tl.store(Out + (b * KVH + kvh) * W + offs_w, tl.sum(acc.to(tl.float32) if WIDEN else acc, axis=0))


@triton.jit
def _load_q(Q, b, kvh, stride_qb, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr):
    # The GROUP query heads of KV head kvh in row b, padded to BLOCK_H rows of zeros (tl.dot needs 16).
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    heads = kvh * GROUP + offs_h
    return tl.load(Q + b * stride_qb + heads[:, None] * D + offs_d[None, :], mask=(offs_h < GROUP)[:, None], other=0.0)


@triton.jit
def _attn_variant_kernel(
    Q, KC, VC, Out, Pos, sm_scale, stride_qb, stride_cb, stride_ch, stride_cn, stride_vd, stride_vn, max_len,
    H: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    QK8: tl.constexpr, PV8: tl.constexpr, V_T: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    length = tl.minimum(tl.load(Pos + b) + 1, max_len)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < GROUP
    offs_d = tl.arange(0, D)
    heads = kvh * GROUP + offs_h
    q = _load_q(Q, b, kvh, stride_qb, GROUP, BLOCK_H, D)
    qf = q.to(tl.float32)
    if QK8:
        # q as hi + lo e4m3 parts, scaled per head so its largest entry is 224: ~8 bits together, as bf16 has.
        qmax = tl.maximum(tl.max(tl.abs(qf), axis=1), 1e-20)
        qscale = 224.0 / qmax
        qs = qf * qscale[:, None]
        q_hi = qs.to(tl.float8e4nv)
        q_lo = (qs - q_hi.to(tl.float32)).to(tl.float8e4nv)
        s_scale = sm_scale / qscale
    else:
        q16 = qf.to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    kbase = KC + b * stride_cb + kvh * stride_ch
    vbase = VC + b * stride_cb + kvh * stride_ch
    for start in range(0, length, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < length
        k = tl.load(kbase + offs_n[:, None] * stride_cn + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if QK8:
            kt = tl.trans(k)
            s = tl.dot(q_lo, kt, acc=tl.dot(q_hi, kt)) * s_scale[:, None]
        else:
            s = tl.dot(q16, tl.trans(k.to(tl.float16))) * sm_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_T:
            vt = tl.load(vbase + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn, mask=nmask[None, :],
                         other=0.0)  # fmt: skip
            v = tl.trans(vt)
        else:
            v = tl.load(vbase + offs_n[:, None] * stride_cn + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if PV8:
            ps = p * 256.0
            p_hi = ps.to(tl.float8e4nv)
            p_lo = (ps - p_hi.to(tl.float32)).to(tl.float8e4nv)
            pv = tl.dot(p_lo, v, acc=tl.dot(p_hi, v)) * (1.0 / 256.0)
        else:
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + b * (H * D) + heads[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=hmask[:, None])  # fmt: skip


@triton.jit
def _attend_span(Q, KC, VC, b, kvh, lo, hi, sm_scale, stride_qb, stride_cb, stride_ch, stride_cn,
                 GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    # The engine kernel's loop over [lo, hi) of one (row, KV head), K/V widened to float16: unnormalised.
    offs_d = tl.arange(0, D)
    q = _load_q(Q, b, kvh, stride_qb, GROUP, BLOCK_H, D).to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    kbase = KC + b * stride_cb + kvh * stride_ch
    vbase = VC + b * stride_cb + kvh * stride_ch
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        k = tl.load(kbase + offs_n[:, None] * stride_cn + offs_d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(vbase + offs_n[:, None] * stride_cn + offs_d[None, :], mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float16)))
        s = tl.where(nmask[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A span with no tokens yet (m_new -inf) must add nothing: exp(-inf - -inf) would be NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_split_kernel(Q, KC, VC, PO, PML, Pos, sm_scale, stride_qb, stride_cb, stride_ch, stride_cn, max_len,
                       H: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPANS: tl.constexpr):  # fmt: skip
    # Flash-decoding: span `sp` of each row's length in a program of its own; partials merged by _combine_kernel.
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    length = tl.minimum(tl.load(Pos + b) + 1, max_len)
    span = tl.cdiv(tl.cdiv(length, SPANS), BLOCK_N) * BLOCK_N
    lo = sp * span
    hi = tl.minimum(length, lo + span)
    acc, m_i, l_i = _attend_span(Q, KC, VC, b, kvh, lo, hi, sm_scale, stride_qb, stride_cb, stride_ch, stride_cn,
                                 GROUP, BLOCK_H, D, BLOCK_N)  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    heads = kvh * GROUP + offs_h
    hmask = offs_h < GROUP
    part = (b * H + heads) * SPANS + sp
    tl.store(PO + part[:, None] * D + offs_d[None, :], acc, mask=hmask[:, None])
    tl.store(PML + part * 2, m_i, mask=hmask)
    tl.store(PML + part * 2 + 1, l_i, mask=hmask)


@triton.jit
def _combine_kernel(PO, PML, Out, H: tl.constexpr, D: tl.constexpr, SPANS: tl.constexpr, SP2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * H + head
    offs_s = tl.arange(0, SP2)
    smask = offs_s < SPANS
    offs_d = tl.arange(0, D)
    m = tl.load(PML + (row * SPANS + offs_s) * 2, mask=smask, other=float("-inf"))
    l_s = tl.load(PML + (row * SPANS + offs_s) * 2 + 1, mask=smask, other=0.0)
    mm = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - mm))
    acc = tl.load(PO + (row * SPANS + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_s, axis=0)
    tl.store(Out + row * D + offs_d, out.to(Out.dtype.element_ty))


@triton.jit
def _attn_persistent_kernel(Q, KC, VC, Out, Pos, sm_scale, stride_qb, stride_cb, stride_ch, stride_cn, max_len,
                            total, KVH: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                            D: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    # As many programs as fit on the device at once, each taking every P-th (row, KV head): no partial last wave.
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        b = tl.cast(w // KVH, tl.int64)
        kvh = tl.cast(w % KVH, tl.int64)
        length = tl.minimum(tl.load(Pos + b) + 1, max_len)
        acc, m_i, l_i = _attend_span(Q, KC, VC, b, kvh, 0, length, sm_scale, stride_qb, stride_cb, stride_ch,
                                     stride_cn, GROUP, BLOCK_H, D, BLOCK_N)  # fmt: skip
        heads = kvh * GROUP + offs_h
        tl.store(Out + b * (H * D) + heads[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(
            Out.dtype.element_ty), mask=(offs_h < GROUP)[:, None])  # fmt: skip


@triton.jit
def _attn_kt_kernel(Q, KC, VC, Out, Pos, sm_scale, stride_qb, stride_cb, stride_ch, stride_cn, stride_vd, stride_vn,
                    stride_vs, max_len, H: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                    D: tl.constexpr, BLOCK_N: tl.constexpr, V_T: tl.constexpr, V_FIRST: tl.constexpr):  # fmt: skip
    # K as the dots' first, row-major operand: the MMA rows are the tile's tokens and the 8-bit tiles are read along
    # their contiguous dimension; only q's 2 heads are padded, as the narrow side. With V_T, V is stored transposed
    # and read as [D, BLOCK_N] tiles at VC + start * stride_vs + d * stride_vd + t * stride_vn: a head's [D, len]
    # (`kv_first`), or tile-transposed, each BLOCK_N tokens one contiguous [D, BLOCK_N] tile (`vt_tiles`): an 8-bit
    # MMA operand must be K-major, and for p.V K is the tokens, so V [tokens, D] is transposed on chip every step
    # and a [D, tokens] tile is not. V_FIRST: out^T = V^T p^T (V^T the first operand), else out = p (V^T)^T.
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    length = tl.minimum(tl.load(Pos + b) + 1, max_len)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < GROUP
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_h
    q = _load_q(Q, b, kvh, stride_qb, GROUP, BLOCK_H, D)
    qt = tl.trans(q.to(tl.float16))  # [D, BLOCK_H]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    TRANSPOSED_OUT: tl.constexpr = V_T and V_FIRST
    if TRANSPOSED_OUT:
        acc = tl.zeros([D, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, D], tl.float32)
    kbase = KC + b * stride_cb + kvh * stride_ch
    vbase = VC + b * stride_cb + kvh * stride_ch  # every layout holds a head's K/V in the same number of bytes
    for start in range(0, length, BLOCK_N):
        offs_n = start + offs_t
        nmask = offs_n < length
        k = tl.load(kbase + offs_n[:, None] * stride_cn + offs_d[None, :], mask=nmask[:, None], other=0.0)
        st = tl.dot(k.to(tl.float16), qt)  # [BLOCK_N, BLOCK_H]
        st = tl.where(nmask[:, None], st * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, axis=0))
        alpha = tl.exp(m_i - m_new)
        pt = tl.exp(st - m_new[None, :])
        l_i = l_i * alpha + tl.sum(pt, axis=0)
        if V_T:
            vt = tl.load(vbase + start * stride_vs + offs_d[:, None] * stride_vd + offs_t[None, :] * stride_vn,
                         mask=nmask[None, :], other=0.0)  # fmt: skip
            if V_FIRST:
                acc = acc * alpha[None, :] + tl.dot(vt.to(tl.float16), pt.to(tl.float16))
            else:
                acc = acc * alpha[:, None] + tl.dot(tl.trans(pt.to(tl.float16)), tl.trans(vt.to(tl.float16)))
        else:
            v = tl.load(vbase + offs_n[:, None] * stride_cn + offs_d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(tl.trans(pt.to(tl.float16)), v.to(tl.float16))
        m_i = m_new
    if TRANSPOSED_OUT:
        out = acc / l_i[None, :]
        tl.store(Out + b * (H * D) + heads[None, :] * D + offs_d[:, None], out.to(Out.dtype.element_ty),
                 mask=hmask[None, :])  # fmt: skip
    else:
        out = acc / l_i[:, None]
        tl.store(Out + b * (H * D) + heads[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=hmask[:, None])  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--attn-len", type=int, default=384)
    p.add_argument("--only", default="", help=f"comma-separated variant names (default: {','.join(DEFAULT)})")
    p.add_argument("--configs", default="", help="BLOCK_N,warps,stages;... (default: 32/64/128 x 2/4/8 x 2/3/4)")
    p.add_argument("--copies", type=int, default=4, help="K/V caches the timed launches rotate through (L2 misses)")
    p.add_argument("--slots", type=int, default=0, help="positions a row's cache holds (default: --attn-len + 64; "
                   "the engine's bench allocates its context length, 648)")  # fmt: skip
    p.add_argument("--engine-layout", action="store_true",
                   help="8-bit K and V as the two halves of one buffer [2, rows, kv heads, slots, D], as a layer of "
                   "the engine's KVCache, not two allocations")  # fmt: skip
    ns = p.parse_args()
    only = set(filter(None, ns.only.split(","))) or set(DEFAULT)
    configs = [tuple(int(x) for x in c.split(",")) for c in ns.configs.split(";") if c] or list(
        itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
    )
    torch.manual_seed(0)
    b, nh, nkv, hd, n = ns.batch, 16, 8, 128, ns.attn_len
    max_len = ns.slots or n + 64
    if max_len < n:
        p.error(f"--slots {max_len} is below --attn-len {n}")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    k16 = [torch.randn(b, nkv, max_len, hd, device=dev, dtype=torch.bfloat16) for _ in range(ns.copies)]
    v16 = [torch.randn(b, nkv, max_len, hd, device=dev, dtype=torch.bfloat16) for _ in range(ns.copies)]
    k8 = [t.to(torch.float8_e4m3fn) for t in k16]
    v8 = [t.to(torch.float8_e4m3fn) for t in v16]
    if ns.engine_layout:
        pairs = [torch.stack([k, v]) for k, v in zip(k8, v8, strict=True)]
        k8, v8 = [pair[0] for pair in pairs], [pair[1] for pair in pairs]
    v8t = [t.transpose(2, 3).contiguous() for t in v8]  # [b, kvh, D, max_len]
    qkv = torch.randn(b, (nh + 2 * nkv) * hd, device=dev, dtype=torch.bfloat16)
    pos = torch.full((b,), n - 1, device=dev, dtype=torch.long)
    scale = hd**-0.5
    q = qkv[:, : nh * hd].view(b, nh, 1, hd).float()

    def reference(kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        kk = kc[:, :, :n].float().repeat_interleave(nh // nkv, dim=1)
        vv = vc[:, :, :n].float().repeat_interleave(nh // nkv, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, scale=scale).reshape(b, nh * hd)

    refs = {"fp8_e4m3": reference(k8[0], v8[0]), "bfloat16": reference(k16[0], v16[0])}
    kv_bytes = {name: 2 * b * nkv * n * hd * size for name, size in (("fp8_e4m3", 1), ("bfloat16", 2))}
    Launch = Callable[[tuple[int, ...], torch.Tensor, int], None]  # (config, out, cache copy)
    strides = (k8[0].stride(0), k8[0].stride(1), k8[0].stride(2))

    def attn_variant(qk8: bool, pv8: bool, v_t: bool) -> Launch:
        def launch(cfg: tuple[int, ...], out: torch.Tensor, c: int) -> None:
            vc = v8t[c] if v_t else v8[c]
            _attn_variant_kernel[(b, nkv)](
                qkv, k8[c], vc, out, pos, scale, qkv.stride(0), *strides,
                vc.stride(2) if v_t else 0, vc.stride(3) if v_t else 0, max_len,
                H=nh, GROUP=nh // nkv, BLOCK_H=16, D=hd, BLOCK_N=cfg[0], QK8=qk8, PV8=pv8, V_T=v_t,
                num_warps=cfg[1], num_stages=cfg[2],
            )  # fmt: skip

        return launch

    def k_first(v_t: bool) -> Launch:
        def launch(cfg: tuple[int, ...], out: torch.Tensor, c: int) -> None:
            vc = v8t[c] if v_t else v8[c]
            _attn_kt_kernel[(b, nkv)](
                qkv, k8[c], vc, out, pos, scale, qkv.stride(0), *strides,
                vc.stride(2) if v_t else 0, vc.stride(3) if v_t else 0, vc.stride(3) if v_t else 0, max_len,
                H=nh, GROUP=nh // nkv, BLOCK_H=16, D=hd, BLOCK_N=cfg[0], V_T=v_t, V_FIRST=True,
                num_warps=cfg[1], num_stages=cfg[2],
            )  # fmt: skip

        return launch

    def engine(ks: list[torch.Tensor], vs: list[torch.Tensor], use_dot: int = 1, pdl: bool = True) -> Launch:
        def launch(cfg: tuple[int, ...], out: torch.Tensor, c: int) -> None:
            saved = kernels.PDL
            kernels.PDL = saved and pdl  # read at each launch: this capture's launches go without PDL
            try:
                kernels.decode_attention(qkv, ks[c], vs[c], pos, out, nh, nkv, hd, scale, config=(*cfg, use_dot))
            finally:
                kernels.PDL = saved

        return launch

    vtiles: dict[int, list[torch.Tensor]] = {}  # BLOCK_N -> V of each copy as [b, kvh, len / BLOCK_N, D, BLOCK_N]

    def vtile(v_as_a: bool) -> Launch:
        def launch(cfg: tuple[int, ...], out: torch.Tensor, c: int) -> None:
            bn = cfg[0]
            if bn not in vtiles:
                vtiles[bn] = [t.view(b, nkv, max_len // bn, bn, hd).transpose(3, 4).contiguous() for t in v8]
            vt = vtiles[bn][c]
            _attn_kt_kernel[(b, nkv)](
                qkv, k8[c], vt, out, pos, scale, qkv.stride(0), *strides, bn, 1, hd, max_len,
                H=nh, GROUP=nh // nkv, BLOCK_H=16, D=hd, BLOCK_N=bn, V_T=True, V_FIRST=v_as_a,
                num_warps=cfg[1], num_stages=cfg[2],
            )  # fmt: skip

        return launch

    def floor(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> Launch:
        def launch(cfg: tuple[int, ...], out: torch.Tensor, c: int) -> None:
            kw, vw = ks[c].view(torch.int32), vs[c].view(torch.int32)
            _loads_kernel[(b, nkv)](kw, vw, out, pos, kw.stride(0), kw.stride(1), kw.stride(2), max_len, KVH=nkv,
                                    W=kw.shape[3], BLOCK_N=cfg[0], WIDEN=False, num_warps=cfg[1],
                                    num_stages=cfg[2])  # fmt: skip

        return launch

    def load_cvt(cfg: tuple[int, ...], out: torch.Tensor, c: int) -> None:
        _loads_kernel[(b, nkv)](k8[c], v8[c], out, pos, *strides, max_len, KVH=nkv, W=hd, BLOCK_N=cfg[0], WIDEN=True,
                                   num_warps=cfg[1], num_stages=cfg[2])  # fmt: skip

    def split(spans: int) -> Launch:
        po = torch.empty(b * nh * spans, hd, device=dev, dtype=torch.float32)
        pml = torch.empty(b * nh * spans, 2, device=dev, dtype=torch.float32)

        def launch(cfg: tuple[int, ...], out: torch.Tensor, c: int) -> None:
            _attn_split_kernel[(b, nkv, spans)](
                qkv, k8[c], v8[c], po, pml, pos, scale, qkv.stride(0), *strides, max_len, H=nh, GROUP=nh // nkv,
                BLOCK_H=16, D=hd, BLOCK_N=cfg[0], SPANS=spans, num_warps=cfg[1], num_stages=cfg[2],
            )  # fmt: skip
            _combine_kernel[(b * nh,)](po, pml, out, H=nh, D=hd, SPANS=spans, SP2=max(2, 1 << (spans - 1).bit_length()),
                                       num_warps=4)  # fmt: skip

        return launch

    def persistent(per_sm: int) -> Launch:
        def launch(cfg: tuple[int, ...], out: torch.Tensor, c: int) -> None:
            _attn_persistent_kernel[(min(b * nkv, sms * per_sm),)](
                qkv, k8[c], v8[c], out, pos, scale, qkv.stride(0), *strides, max_len, b * nkv, KVH=nkv, H=nh,
                GROUP=nh // nkv, BLOCK_H=16, D=hd, BLOCK_N=cfg[0], num_warps=cfg[1], num_stages=cfg[2],
            )  # fmt: skip

        return launch

    attn_out = lambda: torch.empty(b, nh * hd, device=dev, dtype=torch.bfloat16)  # noqa: E731
    # name -> (cache, launch, output factory, checked against the reference)
    variants: dict[str, tuple[str, Launch, Callable[[], torch.Tensor], bool]] = {
        "engine": ("fp8_e4m3", engine(k8, v8), attn_out, True),
        "engine_bf16": ("bfloat16", engine(k16, v16), attn_out, True),
        "engine_kfirst": ("fp8_e4m3", engine(k8, v8, use_dot=2), attn_out, True),
        "engine_kfirst_nopdl": ("fp8_e4m3", engine(k8, v8, use_dot=2, pdl=False), attn_out, True),
        "engine_kfirst_bf16": ("bfloat16", engine(k16, v16, use_dot=2), attn_out, True),
        "floor": ("fp8_e4m3", floor(k8, v8), lambda: torch.empty(b, nkv, hd // 4, device=dev, dtype=torch.int32),
                  False),
        "floor_bf16": ("bfloat16", floor(k16, v16),
                       lambda: torch.empty(b, nkv, hd // 2, device=dev, dtype=torch.int32), False),
        "load_cvt": ("fp8_e4m3", load_cvt, lambda: torch.empty(b, nkv, hd, device=dev, dtype=torch.float32), False),
        "cvt_vt": ("fp8_e4m3", attn_variant(False, False, True), attn_out, True),
        "mma8": ("fp8_e4m3", attn_variant(True, True, True), attn_out, True),
        "mma8_qk": ("fp8_e4m3", attn_variant(True, False, False), attn_out, True),
        "k_first": ("fp8_e4m3", k_first(False), attn_out, True),
        "kv_first": ("fp8_e4m3", k_first(True), attn_out, True),
        "vt_tiles": ("fp8_e4m3", vtile(False), attn_out, True),
        "vt_tiles_a": ("fp8_e4m3", vtile(True), attn_out, True),
        **{f"split{k}": ("fp8_e4m3", split(k), attn_out, True) for k in (2, 3, 4)},
        **{f"persist{k}": ("fp8_e4m3", persistent(k), attn_out, True) for k in (4, 6, 8)},
    }  # fmt: skip
    unknown = only - set(variants)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {sorted(variants)}")
    print(f"batch {b}, attention length {n}, {max_len} slots a row, 8-bit K/V "
          f"{'in one buffer (the engine layout)' if ns.engine_layout else 'in two allocations'}, one layer, "
          f"{ns.copies} K/V copies; config = BLOCK_N,warps,stages;"
          " device time per launch from CUDA-graph replays", flush=True)  # fmt: skip
    print("| variant | cache | config | ms | GB/s of K/V | rel err vs fp32 SDPA |")
    print("|---|---|---|---:|---:|---:|")
    best: dict[str, tuple[float, tuple[int, ...], str]] = {}
    for name, (cache, launch, make_out, checked) in variants.items():
        if name not in only:
            continue
        for cfg in configs:
            out = make_out()
            copy = itertools.cycle(range(ns.copies))

            def run(cfg: tuple[int, ...] = cfg, out: torch.Tensor = out, launch: Launch = launch,
                    copy: itertools.cycle[int] = copy) -> None:  # fmt: skip
                launch(cfg, out, next(copy))

            try:
                out.fill_(float("nan") if out.is_floating_point() else -1)
                launch(cfg, out, 0)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                print(f"| {name} | {cache} | {cfg} | failed: {type(exc).__name__}: {str(exc)[:120]} | | |", flush=True)
                continue
            err = "-"
            if checked:
                ref = refs[cache]
                err = f"{((out.float() - ref).norm() / ref.norm()).item():.2e}"
            ms = graph_ms(run, launches=4 * ns.copies)
            gbs = kv_bytes[cache] / ms / 1e6
            print(f"| {name} | {cache} | {','.join(map(str, cfg))} | {ms:.4f} | {gbs:,.0f} | {err} |", flush=True)
            if name not in best or ms < best[name][0]:
                best[name] = (ms, cfg, err)
    print("\n| variant | best config | ms | GB/s | rel err |\n|---|---|---:|---:|---:|")
    for name, (ms, cfg, err) in best.items():
        gbs = kv_bytes[variants[name][0]] / ms / 1e6
        print(f"| {name} | {','.join(map(str, cfg))} | {ms:.4f} | {gbs:,.0f} | {err} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
