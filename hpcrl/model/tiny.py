"""A tiny Qwen3-architecture model with a character-level tokenizer, written as a Hugging Face dir.

No model hub is reachable from the machines hpcrl tests on, so the quickstart and the tests create
their model here; it loads through the same code path as Qwen3-0.6B.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Printable ASCII plus newline: enough for arithmetic, GSM8K-style text and chat markup.
CHARACTERS = tuple(chr(i) for i in range(32, 127)) + ("\n",)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """The shape of a tiny random Qwen3-architecture model with a character-level tokenizer."""

    num_layers: int = 2
    """Decoder layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 128
    """Width of each layer's SwiGLU MLP."""
    num_heads: int = 4
    """Query heads per layer."""
    num_kv_heads: int = 2
    """Key/value heads per layer (grouped-query attention); num_heads must be a multiple of it."""
    head_dim: int = 16
    """Width of one attention head; even (RoPE rotates pairs)."""
    max_position_embeddings: int = 1024
    """Longest sequence (prompt + answer) the model takes."""
    seed: int = 0
    """Seed of the random weights."""
    num_experts: int = 0
    """Experts per layer of a Qwen3-MoE model (every layer sparse); 0: a dense Qwen3 model."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k) when num_experts > 0."""
    moe_intermediate_size: int = 32
    """Width of each expert's SwiGLU MLP when num_experts > 0."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_experts < 0:
            raise ValueError("num_experts must be >= 0 (0: a dense model)")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}"
            )
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError("moe_intermediate_size must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    # [\s\S], not ".": a dot skips newlines, so "\n\n" was one piece and encoded as <|endoftext|>.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )


def _config_fields(dims: Any, *, vocab_size: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """The fields the dense and the MoE config share: dims, tied embeddings, token ids, RoPE base."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "max_position_embeddings": dims.max_position_embeddings,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "bos_token_id": None,
        # transformers 5 takes it into rope_parameters (its signature lists only that); 4.x reads rope_theta.
        "rope_theta": 1_000_000.0,
    }


def qwen3_config(dims: Any, *, vocab_size: int, eos_id: int, pad_id: int) -> Any:
    """A transformers Qwen3Config (tied embeddings) for `dims` (a TinyModelSpec or a ModelShape)."""
    from transformers import Qwen3Config

    config = Qwen3Config(**_config_fields(dims, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id))
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def qwen3_moe_config(spec: TinyModelSpec, *, vocab_size: int, eos_id: int, pad_id: int) -> Any:
    """A transformers Qwen3MoeConfig (untied embeddings, every layer sparse) for `spec`: untied as every published
    Qwen3-MoE checkpoint is, and as SGLang needs (engine/sglang.py, check_sglang_loads_head, says why)."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **(_config_fields(spec, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id) | {"tie_word_embeddings": False}),
        moe_intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers draws a "Writing model shards" bar for a one-file model; the CLI's own line says what was made."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def init_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), *, overwrite: bool = False) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to out_dir."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        # --overwrite replaces a model directory; a file there is not one, and is never deleted.
        raise FileExistsError(f"{out_dir} is a file, not a directory; choose another path for the model")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass --overwrite to replace it")
    tokenizer = build_tokenizer()
    vocab_size = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(spec.seed)
    if spec.num_experts:
        from transformers import Qwen3MoeForCausalLM

        config = qwen3_moe_config(spec, vocab_size=vocab_size, eos_id=eos_id, pad_id=tokenizer.pad_token_id)
        model = Qwen3MoeForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
        with torch.no_grad():  # the untied head starts as the embeddings: the same logits a tied model would give
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    else:
        config = qwen3_config(spec, vocab_size=vocab_size, eos_id=eos_id, pad_id=tokenizer.pad_token_id)
        model = Qwen3ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # transformers types .to badly
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    with _quiet_progress():
        model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
    (tmp / "hpcrl_tiny_spec.json").write_text(json.dumps(asdict(spec)))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return out_dir


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Any dense Qwen3 shape, for benchmarks: random weights, the character tokenizer, real-model sizes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 40960
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < len(SPECIAL_TOKENS) + len(CHARACTERS):
            raise ValueError(f"vocab_size must hold the character tokenizer ({len(SPECIAL_TOKENS) + len(CHARACTERS)})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")


# Qwen3-0.6B's config.json: the shape hpcrl's GPU targets are stated for.
QWEN3_0_6B_SHAPE = ModelShape(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
)


def init_shaped_model(
    out_dir: str | Path,
    shape: ModelShape,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    overwrite: bool = False,
) -> Path:
    """Write a random-weight Qwen3 model of `shape` (tied embeddings) with the character tokenizer.

    Built with hpcrl's own `CausalLM` and initialised on `device` (a GPU makes a 0.6B model in about a
    second), so it needs no model hub. Token ids past the tokenizer's 99 decode to nothing; benchmarks
    send token ids.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from hpcrl.model.hf import parse_dtype
    from hpcrl.model.qwen3 import CausalLM, ModelArgs

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True to replace it")
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = qwen3_config(shape, vocab_size=shape.vocab_size, eos_id=eos_id, pad_id=tokenizer.pad_token_id)
    args = ModelArgs.from_hf_config(config.to_dict())
    model = CausalLM.without_init(args, device)
    gen = torch.Generator(device=device).manual_seed(shape.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)  # transformers' initializer_range
    torch_dtype = parse_dtype(dtype)
    state = {k: v.detach().to(torch_dtype).to("cpu").contiguous() for k, v in model.state_dict().items()}
    del model
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    config.dtype = torch_dtype
    config.save_pretrained(tmp)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
    (tmp / "hpcrl_model_shape.json").write_text(json.dumps(asdict(shape)))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return out_dir
