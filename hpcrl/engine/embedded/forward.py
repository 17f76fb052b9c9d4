"""The decode step's forward over the model's weights, with plain torch ops (the CPU step and prefill) or with the
fused Triton kernels (CUDA), and the tables both read: each layer's fused q/k/v and gate/up weights and RoPE's cos/sin.

`ForwardPaths.fused_forward` is the "triton" and "graph" modes' step (captured by `graphs.GraphCache` in "graph");
`torch_forward` and `torch_prefill` are the CPU's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hpcrl.engine.embedded.kernels import attention, gemm, launch, norms
from hpcrl.model.qwen3 import CausalLM, KVCache, rope_cos_sin, window_band

FusedWeights = list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]


class ForwardPaths:
    """The forward of one model into one KV cache (`set_cache`), and the fused weights and RoPE tables it keeps."""

    def __init__(
        self, model: CausalLM, cache: KVCache | None, *, device: torch.device, split_k: tuple[int, int]
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.split_k = split_k
        # The model's dtype, not the cache's: an 8-bit cache stores K/V, the math runs in the model's dtype.
        self.model_dtype = model.model.embed_tokens.weight.dtype
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._torch_rope: tuple[torch.Tensor, torch.Tensor] | None = None
        # Per layer: the fused [q; k; v] weight (and bias) and [gate; up] weight that the model's
        # parameters are views of (see fuse_weights).
        self.fused: FusedWeights | None = None

    def set_cache(self, cache: KVCache | None) -> None:
        self.cache = cache
        self._rope = None
        self._torch_rope = None

    def drop_fused(self) -> None:
        """Forget the fused weights (re-made from the parameters on the next fused step)."""
        self.fused = None

    def fuse_weights(self) -> None:
        """Make each layer's q/k/v (and gate/up) weights views of one tensor, so one GEMM computes them.

        The parameters keep their names and shapes, and weight updates that copy into them (every
        update path does) write into the fused tensors, so captured graphs stay valid. Releasing
        the weights replaces the parameters' storage; reset_graphs then drops these tensors too.
        """
        fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        for layer in self.model.model.decoder_layers:
            at, mlp = layer.self_attn, layer.mlp
            qkv_w = _fuse([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
            qkv_b = _fuse([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]) if at.q_proj.bias is not None else None
            gate_up = _fuse([mlp.gate_proj.weight, mlp.up_proj.weight])
            fused.append((qkv_w, qkv_b, gate_up))
        self.fused = fused

    def fused_forward(self, tokens: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        """Logits [n, V] of the tokens in slots 0..n-1 with the fused kernels; no host syncs."""
        model, cache = self.model, self.cache
        assert cache is not None
        a = model.args
        fused, rope = self.kernel_tables()
        pos = positions[:n]
        layers = model.model.decoder_layers
        embed = model.model.embed_tokens.weight
        resid = torch.empty(n, a.hidden_size, dtype=embed.dtype, device=embed.device)
        h = torch.empty_like(resid)
        first = layers[0].input_layernorm
        norms.embed_rmsnorm(tokens[:n], embed, resid, first.weight, first.eps, h)
        nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
        scale = 1.0 / math.sqrt(hd)
        act = torch.empty(n, a.intermediate_size, dtype=h.dtype, device=h.device)
        gemm_cfg = launch.SETTINGS.gemm_configs() if launch.SETTINGS.gemm == "triton" else None
        for i, layer in enumerate(layers):
            at = layer.self_attn
            qkv_w, qkv_b, gate_up_w = fused[i]
            if gemm_cfg is not None:
                qkv = gemm.linear(h, qkv_w, qkv_b, config=gemm_cfg["qkv"])
            else:
                qkv = F.linear(h, qkv_w, qkv_b)  # [n, (H + 2 KVH) D]
            norms.layer_qk_norm_rope_store(at, a, qkv, rope, pos, cache.k[i], cache.v[i])
            o = torch.empty(n, nh * hd, dtype=h.dtype, device=h.device)
            attention.decode_attention(qkv, cache.k[i], cache.v[i], pos, o, nh, nkv, hd, scale, window=a.window(i))
            post = layer.post_attention_layernorm
            if gemm_cfg is not None:
                # o and down as split-K partials that add_rmsnorm sums; gate/up with the SwiGLU product built in.
                norms.add_rmsnorm(gemm.linear(o, at.o_proj.weight, config=gemm_cfg["o"]), resid, post.weight,
                                    post.eps, h)  # fmt: skip
                act = gemm.linear(h, gate_up_w, config=gemm_cfg["gate_up"], gated=True)
                d = gemm.linear(act, layer.mlp.down_proj.weight, config=gemm_cfg["down"])
            else:
                split_o, split_down = self.split_k if n <= gemm.CUBLAS_SPLIT_K_MAX_ROWS else (1, 1)
                norms.add_rmsnorm(gemm.split_k_linear(o, at.o_proj.weight, split_o), resid, post.weight,
                                    post.eps, h)  # fmt: skip
                gemm.silu_mul(F.linear(h, gate_up_w), act)
                d = gemm.split_k_linear(act, layer.mlp.down_proj.weight, split_down)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            norms.add_rmsnorm(d, resid, nxt.weight, nxt.eps, h)
        return model.logits(h)

    def kernel_tables(
        self,
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
        """The fused kernels' inputs: each layer's fused weights, and cos/sin [max_len, D] in the model's dtype."""
        assert self.cache is not None
        if self._rope is None:
            a = self.model.args
            pos = torch.arange(self.cache.max_len, device=self.device)
            self._rope = rope_cos_sin(pos, a.head_dim, a.rope_theta, self.model_dtype, a.rope_scaling)
        if self.fused is None:
            self.fuse_weights()
        assert self.fused is not None
        return self.fused, self._rope

    def torch_forward(self, tokens: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        """Logits [n, V] of the tokens in slots 0..n-1 with plain torch ops (the CPU decode step).

        The math of `forward_cached` for one token per row, in about a third of its ops (each op's
        fixed cost is what a small model's CPU step is made of): fused QKV and gate/up GEMMs, one
        RMSNorm op, q and k heads normalised and rotated together and written back into the QKV
        output, where the new K and V rows sit side by side and reach the cache in one index_put;
        grouped-query attention as two batched matmuls over the cache without expanding K/V heads.
        """
        model, cache = self.model, self.cache
        assert cache is not None and cache.buffer is not None
        a = model.args
        fused = self.torch_weights()
        nh, nkv, hd, inter = a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size
        pos = positions[:n]
        length = min(int(pos.max()) + 1, cache.max_len)
        rope = self.rope_tables()
        cos, sin = rope[0][pos][:, None], rope[1][pos][:, None]  # [n, 1, D]
        # Indices of each row's new K and V entries in a layer's [2, slots, kv, L, D] block: [n, 2, kv].
        dev = self.device
        kv_index = (
            torch.arange(2, device=dev)[None, :, None],
            torch.arange(n, device=dev)[:, None, None],
            torch.arange(nkv, device=dev)[None, None, :],
            pos[:, None, None],
        )
        # Attention runs over (row, kv head) pairs as one batch of [group, D] x [D, length] products.
        key_pos = torch.arange(length, device=dev)
        row_pos = pos.repeat_interleave(nkv)[:, None, None]
        biases: dict[int | None, torch.Tensor] = {}  # per sliding window (None: the whole cache)
        for window in set(a.layer_windows or (None,)):
            bias = torch.zeros(n * nkv, 1, length, dtype=cos.dtype, device=dev)
            hidden_keys = key_pos > row_pos
            if window is not None:
                hidden_keys |= key_pos <= row_pos - window
            biases[window] = bias.masked_fill_(hidden_keys, float("-inf"))
        scale = 1.0 / math.sqrt(hd)
        group = nh // nkv
        layers = model.model.decoder_layers
        x = F.embedding(tokens[:n], model.model.embed_tokens.weight)
        for i, layer in enumerate(layers):
            at, norm = layer.self_attn, layer.input_layernorm
            qkv_w, qkv_b, gate_up_w = fused[i]
            qkv = _linear(F.rms_norm(x, (a.hidden_size,), norm.weight, norm.eps), qkv_w, qkv_b)
            qk = self.norm_rope_qk(qkv, at, cos, sin)
            block = cache.buffer[i]
            block.index_put_(kv_index, qkv[:, nh * hd :].view(n, 2, nkv, hd))
            q = qk[:, :nh].reshape(n * nkv, group, hd)
            keys = block[0, :n, :, :length].reshape(n * nkv, length, hd)  # a view: slots and heads merge
            scores = torch.baddbmm(biases[a.window(i)], q, keys.transpose(1, 2), alpha=scale)
            o = torch.bmm(torch.softmax(scores, -1), block[1, :n, :, :length].reshape(n * nkv, length, hd))
            x = x + _linear(o.reshape(n, nh * hd), at.o_proj.weight)
            post = layer.post_attention_layernorm
            gate_up = _linear(F.rms_norm(x, (a.hidden_size,), post.weight, post.eps), gate_up_w)
            x = x + _linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.mlp.down_proj.weight)
        final = model.model.norm
        return _linear(F.rms_norm(x, (a.hidden_size,), final.weight, final.eps), model.output_weight)

    def torch_weights(self) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
        if self.fused is None:
            self.fuse_weights()
        assert self.fused is not None
        return self.fused

    def rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [max_len, D], for `_norm_rope_qk`."""
        if self._torch_rope is None:
            assert self.cache is not None
            a = self.model.args
            pos = torch.arange(self.cache.max_len, device=self.device)
            cos, sin = rope_cos_sin(pos, a.head_dim, a.rope_theta, self.model_dtype, a.rope_scaling)
            half = a.head_dim // 2
            sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin)
            # rotate_half(x) = roll(x, D/2) * sign: the sign goes into the sin table.
            self._torch_rope = (cos, sin * sign)
        return self._torch_rope

    def norm_rope_qk(self, qkv: torch.Tensor, at: Any, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Normalise (qk_norm) and rotate the q and k heads of a QKV output [..., (H + 2 KVH) D] in
        place; returns them as a view [..., H + KVH, D]. cos/sin broadcast against that view."""
        a = self.model.args
        nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
        qk = qkv[..., : (nh + nkv) * hd].unflatten(-1, (nh + nkv, hd))
        normed = qk
        if a.qk_norm:
            normed = F.rms_norm(qk, (hd,), eps=at.q_norm.eps)
            normed[..., :nh, :] *= at.q_norm.weight
            normed[..., nh:, :] *= at.k_norm.weight
        torch.addcmul(normed * cos, normed.roll(hd // 2, -1), sin, out=qk)
        return qk

    def torch_prefill(self, ids: torch.Tensor, first_slot: int, last: torch.Tensor) -> torch.Tensor:
        """`forward_cached(from_start=True)` in plain torch ops with the decode step's fused weights and
        GEMMs. The last layer's attention output and MLP are computed for the `last` tokens only: the
        cache needs every token's K/V, but nothing else needs the last layer's other outputs."""
        model, cache = self.model, self.cache
        assert cache is not None and cache.buffer is not None
        a = model.args
        fused = self.torch_weights()
        nh, nkv, hd, inter, hidden = a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, a.hidden_size
        b, t = ids.shape
        rope = self.rope_tables()
        cos, sin = rope[0][:t, None], rope[1][:t, None]  # [T, 1, D]
        rows = slice(first_slot, first_slot + b)
        batch = torch.arange(b, device=self.device)
        layers = model.model.decoder_layers
        x = F.embedding(ids, model.model.embed_tokens.weight).view(b * t, hidden)
        for i, layer in enumerate(layers):
            at, norm = layer.self_attn, layer.input_layernorm
            qkv_w, qkv_b, gate_up_w = fused[i]
            qkv = _linear(F.rms_norm(x, (hidden,), norm.weight, norm.eps), qkv_w, qkv_b).view(b, t, -1)
            qk = self.norm_rope_qk(qkv, at, cos, sin)  # [B, T, H + KVH, D]
            block = cache.buffer[i]  # [2, slots, KVH, L, D]
            block[:, rows, :, :t] = qkv[..., nh * hd :].view(b, t, 2, nkv, hd).permute(2, 0, 3, 1, 4)
            keys, values = block[0, rows, :, :t], block[1, rows, :, :t]
            window = a.window(i)
            window = window if window is not None and t > window else None  # None: plain causal
            if i + 1 < len(layers):
                q = qk[:, :, :nh].transpose(1, 2)
                if window is None:
                    o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=nh != nkv)
                else:
                    band = window_band(torch.arange(t, device=self.device), t, window)
                    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=band, enable_gqa=nh != nkv)
                o = o.transpose(1, 2).reshape(b * t, nh * hd)
            else:
                x = x.view(b, t, hidden)[batch, last]
                q = qk[batch, last, :nh][:, :, None]  # [B, H, 1, D]
                visible = window_band(last, t, window or t)[:, None, None]
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=nh != nkv)
                o = o.reshape(b, nh * hd)
            x = x + _linear(o, at.o_proj.weight)
            post = layer.post_attention_layernorm
            gate_up = _linear(F.rms_norm(x, (hidden,), post.weight, post.eps), gate_up_w)
            x = x + _linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.mlp.down_proj.weight)
        final = model.model.norm
        return _linear(F.rms_norm(x, (hidden,), final.weight, final.eps), model.output_weight)


def _fuse(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor holding the params stacked on dim 0; each param becomes a view of its rows."""
    fused = torch.cat([p.detach() for p in params], dim=0)
    offset = 0
    for p in params:
        rows = p.shape[0]
        p.data = fused[offset : offset + rows]
        offset += rows
    return fused


# oneDNN's GEMM (AVX-512 on any x86 vendor) ran the engine's CPU GEMMs 1.4-2.3x faster than MKL's
# here (an AMD EPYC, where MKL takes its AVX2 path), but it costs ~10 us more per call: up to about two
# million multiply-adds (a 64x64x256 GEMM took 20-30 us with oneDNN, 20 with MKL) MKL wins. Only
# float32 was measured.
_ONEDNN_MIN_MACS = 1 << 21
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def split_k_for(args: Any, asked: tuple[int, int] | None) -> tuple[int, int]:
    """engine.kernels.cublas_split_k for a model: (o, down) parts that divide its K (heads x head_dim, the
    intermediate size). The default (null) that does not divide falls back to 1 (whole); a setting given is an
    error."""
    wanted = asked or gemm.CUBLAS_SPLIT_K_DEFAULT
    splits = []
    for what, parts, k in (
        ("o", wanted[0], args.num_heads * args.head_dim),
        ("down", wanted[1], args.intermediate_size),
    ):
        if k % parts == 0:
            splits.append(parts)
        elif asked is not None:
            raise ValueError(
                f"kernels.cublas_split_k {','.join(map(str, asked))}: {parts} parts do not divide this model's "
                f"{what} GEMM, K = {k}; use parts that divide it, or null for the default"
            )
        else:
            splits.append(1)
    return splits[0], splits[1]


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for 2-D CPU inputs, through oneDNN where that is faster."""
    if (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.shape[0] * w.shape[0] * w.shape[1] >= _ONEDNN_MIN_MACS
    ):
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)
