"""The batch-invariant forward: one implementation for the engine's prefill and decode and the trainer.

A token's logits come out of the same floating-point operations, in the same order, whether its row
is decoded alone, decoded beside 255 others, prefilled with its prompt, re-prefilled after a retract,
or scored by the trainer in a padded micro-batch. That is what makes `engine.batch_invariant: true`
with `train.logprobs: invariant` truly on-policy: the engine samples from the very log-prob row the
trainer computes, bit for bit (docs/numerics.md says what is guaranteed where).

How each operation gets there (CPU fp32 and bf16 are verified in CI; CUDA fp32 and bf16 by
tools/gpu/onpolicy_gpu.py on the GPU machine):
- GEMM (every projection and the LM head): rows are cut into fixed chunks of `CHUNK_ROWS`, the last one
  zero-padded, so every matrix product has the shape [CHUNK_ROWS, K] x [K, N] whatever the number of
  rows. MKL's `mm` is not batch-invariant (its blocking depends on M); for a fixed shape a row's result
  did not depend on its place in the chunk (probed, and checked by tests/unit/test_invariant.py). cuBLAS
  picks its kernel (tiles, split-K) from the shape too, so the fixed M gives every row the same kernel on
  CUDA; `pin_backend_numerics` fixes TF32 and bf16 reduced-precision split-K off in both processes.
- Reductions (RMSNorm's sum of squares, q.k, the softmax sum, p.v): a pairwise tree of elementwise adds
  in one fixed order (`tree_sum`). Elementwise IEEE adds give the same bits in vector and scalar code.
- RMSNorm: fp32, `1 / sqrt(mean + eps)` (two correctly rounded ops), transformers' cast order
  (`weight * x_normed.to(dtype)`).
- RoPE: fp32 cos/sin tables built in fixed blocks of `ROPE_BLOCK` positions, so a position's entry never
  depends on the table's length; x*cos and rotate_half(x)*sin as separate mul/mul/add (no FMA).
- Attention: a query row walks key tiles of `KV_TILE` from key 0 in order; keys past the row's position
  (the tail of its last tile, later tiles) are masked to -inf, never cut away, so a decode row and the
  trainer's row t make the same tiles. Two passes: the exact row max over all visible scores, then
  `exp(s - max)` summed tile by tile; no running rescale, so a fully masked tile adds exact zeros.
- One log-softmax (`logprob_rows`): the engine's sampler draws from that row (`sampling.choose_tokens`) and
  reports its entry; the trainer takes the same entry. On CUDA its row sum is a `tree_sum` too.
- bf16 models: GEMMs take and give bf16 (accumulating in fp32 inside the kernel); RMSNorm, RoPE, attention
  and the log-softmax compute in fp32 and cast back at the same points in every path.
Every tensor a transcendental op (exp, silu, cos, sin) sees has a row count padded to a multiple of
`CHUNK_ROWS` or a fixed inner width, so ATen's vectorised loops leave no row-dependent scalar tail.

On CUDA with Triton (`invariant_kernels`) the same guarantees come from kernels that compute one row (or one
output tile) per program: a fixed-tile GEMM without split-K, RMSNorm, the one-pass tiled attention and the
log-softmax each run in one launch, positions stay on the device, and the engine captures its decode step
in a CUDA graph. The engine and the trainer then run the same kernels (the torch path above is what runs
without Triton, and on the CPU).

The backward uses standard kernels: `linear` is an autograd Function whose backward is two plain GEMMs,
and `attention`'s backward differentiates ordinary causal SDPA (same math; it only needs to be a
gradient, the log-probs that the loss ratio and the gap compare come from this forward).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from hpcrl.model import invariant_kernels as kernels
from hpcrl.model.invariant_config import InvariantKernelsConfig, with_env_overrides
from hpcrl.model.moe import SparseMoeBlock
from hpcrl.model.qwen3 import CausalLM, KVCache, ModelArgs, window_band
from hpcrl.model.rope import RopeScaling
from hpcrl.model.rope import inv_freq as rope_inv_freq

log = logging.getLogger(__name__)

CHUNK_ROWS = 16
"""Rows per GEMM: every matrix product of the invariant forward is [CHUNK_ROWS, K] x [K, N]."""
KV_TILE = kernels.KV_TILE
"""Keys per attention tile, walked from key 0 (the CUDA kernel's default tile too, `ATTENTION_DEFAULT`)."""
Q_TILE = {"cpu": 16, "cuda": 64}
"""Query positions per attention step in a prefill, by device type (memory and launches only: rows are
independent, and a row's tiles do not depend on the other rows of its query tile)."""
ROPE_BLOCK = 16
"""Positions per block of the cos/sin tables."""


SUPPORTED_DTYPES = ("float32", "bfloat16")
"""Dtypes the guarantee covers: GEMM inputs and outputs in this dtype, every reduction in fp32 (float16's narrow
range would need its own overflow checks, which nothing tests)."""


def supported_reason(device: torch.device | str, dtype: torch.dtype | str) -> str | None:
    """None when the invariant forward's guarantee holds for this device and dtype, else why not.

    CPU and CUDA both qualify, for the same reason: every GEMM is one fixed [CHUNK_ROWS, K] x [K, N] shape, so
    MKL or cuBLAS runs the same kernel (same blocking, same split-K) for a row whatever the batch, and every
    other reduction is elementwise adds in a fixed tree or an exact max. The engine and the trainer must be on
    the same kind of device with the same dtype (run_config checks that); their GEMM libraries are not the same.
    """
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        return f"the batch-invariant forward covers cpu and cuda devices, not {kind}"
    name = str(dtype).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        return f"the batch-invariant forward covers {' and '.join(SUPPORTED_DTYPES)}, not {name}"
    return None


def pin_backend_numerics(device: torch.device | str) -> None:
    """Fix the process-wide GEMM settings that could differ between the engine's process and the trainer's.

    On CUDA, TF32 for fp32 GEMMs and cuBLAS's reduced-precision (bf16) split-K accumulation are flags a script
    may flip; both processes must agree for their fixed-shape GEMMs to give the same bits, so both pin them off.
    """
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def use_kernel_tiles(tiles: InvariantKernelsConfig, environ: Mapping[str, str] | None = None) -> InvariantKernelsConfig:
    """Launch this process's batch-invariant kernels with `tiles` (the trainer's train.invariant_kernels), with the
    HPCRL_INVARIANT_* overrides of `environ` (os.environ by default) applied and checked, as the engine applies them
    to its engine.kernels.invariant_*: a run's processes inherit one environment, so both launch the same tiles."""
    resolved, applied = with_env_overrides(tiles, os.environ if environ is None else environ)
    for var, raw, name in applied:
        log.info("batch-invariant kernels: %s=%s (from %s)", name, raw, var)
    kernels.configure(resolved)
    return resolved


# ----- building blocks -----
def tree_sum(x: Tensor, dim: int = -1) -> Tensor:
    """Sum over `dim` as a pairwise tree of elementwise adds (odd widths get a zero): one fixed order."""
    dim = dim % x.dim()
    while x.shape[dim] > 1:
        n = x.shape[dim]
        if n % 2:
            pad = x.new_zeros(*x.shape[:dim], 1, *x.shape[dim + 1 :])
            x = torch.cat([x, pad], dim=dim)
            n += 1
        half = n // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    return x.squeeze(dim)


def pad_rows(x: Tensor, multiple: int = CHUNK_ROWS) -> Tensor:
    """x [M, ...] with zero rows appended up to a multiple of `multiple`."""
    extra = -x.shape[0] % multiple
    if not extra:
        return x
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def _chunked_mm(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] (M a multiple of CHUNK_ROWS) @ w.T, one [CHUNK_ROWS, K] x [K, N] product per chunk (CPU), or
    the fixed-tile kernel in one launch (CUDA)."""
    if kernels.usable(x):
        return kernels.matmul(x, w)
    wt = w.t()
    return torch.cat([torch.mm(x[i : i + CHUNK_ROWS], wt) for i in range(0, x.shape[0], CHUNK_ROWS)])


class _InvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return _chunked_mm(x, w)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        gx = grad @ w if ctx.needs_input_grad[0] else None
        gw = grad.t() @ x if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """F.linear for x [M, K] with M a multiple of CHUNK_ROWS, on fixed row chunks."""
    if x.shape[0] % CHUNK_ROWS:
        raise ValueError(f"linear needs a multiple of {CHUNK_ROWS} rows (pad_rows), got {x.shape[0]}")
    out = _InvariantLinear.apply(x, w) if torch.is_grad_enabled() else _chunked_mm(x, w)
    return out + b if b is not None else out


class _InvariantLinearResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, residual: Tensor, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return kernels.matmul(x, w, residual=residual)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        gx = grad @ w if ctx.needs_input_grad[1] else None
        gw = grad.t() @ x if ctx.needs_input_grad[2] else None
        return grad, gx, gw


def add_linear(residual: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """residual + linear(x, w): on the CUDA kernels in one launch with the same bits (the add in the GEMM's
    epilogue), so the engine's graphed step has one launch fewer per residual add."""
    if kernels.usable(x):
        if x.shape[0] % CHUNK_ROWS:
            raise ValueError(f"linear needs a multiple of {CHUNK_ROWS} rows (pad_rows), got {x.shape[0]}")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (residual, x, w)):
            out: Tensor = _InvariantLinearResidual.apply(residual, x, w)
            return out
        return kernels.matmul(x, w, residual=residual)
    return residual + linear(x, w)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """F.silu(gate) * up; one launch on the CUDA kernels (the same cast points; the backward is torch's)."""
    if kernels.usable(gate) and gate.stride(-1) == 1 and up.stride(-1) == 1:
        return _kernel_op(kernels.silu_mul, lambda g, u: F.silu(g) * u, gate, up)
    return F.silu(gate) * up


def _torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    dtype = x.dtype
    h = x.float()
    var = tree_sum(h * h) / h.shape[-1]
    h = h * (1.0 / torch.sqrt(var + eps))[..., None]
    return weight * h.to(dtype)


class _KernelForward(torch.autograd.Function):
    """A kernel's forward with its plain-torch reference's gradient: only the forward's bits must match the
    engine's, the backward just has to be the gradient."""

    @staticmethod
    def forward(
        ctx: Any, kernel: Callable[..., Tensor], reference: Callable[..., Tensor], *args: Tensor | None
    ) -> Tensor:
        ctx.reference = reference
        ctx.save_for_backward(*args)
        return kernel(*args)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        args = ctx.saved_tensors
        wanted = [i for i, a in enumerate(args) if a is not None and ctx.needs_input_grad[i + 2]]
        with torch.enable_grad():
            leaves = [a.detach().requires_grad_(i in wanted) if a is not None else None for i, a in enumerate(args)]
            inputs = [leaf for i, leaf in enumerate(leaves) if i in wanted and leaf is not None]
            grads = torch.autograd.grad(ctx.reference(*leaves), inputs, grad) if inputs else ()
        out: list[Tensor | None] = [None] * len(args)
        for i, g in zip(wanted, grads, strict=True):
            out[i] = g
        return (None, None, *out)


def _kernel_op(kernel: Callable[..., Tensor], reference: Callable[..., Tensor], *args: Tensor | None) -> Tensor:
    """kernel(*args), through _KernelForward when autograd needs a gradient of any argument."""
    if torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in args):
        out: Tensor = _KernelForward.apply(kernel, reference, *args)
        return out
    return kernel(*args)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: fp32, a fixed-order sum, transformers' cast points."""
    if kernels.usable(x):
        return _kernel_op(
            lambda x_, w_: kernels.rms_norm(x_, w_, eps), lambda x_, w_: _torch_rms_norm(x_, w_, eps), x, weight
        )
    return _torch_rms_norm(x, weight, eps)


_ROPE_CACHE: dict[tuple[int, float, str, RopeScaling | None], tuple[Tensor, Tensor]] = {}


def rope_tables(
    length: int, head_dim: int, theta: float, device: torch.device, scaling: RopeScaling | None = None
) -> tuple[Tensor, Tensor]:
    """fp32 cos and sin [>= length, head_dim], built block by block (cached, grown on demand)."""
    key = (head_dim, float(theta), str(device), scaling)
    have = _ROPE_CACHE.get(key)
    if have is not None and have[0].shape[0] >= length:
        return have
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, device, scaling)
    total = -(-max(length, 256) // 256) * 256
    cos, sin = [], []
    for start in range(0, total, ROPE_BLOCK):
        pos = torch.arange(start, start + ROPE_BLOCK, device=device).float()
        freqs = pos[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos.append(emb.cos() if attention_factor == 1.0 else emb.cos() * attention_factor)
        sin.append(emb.sin() if attention_factor == 1.0 else emb.sin() * attention_factor)
    tables = (torch.cat(cos), torch.cat(sin))
    _ROPE_CACHE[key] = tables
    return tables


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., D] rotated by fp32 cos/sin broadcast against it; the result in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def _tiled_attention(q: Tensor, k: Tensor, v: Tensor, qpos: Tensor, scale: float, window: int | None = None) -> Tensor:
    """q [B, KVH, R, D] (R query rows per kv head) at positions qpos [B, R]; k, v [B, KVH, L, D], key j at
    position j. Each row sees keys 0..qpos (qpos - window + 1..qpos in a sliding window); returns [B, KVH, R, D]."""
    dtype = q.dtype
    # fp32 throughout (a no-op for fp32 models): bf16 adds in the tree would lose the scores' low bits.
    q, k, v = q.float(), k.float(), v.float()
    b, kvh, r, d = q.shape
    length = int(qpos.max()) + 1
    num_tiles = -(-length // KV_TILE)
    need = num_tiles * KV_TILE
    if k.shape[2] < need:
        pad = k.new_zeros(b, kvh, need - k.shape[2], d)
        k, v = torch.cat([k, pad], dim=2), torch.cat([v, pad], dim=2)
    visible_pos = qpos[:, None, :, None]  # [B, 1, R, 1]
    scores = []
    for t in range(num_tiles):
        kt = k[:, :, t * KV_TILE : (t + 1) * KV_TILE]
        s = tree_sum(q[:, :, :, None, :] * kt[:, :, None, :, :]) * scale  # [B, KVH, R, KV_TILE]
        key_pos = torch.arange(t * KV_TILE, (t + 1) * KV_TILE, device=q.device)
        seen = key_pos <= visible_pos
        if window is not None:
            seen = seen & (key_pos > visible_pos - window)
        scores.append(torch.where(seen, s, float("-inf")))
    m = scores[0].amax(-1)
    for s in scores[1:]:
        m = torch.maximum(m, s.amax(-1))
    total = q.new_zeros(b, kvh, r)
    acc = q.new_zeros(b, kvh, r, d)
    for t, s in enumerate(scores):
        p = torch.exp(s - m[..., None])
        total = total + tree_sum(p)
        vt = v[:, :, t * KV_TILE : (t + 1) * KV_TILE]
        acc = acc + tree_sum(p[..., None] * vt[:, :, None, :, :], dim=-2)
    return (acc / total[..., None]).to(dtype)


class _InvariantCausalAttention(torch.autograd.Function):
    """Causal self-attention of full sequences: the tiled forward, the gradient of standard SDPA."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None) -> Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.window = scale, window
        return _prefill_attention(q, k, v, scale, window)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = _grouped_sdpa(q_, k_, v_, ctx.scale, ctx.window)
            gq, gk, gv = torch.autograd.grad(out, (q_, k_, v_), grad)
        return gq, gk, gv, None, None


def _grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None) -> Tensor:
    """The standard kernel on _prefill_attention's layout: q [B, KVH, T, G, D], k, v [B, KVH, T, D]."""
    b, kvh, t, g, d = q.shape
    qh = q.permute(0, 1, 3, 2, 4).reshape(b, kvh * g, t, d)
    band = None if window is None else window_band(torch.arange(t, device=q.device), t, window)
    out = F.scaled_dot_product_attention(
        qh,
        k.repeat_interleave(g, dim=1),
        v.repeat_interleave(g, dim=1),
        attn_mask=band,
        is_causal=band is None,
        scale=scale,
    )
    return out.reshape(b, kvh, g, t, d).permute(0, 1, 3, 2, 4)


def _prefill_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None) -> Tensor:
    """q [B, KVH, T, G, D] (G query heads per kv head), k, v [B, KVH, T, D]: causal, Q_TILE positions at a time."""
    b, kvh, t, g, d = q.shape
    q_tile = Q_TILE.get(q.device.type, Q_TILE["cpu"])
    out = []
    for start in range(0, t, q_tile):
        stop = min(start + q_tile, t)
        qt = q[:, :, start:stop].reshape(b, kvh, (stop - start) * g, d)
        qpos = torch.arange(start, stop, device=q.device).repeat_interleave(g)[None].expand(b, -1)
        out.append(_tiled_attention(qt, k, v, qpos, scale, window).reshape(b, kvh, stop - start, g, d))
    return torch.cat(out, dim=2)


# ----- the model -----
def _torch_qk_norm_rope(x: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    if weight is not None:
        x = _torch_rms_norm(x, weight, eps)
    return apply_rope(x, cos, sin)


def qk_norm_rope(x: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """x [M, H, D]: QK-norm per head (when `weight` is given, else none: Qwen2 and Llama), then RoPE with the
    rows' fp32 `cos`, `sin` [M, 1, D]."""
    if kernels.usable(x, x.shape[-1]):
        return _kernel_op(
            lambda x_, w_, c, s: kernels.qk_norm_rope(x_, w_, eps, c[:, 0], s[:, 0]),
            lambda x_, w_, c, s: _torch_qk_norm_rope(x_, w_, eps, c, s),
            x, weight, cos, sin,
        )  # fmt: skip
    return _torch_qk_norm_rope(x, weight, eps, cos, sin)


def _rope_rows(model: CausalLM, positions: Tensor, table_len: int) -> tuple[Tensor, Tensor]:
    """fp32 cos and sin rows [Mpad, 1, head_dim] at `positions`, from tables of at least `table_len` entries
    (a position's entry is the same whatever the tables' length)."""
    a = model.args
    cos_t, sin_t = rope_tables(table_len, a.head_dim, a.rope_theta, positions.device, a.rope_scaling)
    return pad_rows(cos_t[positions])[:, None], pad_rows(sin_t[positions])[:, None]


FusedWeights = tuple[Tensor, Tensor | None, Tensor]
"""One layer's [q; k; v] weight, its bias (or None) and [gate; up] weight, stacked on dim 0 (the engine's)."""


def _layer(
    model: CausalLM, i: int, x: Tensor, cos: Tensor, sin: Tensor, attend: Any, *, rows: int,
    fused: FusedWeights | None = None,
) -> Tensor:  # fmt: skip
    """Decoder layer i on token rows x [Mpad, hidden] (the first `rows` real) with their RoPE rows `cos`,
    `sin`; `attend(q, k, v)` gets q [rows, H, D], k and v [rows, KVH, D] and returns [rows, H * D].

    `fused` (CUDA kernels only) computes q, k, v in one GEMM and gate, up in another: the fixed-tile kernel
    computes each output element alone from its row and its weight column, so a column's bits are those of
    the separate GEMM, provided no output tile straddles two of the stacked weights (`fusable`).
    """
    a = model.args
    layer = model.model.decoder_layers[i]
    at = layer.self_attn
    nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
    h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
    if fused is not None:
        qkv = linear(h, fused[0], fused[1])
        q = qkv[:, : nh * hd].view(-1, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].view(-1, nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].view(-1, nkv, hd)
    else:
        q = linear(h, at.q_proj.weight, at.q_proj.bias).view(-1, nh, hd)
        k = linear(h, at.k_proj.weight, at.k_proj.bias).view(-1, nkv, hd)
        v = linear(h, at.v_proj.weight, at.v_proj.bias).view(-1, nkv, hd)
    q_w, q_eps = (at.q_norm.weight, at.q_norm.eps) if a.qk_norm else (None, 0.0)
    k_w, k_eps = (at.k_norm.weight, at.k_norm.eps) if a.qk_norm else (None, 0.0)
    q, k = qk_norm_rope(q, q_w, q_eps, cos, sin), qk_norm_rope(k, k_w, k_eps, cos, sin)
    o = pad_rows(attend(q[:rows], k[:rows], v[:rows]))
    x = add_linear(x, o, at.o_proj.weight)
    mlp, post = layer.mlp, layer.post_attention_layernorm
    h = rms_norm(x, post.weight, post.eps)
    if a.moe is not None and a.moe.sparse_layers[i]:
        from hpcrl.model.invariant_moe import sparse_block  # it builds on this module's ops

        return x + sparse_block(cast(SparseMoeBlock, mlp), h, rows)
    if fused is not None:
        gate_up = linear(h, fused[2])
        gate, up = gate_up[:, : a.intermediate_size], gate_up[:, a.intermediate_size :]
    else:
        gate, up = linear(h, mlp.gate_proj.weight), linear(h, mlp.up_proj.weight)
    return add_linear(x, swiglu(gate, up), mlp.down_proj.weight)


def fusable(args: ModelArgs) -> bool:
    """True when the stacked q/k/v and gate/up GEMMs give the separate GEMMs' bits: every weight's rows start
    on an output-tile boundary of the CUDA kernel."""
    tile = kernels.SETTINGS.matmul[1]
    widths = (args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, args.intermediate_size)
    return args.moe is None and all(w % tile == 0 for w in widths)


def _head(model: CausalLM, x: Tensor) -> Tensor:
    norm = model.model.norm
    return linear(rms_norm(pad_rows(x), norm.weight, norm.eps), model.output_weight)


class _KernelCausalAttention(torch.autograd.Function):
    """Causal self-attention of full sequences through the CUDA kernel; the gradient of standard SDPA."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, row_batch: Tensor, row_pos: Tensor, scale: float, window: int | None
    ) -> Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.window = scale, window
        return kernels.attention(q, k, v, row_batch, row_pos, scale, window)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        b, kvh, t, d = k.shape
        g = q.shape[1] // kvh
        with torch.enable_grad():
            q_, k_, v_ = (x.detach().requires_grad_(True) for x in (q, k, v))
            q5 = q_.view(b, t, kvh, g, d).permute(0, 2, 1, 3, 4)
            out = _grouped_sdpa(q5, k_, v_, ctx.scale, ctx.window).permute(0, 2, 1, 3, 4).reshape(b * t, kvh * g, d)
            gq, gk, gv = torch.autograd.grad(out, (q_, k_, v_), grad)
        return gq, gk, gv, None, None, None, None


def logits(model: CausalLM, input_ids: Tensor, *, kv_out: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
    """Logits [B, T, V] of right-padded sequences [B, T] from position 0 (trainer and engine prefill).

    `kv_out`, when given, receives each layer's K and V [B, KVH, T, D] (the engine writes them to its cache).
    """
    a = model.args
    b, t = input_ids.shape
    g = a.num_heads // a.num_kv_heads
    scale = 1.0 / math.sqrt(a.head_dim)
    device = input_ids.device
    positions = torch.arange(t, device=device).repeat(b)
    on_kernels = kernels.usable(input_ids, a.head_dim)
    row_batch = torch.arange(b, device=device).repeat_interleave(t)
    window: int | None = None  # the layer's, set before each layer
    model.routing.clear()

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # K and V contiguous as [B, KVH, T, D], the cache's layout: the kernel then sees the same contiguity
        # in the trainer as in the engine's decode.
        k4 = k.view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2).contiguous()
        v4 = v.view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2).contiguous()
        if kv_out is not None:
            kv_out.append((k4, v4))
        if on_kernels:
            if torch.is_grad_enabled():
                o = _KernelCausalAttention.apply(q, k4, v4, row_batch, positions, scale, window)
            else:
                o = kernels.attention(q, k4, v4, row_batch, positions, scale, window)
            return o.reshape(b * t, a.num_heads * a.head_dim)
        q5 = q.view(b, t, a.num_kv_heads, g, a.head_dim).permute(0, 2, 1, 3, 4)
        if torch.is_grad_enabled():
            o = _InvariantCausalAttention.apply(q5, k4, v4, scale, window)
        else:
            o = _prefill_attention(q5, k4, v4, scale, window)
        return o.permute(0, 2, 1, 3, 4).reshape(b * t, a.num_heads * a.head_dim)

    cos, sin = _rope_rows(model, positions, t)
    x = pad_rows(F.embedding(input_ids.reshape(-1), model.model.embed_tokens.weight))
    for i in range(a.num_layers):
        window = a.window(i)
        x = _layer(model, i, x, cos, sin, attend, rows=b * t)
    return _head(model, x[: b * t])[: b * t].view(b, t, -1)


def prefill(model: CausalLM, cache: KVCache, input_ids: Tensor, first_slot: int, last: Tensor) -> Tensor:
    """The engine's prefill: right-padded prompts [B, T] into cache slots first_slot.., logits [B, V] at `last`."""
    b, t = input_ids.shape
    kv: list[tuple[Tensor, Tensor]] = []
    out = logits(model, input_ids, kv_out=kv)
    rows = slice(first_slot, first_slot + b)
    for i, (k, v) in enumerate(kv):
        cache.k[i][rows, :, :t] = k
        cache.v[i][rows, :, :t] = v
    return out[torch.arange(b, device=input_ids.device), last]


def decode(
    model: CausalLM, cache: KVCache, tokens: Tensor, positions: Tensor, *, fused: list[FusedWeights] | None = None
) -> Tensor:
    """The engine's decode step: token [n] of cache slots 0..n-1 at `positions` [n]; logits [n, V].

    With the CUDA kernels it reads the positions on the device only (no host sync), so a step can be
    captured in a CUDA graph; `fused` (per layer, see `_layer`) is used there and ignored elsewhere.
    """
    a = model.args
    n = tokens.shape[0]
    g = a.num_heads // a.num_kv_heads
    scale = 1.0 / math.sqrt(a.head_dim)
    rows = torch.arange(n, device=tokens.device)
    on_kernels = kernels.usable(tokens, a.head_dim)
    layer_i = 0
    model.routing.clear()

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kc, vc = cache.k[layer_i], cache.v[layer_i]
        if on_kernels:
            kernels.store_kv(k, v, kc, vc, positions)
            o = kernels.attention(q, kc, vc, rows, positions, scale, a.window(layer_i))
            return o.reshape(n, a.num_heads * a.head_dim)
        kc[rows, :, positions] = k
        vc[rows, :, positions] = v
        length = int(positions.max()) + 1
        qg = q.view(n, a.num_kv_heads, g, a.head_dim)
        qpos = positions[:, None].expand(n, g)
        o = _tiled_attention(qg, kc[:n, :, :length], vc[:n, :, :length], qpos, scale, a.window(layer_i))
        return o.reshape(n, a.num_heads * a.head_dim)

    # The tables cover the whole cache, so no step needs the positions on the host.
    cos, sin = _rope_rows(model, positions, cache.max_len if on_kernels else int(positions.max()) + 1)
    x = pad_rows(F.embedding(tokens, model.model.embed_tokens.weight))
    use_fused = fused if on_kernels and fusable(a) else None
    for i in range(a.num_layers):
        layer_i = i
        x = _layer(model, i, x, cos, sin, attend, rows=n, fused=use_fused[i] if use_fused else None)
    return _head(model, x[:n])[:n]


def graphable(model: CausalLM, like: Tensor) -> bool:
    """True when `decode` runs without host syncs on `like`'s device (the CUDA kernels), so a CUDA graph can
    capture it."""
    return like.is_cuda and kernels.usable(like, model.args.head_dim) and model.args.moe is None


def logprob_rows(logits: Tensor) -> Tensor:
    """The one log-softmax (fp32, temperature 1) that the engine samples from and the trainer scores with.

    CPU: ATen's log-softmax, one row per loop iteration whatever the row count (what CI verifies). CUDA:
    `torch.log_softmax` and `sum` pick their kernel and its split of a row across thread blocks from the
    tensor's shape, so the row sum has a fixed order instead: one Triton program per row, or without
    Triton a tree of elementwise adds (`_TreeLogSoftmax`).
    """
    x = logits.float()
    if x.device.type == "cpu":
        return torch.log_softmax(x, dim=-1)
    out: Tensor = _TreeLogSoftmax.apply(x)
    return out


def _tree_log_softmax(x: Tensor) -> Tensor:
    shifted = x - x.amax(-1, keepdim=True)  # max is exact in any order
    return shifted - torch.log(tree_sum(torch.exp(shifted)))[..., None]


class _TreeLogSoftmax(torch.autograd.Function):
    """The fixed-order log-softmax forward; the backward is log-softmax's standard one."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        lp = kernels.log_softmax(x) if kernels.usable(x) else _tree_log_softmax(x)
        ctx.save_for_backward(lp)
        return lp

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (lp,) = ctx.saved_tensors
        return grad - torch.exp(lp) * grad.sum(-1, keepdim=True)


def token_logprobs(model: torch.nn.Module, input_ids: Tensor) -> Tensor:
    """Log-probs [B, T-1] of input_ids[:, 1:] given what precedes them, through the invariant forward.

    The trainer's `train.logprobs: invariant` scorer: `model` is the CausalLM or its DDP wrapper (called, so DDP
    prepares its gradient reduction). Right-padded rows are fine (attention is causal); differentiable,
    with a standard-kernel backward.
    """
    lp = logprob_rows(model(input_ids, invariant=True)[:, :-1])
    return lp.gather(-1, input_ids[:, 1:, None])[..., 0]


def support_logprobs(entries: Tensor, valid: Tensor, target: Tensor) -> Tensor:
    """The target's log-prob renormalised over its sampling support, in one order whatever the batch.

    `entries` [N, K]: each row's log-prob row (`logprob_rows`) at its support ids, in ascending id order;
    `valid` [N, K] marks the real slots (K may differ between callers); `target` [N]: the row's entry at the
    sampled id. Returns target - log(sum over the support of exp(entry)), fp32, differentiable.

    The engine (on its sampled rows) and the trainer (on every position of a micro-batch) compute it on
    different N and K and get the same bits: the max is exact in any order; the sum runs slot by slot from
    slot 0 (padding adds an exact 0.0); exp and log run on [32k rows, even K] blocks, so ATen's vectorised loops
    have no scalar tail whose place would depend on N (CPU, one thread; on CUDA every element is alone).
    """
    n, k = entries.shape
    rows, width = -(-max(n, 1) // 32) * 32, max(2, k + k % 2)
    x = entries.new_full((rows, width), -math.inf, dtype=torch.float32)
    x[:n, :k] = entries.float().masked_fill(~valid, -math.inf)
    m = x.amax(dim=-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # an empty (padding) row: no NaN
    e = torch.exp(x - m[:, None])
    total = e[:, 0]
    for j in range(1, width):
        total = total + e[:, j]
    lse = m + torch.log(torch.where(total > 0, total, torch.ones_like(total)))
    return target.float() - lse[:n]


def support_token_logprobs(model: torch.nn.Module, input_ids: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
    """`token_logprobs` renormalised over each position's sampling support (ids, valid [B, T-1, K], ascending ids
    per position as the engine reports them): the trainer's side of `support_logprobs`. A position without a
    support (prompt, padding) gets 0."""
    lp = logprob_rows(model(input_ids, invariant=True)[:, :-1])
    b, t, k = ids.shape
    at_target = lp.gather(-1, input_ids[:, 1:, None])[..., 0]
    entries = lp.gather(-1, ids.clamp(0, lp.shape[-1] - 1))
    out = support_logprobs(entries.reshape(b * t, k), valid.reshape(b * t, k), at_target.reshape(b * t))
    return torch.where(valid.any(dim=-1), out.view(b, t), torch.zeros_like(at_target))


def unsupported_model(args: ModelArgs) -> str | None:
    """None when the invariant forward covers this model, else why not.

    Odd widths would leave ATen's vectorised loops a scalar tail whose place depends on the row count
    (CHUNK_ROWS x an even width is a multiple of the 32-float loop step); every released dense model is even.
    """
    from hpcrl.model.invariant_moe import unsupported

    if unsupported(args) is not None:
        return unsupported(args)
    widths = {
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "head_dim": args.head_dim,
    }
    odd = [f"{k}={v}" for k, v in widths.items() if v % 2]
    if odd:
        return f"the batch-invariant forward needs even layer widths, this model has {', '.join(odd)}"
    if args.num_heads % args.num_kv_heads:
        return f"num_heads {args.num_heads} is not a multiple of num_kv_heads {args.num_kv_heads}"
    return None
