"""The prompt pass (prefill) with the decode step's fused kernels, for the "triton" and "graph" modes.

`CausalLM.forward_cached(from_start=True)` prefills with the model's own modules: on an H200 a batch of 32
prompts x 128 tokens of the Qwen3-0.6B shape runs about 20 ms, most of it elementwise kernels in fp32 (each
RMSNorm is eight of them, RoPE six per tensor) over [4096 tokens x hidden] tensors, against ~5 ms of GEMMs.
This path runs a prompt token as the decode step runs a row: one fused QKV and one gate/up GEMM, `add_rmsnorm`,
`qk_norm_rope_store` (one program per token, into its prompt's cache slot) and `silu_mul`, with SDPA's causal
flash attention over the QKV output. The last layer's output projection and MLP run for the `last` tokens only.

The default (engine.kernels.prefill: auto, fused in these modes): on an H200 it took the 256 x 128-token prefill
of the 8-bit-cache decode bench from 0.174 to 0.064 s and the bench from 63.5k to 67.4k tok/s, with the same
train/rollout log-prob gap (benchmarks/decode_h200_2026-12.md). engine.kernels.prefill: model keeps forward_cached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpcrl.engine.embedded.kernels import gemm, norms
from hpcrl.model.qwen3 import CausalLM, KVCache, window_band


def prefill_logits(
    model: CausalLM,
    cache: KVCache,
    fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]],
    rope: tuple[torch.Tensor, torch.Tensor],
    ids: torch.Tensor,
    first_slot: int,
    last: torch.Tensor,
) -> torch.Tensor:
    """`forward_cached(ids, cache, first_slot, zeros, last, from_start=True)`: right-padded prompts ids [B, T] from
    position 0 into cache slots first_slot..; the logits [B, V] at `last` [B] of each row.

    `fused`: each layer's (qkv weight, qkv bias, gate/up weight), views the parameters share (DecodeRunner
    fuses them); `rope`: cos and sin tables [max_len, D] in the model's dtype. Padded tokens write cache entries
    past their row's end, as forward_cached's do; decode overwrites them before anyone reads them."""
    a = model.args
    b, t = ids.shape
    n = b * t
    # forward_cached's slicing refuses these; the kernels would write outside the prompts' slots or read past RoPE.
    if first_slot < 0 or first_slot + b > cache.k[0].shape[0] or t > rope[0].shape[0]:
        raise ValueError(
            f"prefill of {b} prompts x {t} tokens into slots {first_slot}.. does not fit a cache of "
            f"{cache.k[0].shape[0]} slots x {rope[0].shape[0]} positions"
        )
    nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
    dev = ids.device
    positions = torch.arange(t, device=dev).repeat(b)  # token r: prompt r // t, position r % t
    layers = model.model.decoder_layers
    embed = model.model.embed_tokens.weight
    resid = torch.empty(n, a.hidden_size, dtype=embed.dtype, device=dev)
    h = torch.empty_like(resid)
    first = layers[0].input_layernorm
    norms.embed_rmsnorm(ids.reshape(n), embed, resid, first.weight, first.eps, h)
    for i, layer in enumerate(layers):
        at = layer.self_attn
        qkv_w, qkv_b, gate_up_w = fused[i]
        qkv = F.linear(h, qkv_w, qkv_b)  # [n, (H + 2 KVH) D]
        norms.layer_qk_norm_rope_store(
            at, a, qkv, rope, positions, cache.k[i], cache.v[i], first_slot=first_slot, rows_per_slot=t,
            store_k=True,
        )  # fmt: skip
        heads = qkv.view(b, t, nh + 2 * nkv, hd).transpose(1, 2)  # [B, heads, T, D], views of the GEMM's output
        q, k, v = heads[:, :nh], heads[:, nh : nh + nkv], heads[:, nh + nkv :]
        window = a.window(i)
        if window is not None and t > window:
            band = window_band(torch.arange(t, device=dev), t, window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=nh != nkv)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)
        o = o.transpose(1, 2).reshape(n, nh * hd)
        if i + 1 == len(layers):
            # Only the tokens that predict each prompt's next token go on; every token's K/V is cached by now.
            rows = torch.arange(b, device=dev) * t + last
            o, resid = o[rows], resid[rows]
            h = torch.empty_like(resid)
        o = F.linear(o, at.o_proj.weight)
        post = layer.post_attention_layernorm
        norms.add_rmsnorm(o, resid, post.weight, post.eps, h)
        act = torch.empty(h.shape[0], a.intermediate_size, dtype=h.dtype, device=dev)
        gemm.silu_mul(F.linear(h, gate_up_w), act)
        d = F.linear(act, layer.mlp.down_proj.weight)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
        norms.add_rmsnorm(d, resid, nxt.weight, nxt.eps, h)
    return model.logits(h)
