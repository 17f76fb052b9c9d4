"""Hugging Face weights <-> Megatron-core's GPTModel layout, for one tensor-parallel rank and pipeline stage.

Megatron fuses q/k/v into `linear_qkv` (grouped per KV head: the group's query heads, then its key,
then its value) and gate/up into `linear_fc1` (each TP shard is [gate shard; up shard]); it splits
column-parallel weights (qkv, fc1, embedding, output layer) along dim 0 and row-parallel ones
(linear_proj, fc2) along dim 1, and pads the vocabulary to a multiple of the TP size. Pipeline stage
s owns a contiguous run of layers, numbered from 0 inside the stage.

A mixture-of-experts layer (Qwen3-MoE) keeps its router as `mlp.router.weight` [E, h] (HF `mlp.gate.weight`) and
its experts as `mlp.experts.local_experts.i` with the same fused fc1 ([gate; up]) and fc2 as a dense MLP. Expert
parallelism gives EP rank r the experts r * E/EP ... (r + 1) * E/EP - 1, numbered from 0 on the rank; the router
and everything else is whole on every rank.

This module is pure tensor code (no megatron import) so the conversion is testable anywhere, and the
same functions convert the Adam moments, which have the shapes of the weights they belong to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from hpcrl.model.qwen3 import ModelArgs


@dataclass(frozen=True, kw_only=True)
class Shard:
    """Where one rank sits: its TP rank and size, and the global layers its pipeline stage owns."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    num_layers: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def layers(self) -> range:
        per = self.num_layers // self.pp_size
        return range(self.pp_rank * per, (self.pp_rank + 1) * per)


def check_parallel_sizes(args: ModelArgs, tp_size: int, pp_size: int, ep_size: int = 1) -> None:
    """Raise a clear error when the model cannot be split this way."""
    if args.moe is None and ep_size > 1:
        raise ValueError(
            f"expert_parallel_size: {ep_size} needs a mixture-of-experts model, but this one is dense (no experts to "
            "split); set train.expert_parallel_size: 1"
        )
    if args.moe is not None:
        if args.moe.num_experts % ep_size:
            raise ValueError(
                f"expert_parallel_size ({ep_size}) must divide the model's num_experts ({args.moe.num_experts}): each "
                "expert-parallel rank holds an equal share of every layer's experts"
            )
        if tp_size > 1 or pp_size > 1:
            # TP would need Megatron's sequence parallelism and expert-TP shards of the experts; PP would split the
            # load-balancing loss, which Qwen3-MoE computes over all layers at once (hpcrl.model.moe.aux_loss).
            raise ValueError(
                f"the megatron backend trains a mixture-of-experts model with tensor_parallel_size 1 and "
                f"pipeline_parallel_size 1 (got {tp_size} and {pp_size}): split it with expert_parallel_size and "
                "data parallelism instead"
            )
    problems = []
    if args.num_heads % tp_size:
        problems.append(f"num_attention_heads ({args.num_heads}) is not a multiple of tensor_parallel_size")
    if args.num_kv_heads % tp_size:
        problems.append(f"num_key_value_heads ({args.num_kv_heads}) is not a multiple of tensor_parallel_size")
    if args.intermediate_size % tp_size:
        problems.append(f"intermediate_size ({args.intermediate_size}) is not a multiple of tensor_parallel_size")
    if args.num_layers % pp_size:
        problems.append(f"num_hidden_layers ({args.num_layers}) is not a multiple of pipeline_parallel_size")
    if problems:
        raise ValueError(
            f"the model cannot be split with tensor_parallel_size={tp_size}, pipeline_parallel_size={pp_size}: "
            + "; ".join(problems)
        )


_TP_SPLIT_SUFFIXES = (
    "word_embeddings.weight", "linear_qkv.weight", "linear_qkv.bias", "linear_proj.weight",
    "linear_fc1.weight", "linear_fc2.weight", "output_layer.weight",
)  # fmt: skip


def is_expert(megatron_name: str) -> bool:
    """Whether this parameter is one of an EP rank's own experts (else all EP ranks hold the same tensor)."""
    return ".mlp.experts.local_experts." in megatron_name


def is_tp_split(megatron_name: str) -> bool:
    """Whether each TP rank holds a different slice of this parameter (else all hold the same tensor)."""
    return megatron_name.endswith(_TP_SPLIT_SUFFIXES)


def padded_vocab(args: ModelArgs, tp_size: int) -> int:
    return -(-args.vocab_size // tp_size) * tp_size


def _chunk(t: Tensor, shard: Shard, dim: int) -> Tensor:
    return t.chunk(shard.tp_size, dim=dim)[shard.tp_rank].contiguous()


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, args: ModelArgs, shard: Shard) -> Tensor:
    """[nh*hd, ...], [ng*hd, ...], [ng*hd, ...] -> this rank's [(ng/tp) * (nh/ng + 2) * hd, ...]."""
    ng, hd = args.num_kv_heads, args.head_dim
    per_group = args.num_heads // ng
    rest = q.shape[1:]
    q = q.reshape(ng, per_group * hd, *rest)
    k = k.reshape(ng, hd, *rest)
    v = v.reshape(ng, hd, *rest)
    fused = torch.cat([q, k, v], dim=1)  # [ng, (per_group + 2) * hd, ...]
    return _chunk(fused, shard, 0).reshape(-1, *rest)


def _split_qkv(fused_shards: list[Tensor], args: ModelArgs) -> tuple[Tensor, Tensor, Tensor]:
    ng, hd = args.num_kv_heads, args.head_dim
    per_group = args.num_heads // ng
    full = torch.cat(fused_shards, dim=0)
    rest = full.shape[1:]
    full = full.reshape(ng, (per_group + 2) * hd, *rest)
    q, k, v = full.split([per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_layer_names(args: ModelArgs, i: int) -> list[str]:
    p = f"model.layers.{i}."
    names = [p + "input_layernorm.weight"]
    names += [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
    if args.attention_bias:
        names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    if args.qk_norm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    names += [p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight"]
    if _sparse(args, i):
        assert args.moe is not None
        names.append(p + "mlp.gate.weight")
        for e in range(args.moe.num_experts):
            names += [p + f"mlp.experts.{e}.{x}_proj.weight" for x in ("gate", "up", "down")]
    else:
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


def _sparse(args: ModelArgs, layer: int) -> bool:
    return args.moe is not None and args.moe.sparse_layers[layer]


def _local_experts(args: ModelArgs, shard: Shard) -> range:
    """The global ids of the experts this EP rank holds (its local expert i is the range's i-th)."""
    assert args.moe is not None
    per = args.moe.num_experts // shard.ep_size
    return range(shard.ep_rank * per, (shard.ep_rank + 1) * per)


def hf_names(args: ModelArgs, layers: range | None = None, *, first: bool = True, last: bool = True) -> list[str]:
    """The HF names a stage holds, in the order the weight push and the checkpoint use."""
    names = ["model.embed_tokens.weight"] if first else []
    for i in layers if layers is not None else range(args.num_layers):
        names += hf_layer_names(args, i)
    if last:
        names.append("model.norm.weight")
        if not args.tie_word_embeddings:
            names.append("lm_head.weight")
    return names


def to_megatron(hf: Callable[[str], Tensor], args: ModelArgs, shard: Shard) -> dict[str, Tensor]:
    """This rank's Megatron state (parameter names of GPTModel) from HF tensors looked up by name."""
    out: dict[str, Tensor] = {}
    vocab = padded_vocab(args, shard.tp_size)
    if shard.first_stage:
        out["embedding.word_embeddings.weight"] = _chunk(_pad_rows(hf("model.embed_tokens.weight"), vocab), shard, 0)
    for local, i in enumerate(shard.layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        a = p + "self_attn."
        out[m + "input_layernorm.weight"] = hf(p + "input_layernorm.weight")
        q, k, v = (hf(a + f"{x}_proj.weight") for x in "qkv")
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(q, k, v, args, shard)
        if args.attention_bias:
            qb, kb, vb = (hf(a + f"{x}_proj.bias") for x in "qkv")
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(qb, kb, vb, args, shard)
        if args.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf(a + "q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = hf(a + "k_norm.weight")
        out[m + "self_attention.linear_proj.weight"] = _chunk(hf(a + "o_proj.weight"), shard, 1)
        out[m + "pre_mlp_layernorm.weight"] = hf(p + "post_attention_layernorm.weight")
        if _sparse(args, i):
            out[m + "mlp.router.weight"] = hf(p + "mlp.gate.weight")
            for local_e, e in enumerate(_local_experts(args, shard)):
                x, ex = f"{m}mlp.experts.local_experts.{local_e}.", f"{p}mlp.experts.{e}."
                out[x + "linear_fc1.weight"] = torch.cat([hf(ex + "gate_proj.weight"), hf(ex + "up_proj.weight")])
                out[x + "linear_fc2.weight"] = hf(ex + "down_proj.weight")
            continue
        gate, up = _chunk(hf(p + "mlp.gate_proj.weight"), shard, 0), _chunk(hf(p + "mlp.up_proj.weight"), shard, 0)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[m + "mlp.linear_fc2.weight"] = _chunk(hf(p + "mlp.down_proj.weight"), shard, 1)
    if shard.last_stage:
        out["decoder.final_layernorm.weight"] = hf("model.norm.weight")
        head = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
        # With one stage a tied head is the embedding itself; a later stage keeps its own copy.
        if not (args.tie_word_embeddings and shard.first_stage):
            out["output_layer.weight"] = _chunk(_pad_rows(hf(head), vocab), shard, 0)
    return {k: v.contiguous() for k, v in out.items()}


def to_hf(
    tp_shards: Callable[[str], list[Tensor]], args: ModelArgs, shard: Shard,
    ep_shards: Callable[[str], list[Tensor]] | None = None,
) -> Iterator[tuple[str, Tensor]]:  # fmt: skip
    """HF (name, tensor) of this stage from the Megatron tensors of all its TP ranks, in `hf_names` order.

    `tp_shards(megatron_name)` returns that parameter from every TP rank of the stage, in rank order;
    `ep_shards(megatron_name)` a local expert's parameter from every EP rank, in rank order (needed when
    shard.ep_size > 1).
    """
    vocab = args.vocab_size

    def whole(name: str, dim: int) -> Tensor:
        return torch.cat(tp_shards(name), dim=dim)

    def replicated(name: str) -> Tensor:
        return tp_shards(name)[0]

    if shard.first_stage:
        yield "model.embed_tokens.weight", whole("embedding.word_embeddings.weight", 0)[:vocab]
    for local, i in enumerate(shard.layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        a = p + "self_attn."
        yield p + "input_layernorm.weight", replicated(m + "input_layernorm.weight")
        q, k, v = _split_qkv(tp_shards(m + "self_attention.linear_qkv.weight"), args)
        yield a + "q_proj.weight", q
        yield a + "k_proj.weight", k
        yield a + "v_proj.weight", v
        if args.attention_bias:
            qb, kb, vb = _split_qkv(tp_shards(m + "self_attention.linear_qkv.bias"), args)
            yield a + "q_proj.bias", qb
            yield a + "k_proj.bias", kb
            yield a + "v_proj.bias", vb
        if args.qk_norm:
            yield a + "q_norm.weight", replicated(m + "self_attention.q_layernorm.weight")
            yield a + "k_norm.weight", replicated(m + "self_attention.k_layernorm.weight")
        yield a + "o_proj.weight", whole(m + "self_attention.linear_proj.weight", 1)
        yield p + "post_attention_layernorm.weight", replicated(m + "pre_mlp_layernorm.weight")
        if _sparse(args, i):
            yield p + "mlp.gate.weight", replicated(m + "mlp.router.weight")
            yield from _experts_to_hf(ep_shards or (lambda n: [replicated(n)]), args, shard, p, m)
            continue
        fc1 = [s.chunk(2, dim=0) for s in tp_shards(m + "mlp.linear_fc1.weight")]
        yield p + "mlp.gate_proj.weight", torch.cat([g for g, _ in fc1])
        yield p + "mlp.up_proj.weight", torch.cat([u for _, u in fc1])
        yield p + "mlp.down_proj.weight", whole(m + "mlp.linear_fc2.weight", 1)
    if shard.last_stage:
        yield "model.norm.weight", replicated("decoder.final_layernorm.weight")
        if not args.tie_word_embeddings:
            yield "lm_head.weight", whole("output_layer.weight", 0)[:vocab]


def _experts_to_hf(
    ep_shards: Callable[[str], list[Tensor]], args: ModelArgs, shard: Shard, p: str, m: str
) -> Iterator[tuple[str, Tensor]]:
    """One sparse layer's experts in HF names, global expert order, gathered over the EP ranks."""
    assert args.moe is not None
    per = args.moe.num_experts // shard.ep_size
    experts: dict[int, tuple[Tensor, Tensor]] = {}
    for local_e in range(per):  # one gather per local expert and weight, every EP rank in the same order
        x = f"{m}mlp.experts.local_experts.{local_e}."
        fc1s, fc2s = ep_shards(x + "linear_fc1.weight"), ep_shards(x + "linear_fc2.weight")
        for r in range(shard.ep_size):
            experts[r * per + local_e] = fc1s[r], fc2s[r]
    for e in range(args.moe.num_experts):
        fc1, fc2 = experts[e]
        gate, up = fc1.chunk(2, dim=0)
        yield f"{p}mlp.experts.{e}.gate_proj.weight", gate
        yield f"{p}mlp.experts.{e}.up_proj.weight", up
        yield f"{p}mlp.experts.{e}.down_proj.weight", fc2
