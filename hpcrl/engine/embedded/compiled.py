"""The CPU decode step compiled by `torch.compile` (inductor's C++ backend): decode mode "compile".

The eager CPU step (`ForwardPaths.torch_forward` + `sampling.sample`) is ~100 small torch ops whose
fixed costs dominate a small model's step. Compiled, everything between the GEMMs (RMSNorm, q/k norm,
RoPE, attention over the cache, SiLU, residuals, the unit-temperature Gumbel-max sampler and its
log-probs) becomes a handful of fused C++ loops; the GEMMs stay extern MKL calls.

One compiled graph serves every batch size >= 2 and every attention length: the batch dimension is
marked dynamic and the keys read from the cache are `key_pos[:length]`, with length rounded up to a
multiple of 16 and masked by each row's position (at most max_len - 1 keys: a row's own key comes from the step), so
a run compiles once (batch 1 runs eager: a size
of 1 would be specialised and compile a second graph). The new K/V rows are returned with their row
index in the flattened cache and written by one `index_copy_` outside the graph (an in-graph write to
the cache input made inductor copy the whole cache each step). Attention reads the cache entries before
each row's position plus the row's new key/value, which the step computed itself.

The numbers match the eager step to float rounding (inductor's fused arithmetic and log differ from
torch's and numpy's in the last bits): tokens agree unless two candidates' noisy logits tie to ~1e-6.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

# The same bits and the same two-level choice as the eager and numpy samplers.
from hpcrl.engine.embedded.sampling import choose_tokens, chunk_uniform_at, row_keys, uniform_at

log = logging.getLogger(__name__)

# Attention lengths are rounded up to a multiple of this (fewer distinct shapes, no 0/1 sizes).
LENGTH_BUCKET = 16


def _gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """sampling.gumbel_noise for rows of `row_keys`: -log(-log(u)) of the counter-based uniforms, [n, V] float32."""
    return -torch.log(-torch.log(uniform_at(keys, torch.arange(vocab, device=keys.device, dtype=torch.int64))))


# One layer's weights: in_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, post_norm, gate_up_w, down_w (None: the
# model has no such weight: no qkv bias, no q/k norm).
LayerWeights = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
]  # fmt: skip


def decode_step(
    tokens: torch.Tensor,  # [n] int64
    pos: torch.Tensor,  # [n] int64: each row's position (= tokens already in its cache slot)
    key_pos: torch.Tensor,  # [L] arange: the cache entries read (those before pos are visible)
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64
    buffer: torch.Tensor,  # the KV cache [layers, 2, slots, kv, max_len, D]; read only
    embed: torch.Tensor,
    out_w: torch.Tensor,
    final_norm: torch.Tensor,
    cos_t: torch.Tensor,  # [max_len, D]
    sin_t: torch.Tensor,  # [max_len, D], sign-folded (DecodeRunner._rope_tables)
    layers: list[LayerWeights],
    *,
    dims: tuple[int, int, int, int, float, bool],
    windows: tuple[int | None, ...] = (),
) -> tuple[torch.Tensor, ...]:
    """Logits [n, V], the unit-temperature sample (tokens, log-probs), the new K/V rows [R, D] and
    their row indices [R] in buffer.view(-1, D). `windows`: each layer's sliding window (ModelArgs.layer_windows)."""
    nh, nkv, hd, inter, eps, qk_norm = dims
    n = tokens.shape[0]
    group = nh // nkv
    scale = 1.0 / math.sqrt(hd)
    cos, sin = cos_t[pos][:, None], sin_t[pos][:, None]  # [n, 1, D]
    x = F.embedding(tokens, embed)
    hidden = x.shape[-1]
    masked = (key_pos[None, :] >= pos[:, None])[:, None, None, :]  # [n, 1, 1, L]
    # The row's own new key (at pos) is always inside a window; the cached keys at pos - window and before are not.
    outside = {w: masked | (key_pos[None, :] <= pos[:, None] - w)[:, None, None, :] for w in set(windows) if w}
    new_kv = []
    for i, (in_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, post_norm, gate_up_w, down_w) in enumerate(layers):
        qkv = F.linear(F.rms_norm(x, (hidden,), in_norm, eps), qkv_w, qkv_b)
        q = qkv[:, : nh * hd].view(n, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].view(n, nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].view(n, nkv, hd)
        if qk_norm:
            q = F.rms_norm(q, (hd,), q_norm, eps)
            k = F.rms_norm(k, (hd,), k_norm, eps)
        q = q * cos + q.roll(hd // 2, -1) * sin
        k = k * cos + k.roll(hd // 2, -1) * sin
        new_kv.append(torch.stack([k, v], 1))  # [n, 2, kv, D]
        # narrow, not slicing: a slice clamps its end, which specialises n = slots and L = max_len.
        keys = buffer[i, 0].narrow(0, 0, n).narrow(2, 0, key_pos.shape[0])  # [n, kv, L, D]
        values = buffer[i, 1].narrow(0, 0, n).narrow(2, 0, key_pos.shape[0])
        qg = q.view(n, nkv, group, hd)
        # Reduce over D with the keys innermost, so the loop vectorises along them.
        scores = (qg[..., None] * keys.transpose(-1, -2)[:, :, None]).sum(-2) * scale  # [n, kv, g, L]
        window = windows[i] if windows else None
        scores = scores.masked_fill(outside[window] if window else masked, float("-inf"))
        own = (qg * k[:, :, None, :]).sum(-1, keepdim=True) * scale  # [n, kv, g, 1]: the new key
        top = torch.maximum(scores.amax(-1, keepdim=True), own)
        p_cache, p_own = torch.exp(scores - top), torch.exp(own - top)
        o = (p_cache[..., None] * values[:, :, None]).sum(-2) + p_own * v[:, :, None, :]
        o = o / (p_cache.sum(-1, keepdim=True) + p_own)  # [n, kv, g, D]
        x = x + F.linear(o.reshape(n, nh * hd), o_w)
        gate_up = F.linear(F.rms_norm(x, (hidden,), post_norm, eps), gate_up_w)
        x = x + F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], down_w)
    logits = F.linear(F.rms_norm(x, (hidden,), final_norm, eps), out_w)
    # sampling.sample with unit_temperature: its two-level draw over the logits, log-prob at temperature 1.
    keys = row_keys(seeds, steps)
    chosen = choose_tokens(logits, _gumbel(keys, logits.shape[-1]), chunk_uniform_at(keys))
    lp = torch.log_softmax(logits, -1).gather(-1, chosen[:, None])[:, 0]
    kv = torch.stack(new_kv, 0)  # [layers, n, 2, kv, D]
    nl, _, slots, _, max_len, _ = buffer.shape
    dev = kv.device
    row = torch.arange(nl, device=dev)[:, None, None, None] * 2 + torch.arange(2, device=dev)[None, None, :, None]
    row = (row * slots + torch.arange(n, device=dev)[None, :, None, None]) * nkv + torch.arange(nkv, device=dev)
    row = row * max_len + pos[None, :, None, None]
    return logits, chosen, lp, kv.reshape(-1, hd), row.reshape(-1)


class CompiledStep:
    """The compiled step of one DecodeRunner (compiled lazily, once per model shape)."""

    def __init__(self) -> None:
        self._fn: Any = None
        self._dims: Any = None
        self._key_pos: torch.Tensor | None = None
        self.compile_s = 0.0  # wall time of the calls that compiled

    def __call__(self, runner: Any, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits [n, V], sampled tokens [n] and their log-probs [n] of slots 0..n-1 (n >= 2); writes
        the step's K/V into the cache. The sample is only valid for unit-temperature, unfiltered rows."""
        model, cache = runner.model, runner.cache
        a = model.args
        dims = (a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, model.model.norm.eps, a.qk_norm)
        if self._fn is None or (dims, a.layer_windows) != self._dims:
            step = functools.partial(decode_step, dims=dims, windows=a.layer_windows)
            self._fn = torch.compile(step, dynamic=False, fullgraph=True)
            self._dims = (dims, a.layer_windows)
        if self._key_pos is None or self._key_pos.shape[0] != cache.max_len:
            self._key_pos = torch.arange(cache.max_len, device=runner.device)
        fused = runner.paths.torch_weights()
        cos, sin = runner.paths.rope_tables()
        layers = []
        for i, layer in enumerate(model.model.layers):
            at = layer.self_attn
            qkv_w, qkv_b, gate_up_w = fused[i]
            layers.append(
                (
                    layer.input_layernorm.weight,
                    qkv_w,
                    qkv_b,
                    at.q_norm.weight if a.qk_norm else None,
                    at.k_norm.weight if a.qk_norm else None,
                    at.o_proj.weight,
                    layer.post_attention_layernorm.weight,
                    gate_up_w,
                    layer.mlp.down_proj.weight,
                )
            )
        pos = runner.slots.positions[:n]
        # Keys before each row's position: at most max_len - 1, and never max_len, where the view of
        # the cache would become contiguous and inductor would have specialised the first graph on not.
        length = min(-(-max(int(pos.max()), 1) // LENGTH_BUCKET) * LENGTH_BUCKET, cache.max_len - 1)
        dynamic = (runner.slots.tokens[:n], pos, self._key_pos[:length], runner.slots.seeds[:n], runner.slots.steps[:n])
        for t in dynamic:
            torch._dynamo.mark_dynamic(t, 0)
        first = self.compile_s == 0.0
        t0 = time.perf_counter()
        logits, tok, lp, kv, rows = self._fn(
            *dynamic, cache.buffer, model.model.embed_tokens.weight, model.output_weight, model.model.norm.weight,
            cos, sin, layers,
        )  # fmt: skip
        if first:
            self.compile_s = time.perf_counter() - t0
            log.info("compiled the CPU decode step in %.1f s", self.compile_s)
        cache.buffer.view(-1, kv.shape[-1]).index_copy_(0, rows, kv)
        return logits, tok, lp
