"""Megatron-core's GPTModel for a Hugging Face Qwen3/Llama config, on CUDA or (for tests) on CPU with gloo.

Two choices differ from Megatron's local layer spec, both for memory and for CPU:
- core attention is torch's `scaled_dot_product_attention` (flash / memory-efficient kernels on CUDA)
  instead of Megatron's unfused DotProductAttention, whose fp32 [b, heads, s, s] softmax does not
  fit a 0.6B model at 8 x 2048 on an H200 without TransformerEngine;
- on CPU, RoPE frequencies stay on the CPU: megatron-core 0.16 moves them to `torch.cuda.current_device()`
  on first use. That is the only CPU accommodation inside the model; the others (no Megatron
  optimizer or DDP, which allocate CUDA buffers) live in the backend.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hpcrl.model.qwen3 import ModelArgs
from hpcrl.trainer.megatron.layout import padded_vocab


def _megatron() -> Any:
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "train.backend=megatron needs megatron-core: pip install 'hpcrl[megatron]' "
            "(megatron-core 0.16.1 on Python 3.11, >= 0.17 on Python >= 3.12)"
        ) from exc
    import megatron.core as mc

    return mc


def init_parallel_state(tp_size: int, pp_size: int, ep_size: int = 1) -> None:
    """Megatron's process groups over the default torch.distributed group (which must exist)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size, expert_model_parallel_size=ep_size
    )


def _sdpa_attention_class() -> type:
    from megatron.core.transformer.module import MegatronModule

    class SDPAttention(MegatronModule):
        """Causal attention over this rank's heads through torch SDPA; GQA without materialized KV repeats."""

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     cp_comm_type: str | None = None, pg_collection: Any = None) -> None:  # fmt: skip
            super().__init__(config=config)
            if config.context_parallel_size != 1:
                raise ValueError("hpcrl's SDPA attention does not support context parallelism")
            self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
            self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
            # From the config, not the tensors' shapes: under torch.compile with dynamic shapes a shape
            # comparison is a SymBool, which SDPA's enable_gqa does not take (a graph break).
            self.gqa = config.num_query_groups != config.num_attention_heads

        def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    attn_mask_type: Any = None, attention_bias: Any = None,
                    packed_seq_params: Any = None) -> Tensor:  # fmt: skip
            if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
                raise ValueError("SDPAttention takes right-padded causal batches only (no mask, bias or packing)")
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale,
                dropout_p=self.dropout_p if self.training else 0.0, enable_gqa=self.gqa,
            )  # fmt: skip
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPAttention


def transformer_config(
    args: ModelArgs, *, tp_size: int, pp_size: int, dtype: torch.dtype, cpu: bool, ep_size: int = 1
) -> Any:
    from megatron.core.transformer import TransformerConfig

    from hpcrl.trainer.megatron.moe import moe_config

    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        ffn_hidden_size=args.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.attention_bias,
        qk_layernorm=args.qk_norm,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=cpu,
        perform_initialization=False,  # every weight is loaded from the HF dir right after
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **(moe_config(args.moe, ep_size=ep_size) if args.moe is not None else {}),
    )


def _rope_on_cpu(rotary: Any) -> None:
    def get_emb(self: Any, max_seq_len: int, offset: int = 0) -> Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    rotary.get_emb = types.MethodType(get_emb, rotary)


def _hidden_gpt_model_class() -> type:
    from megatron.core.models.gpt import GPTModel

    class HiddenGPTModel(GPTModel):
        """GPTModel whose last stage can stop before the output layer: `forward(..., hidden_only=True)` returns
        the final norm's output [s, b, h], for the fused log-prob head (train.logprob_chunk_tokens).

        `_postprocess` is where megatron-core (0.16 and 0.19) turns the decoder's output into logits; its own
        early return for non-last stages is the same thing, so nothing before it is skipped."""

        _hidden_only = False

        def forward(self, *args: Any, hidden_only: bool = False, **kwargs: Any) -> Tensor:
            self._hidden_only = hidden_only
            try:
                return super().forward(*args, **kwargs)
            finally:
                self._hidden_only = False

        def _postprocess(self, **kwargs: Any) -> Tensor:
            if self._hidden_only:
                return kwargs["hidden_states"]
            return super()._postprocess(**kwargs)

    return HiddenGPTModel


def build_gpt_model(
    args: ModelArgs,
    *,
    tp_size: int,
    pp_size: int,
    pp_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    ep_size: int = 1,
) -> torch.nn.Module:
    """This rank's GPTModel (its pipeline stage, its TP shards, its EP rank's experts), with uninitialized weights.
    A mixture-of-experts model's GPTModel has a `routing` (hpcrl.model.moe.Routing) its forwards fill."""
    if args.rope_scaling is not None or args.min_window is not None:
        what = "RoPE scaling" if args.rope_scaling is not None else "sliding-window attention"
        raise ValueError(
            f"train.backend: megatron does not compute this model's {what}; train it with train.backend: torch"
        )
    _megatron()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cpu = device.type == "cpu"
    config = transformer_config(args, tp_size=tp_size, pp_size=pp_size, dtype=dtype, cpu=cpu, ep_size=ep_size)
    experts = args.moe.num_experts if args.moe is not None else None
    # SequentialMLP experts (moe_grouped_gemm off): plain torch, on a CPU too (grouped GEMMs need TE or grouped_gemm).
    spec = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=args.qk_norm, normalization="RMSNorm"
    )
    spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    with _no_embedding_sync() if cpu else contextlib.nullcontext():
        model = _gpt_model(_hidden_gpt_model_class(), config, spec, args, tp_size, pp_size, pp_rank)
    if cpu:
        _rope_on_cpu(model.rotary_pos_emb)
    if args.moe is not None:
        from hpcrl.trainer.megatron.moe import attach_routing

        attach_routing(model, args.moe)
    return model.to(device)


@contextlib.contextmanager
def _no_embedding_sync() -> Iterator[None]:
    """On CPU, skip the start-up all-reduce that copies a tied embedding to the last pipeline stage:
    megatron-core 0.16 moves the weight to CUDA for it, and hpcrl loads both copies from the HF dir anyway."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule._is_in_embd_group
    LanguageModule._is_in_embd_group = lambda self: False
    try:
        yield
    finally:
        LanguageModule._is_in_embd_group = original


def _gpt_model(GPTModel: Any, config: Any, spec: Any, args: ModelArgs, tp_size: int, pp_size: int,
               pp_rank: int) -> torch.nn.Module:  # fmt: skip
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(args, tp_size),
        max_sequence_length=args.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(args.rope_theta),
    )


def output_weight(model: Any) -> Tensor:
    """The last stage's LM head shard [V/tp, h]: the output layer's weight, or the tied embedding's (which
    megatron-core keeps in the embedding on a one-stage model and in the output layer on a last stage)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def compile_layers(model: Any) -> None:
    """`torch.compile` each TransformerLayer in place (train.torch_compile): the layers share one graph, and
    parameter names (pushes, checkpoints, the optimizers' maps) stay those of the eager model."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for layer in model.decoder.layers:
        for module in layer.modules():
            if isinstance(module, RowParallelLinear):
                _pass_tp_group(module)
            if isinstance(module, ColumnParallelLinear) and module.allreduce_dgrad:
                # With TP > 1 the linear's own backward all-reduces its input gradient with async_op=True, which
                # dynamo cannot trace (a graph break at every qkv and fc1 GEMM). Without the flag the module
                # routes its input through copy_to_tensor_model_parallel_region instead, whose backward is the
                # same all-reduce, synchronous: the same sum, at the cost of overlapping it with the weight-
                # gradient GEMM.
                module.allreduce_dgrad = False
        layer.compile()


def _pass_tp_group(linear: Any) -> None:
    """megatron-core 0.16 and 0.19's RowParallelLinear.forward hands its linear function tp_group=None, which
    then looks the group up and `warnings.warn`s on global rank 0 at every call. Dynamo cannot trace or
    reorder that warning: it breaks the graph inside the attention's activation-offloading context manager,
    and dynamo then runs the rest of the layer eagerly. Passing the module's own group (the one the lookup
    returns) removes the call."""
    impl = linear._forward_impl

    def forward_impl(input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = linear.tp_group
        return impl(input, weight, *args, **kwargs)

    linear._forward_impl = forward_impl
