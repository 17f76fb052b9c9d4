"""One causal-LM implementation shared by the embedded engine and the torch trainer.

Qwen3 and Llama-family dense models (GQA, RMSNorm, SwiGLU, RoPE, optional QK-norm, tied or untied
embeddings), and Qwen3-MoE, whose expert layers live in `hpcrl.model.moe`. Parameter names equal the Hugging
Face names, so a state dict loads from and saves to an HF directory unchanged, and the weight push sends exactly
the names an SGLang server loads.

The batch-invariant forward (`hpcrl.model.invariant`) runs on these same modules' parameters; with
`engine.batch_invariant` and `train.logprobs: invariant` the engine samples from it and the trainer scores with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hpcrl.model.moe import MoeArgs, Routing, SparseMoeBlock
from hpcrl.model.rope import RopeScaling, inv_freq, parse_rope_scaling

_CACHED_ATTENTION_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
"""SDPA kernels for attention over the K/V cache on CUDA: any but cuDNN's (see Attention.forward_cached)."""


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    qk_norm: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None
    layer_windows: tuple[int | None, ...] = ()
    """Per layer, the sliding attention window in tokens (a token sees itself and the window - 1 before it), or
    None for full attention; empty: every layer full."""
    moe: MoeArgs | None = None
    """The expert settings of a mixture-of-experts model (Qwen3-MoE); None for a dense model."""

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def min_window(self) -> int | None:
        """The narrowest sliding window of any layer (None: every layer attends to its whole context)."""
        windows = [w for w in self.layer_windows if w is not None]
        return min(windows) if windows else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """The settings of a Hugging Face config.json; a field that changes the function and that hpcrl does not
        compute is refused by name (docs: the supported-fields table), never ignored."""
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; hpcrl's embedded engine and torch trainer "
                f"support causal LMs of types {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _refuse_uncomputed_fields(cfg, model_type)
        rope = cfg.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        num_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            eos_token_ids=eos_ids,
            rope_scaling=parse_rope_scaling(cfg),
            layer_windows=_layer_windows(cfg, model_type),
            moe=MoeArgs.from_hf_config(cfg) if model_type == "qwen3_moe" else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelArgs:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: --model must be a Hugging Face model directory "
                "(create a tiny one with `hpcrl model init-tiny DIR`)"
            )
        try:
            cfg = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); download or export the model again") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path} must hold a JSON object of model settings")
        try:
            args = cls.from_hf_config(cfg)
        except KeyError as exc:
            raise ValueError(
                f"{path} lacks the key {exc.args[0]!r}, which a {cfg.get('model_type', 'causal LM')} config needs; "
                "the file is incomplete: download or export the model again"
            ) from None
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            extra = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
            args = _replace(args, eos_token_ids=tuple(dict.fromkeys(args.eos_token_ids + extra)))
        return args


SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe")
SUPPORTED_ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU


def _refuse_uncomputed_fields(cfg: dict[str, Any], model_type: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"hidden_act {act!r} is not supported: hpcrl's MLP computes SwiGLU with SiLU (hidden_act: silu); "
            "this model would be trained and served as a different function"
        )
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias: true is not supported: hpcrl's MLP projections (gate/up/down) have no bias")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise ValueError(
            f"attention_bias: true is not supported for model_type {model_type!r}: transformers then gives its "
            "o_proj a bias, and hpcrl's o_proj has none (only Qwen2's q/k/v biases are computed)"
        )
    if cfg.get("attention_dropout"):
        raise ValueError(
            f"attention_dropout {cfg['attention_dropout']} is not supported: hpcrl trains without dropout; set it to "
            "0.0 in config.json"
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{key} is not supported: hpcrl computes no logit soft-capping")


def _layer_windows(cfg: dict[str, Any], model_type: str) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it: Mistral windows every layer; Qwen2/Qwen3 window the
    layers that `layer_types` marks (by default, with use_sliding_window, those from max_window_layers on)."""
    num_layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None
    if model_type == "llama":
        window = None  # LlamaAttention has no sliding window
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers, but num_hidden_layers is {num_layers}")
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(
                f"layer_types {unknown} are not supported: hpcrl computes full_attention and sliding_attention"
            )
    if window is None:
        if layer_types is not None and "sliding_attention" in layer_types:
            raise ValueError("layer_types names sliding_attention layers but the config sets no sliding_window")
        return ()
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    if layer_types is None:
        first = int(cfg.get("max_window_layers", 0)) if model_type in ("qwen2", "qwen3", "qwen3_moe") else 0
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if "sliding_attention" not in layer_types:
        return ()
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _replace(args: ModelArgs, **kw: Any) -> ModelArgs:
    from dataclasses import replace

    return replace(args, **kw)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers (normalise in fp32, cast back, then scale) so that the two
        # implementations agree to the last bit in fp32.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    freq, attention_factor = inv_freq(head_dim, theta, positions.device, scaling)
    freqs = positions.float()[..., None] * freq
    emb = torch.cat((freqs, freqs), dim=-1)
    if attention_factor == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, H, T, D]; cos/sin [B, T, D]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it; an 8-bit float cache saturates (a plain cast may give NaN past its largest value)."""
    if x.dtype == cache_dtype:
        return x
    if cache_dtype.itemsize == 1 and cache_dtype.is_floating_point:
        top = torch.finfo(cache_dtype).max
        return x.clamp(-top, top).to(cache_dtype)
    return x.to(cache_dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view of t as integers of its width, for copies by index (index_put has no float8 kernels everywhere)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


@dataclass
class KVCache:
    """Static K/V buffers; `k[i]`/`v[i]` are layer i's [slots, kv_heads, max_len, head_dim] views of one
    allocation [layers, 2, slots, ...]; a slot holds one sequence.

    One allocation lets a slot move (when the engine compacts its running sequences) in one copy for
    all layers, and frees in one piece when the engine releases its memory.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    buffer: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls, args: ModelArgs, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        shape = (args.num_layers, 2, num_slots, args.num_kv_heads, max_len, args.head_dim)
        buf = torch.zeros(shape, dtype=dtype, device=device)
        return cls(k=list(buf[:, 0].unbind(0)), v=list(buf[:, 1].unbind(0)), buffer=buf)

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_prefix(self, src: list[int], dst: list[int], length: int) -> None:
        """Slot dst[i] gets the first `length` positions of slot src[i] (samples that share a prompt)."""
        s = torch.tensor(src, device=self.k[0].device)
        d = torch.tensor(dst, device=self.k[0].device)
        if self.buffer is not None:
            buf = _bits(self.buffer)
            buf[:, :, d, :, :length] = buf[:, :, s, :, :length]
            return
        for t in self.k + self.v:
            _bits(t)[d, :, :length] = _bits(t)[s, :, :length]

    def move_slot(self, src: int, dst: int) -> None:
        if self.buffer is not None:
            self.buffer[:, :, dst].copy_(self.buffer[:, :, src])
            return
        for t in self.k + self.v:
            t[dst].copy_(t[src])


def window_band(query_pos: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """Which of the keys at positions 0..length-1 the queries at `query_pos` [..., T] see within a sliding window,
    [..., T, length]: as transformers' sliding-window mask, a query at q sees the keys k with q - window < k <= q."""
    key_pos = torch.arange(length, device=query_pos.device)
    q = query_pos[..., None]
    return (key_pos <= q) & (key_pos > q - window)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.window = window
        h, kv, d = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, h * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(h * d, args.hidden_size, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        a = self.args
        q = self.q_proj(x).view(b, t, a.num_heads, a.head_dim)
        k = self.k_proj(x).view(b, t, a.num_kv_heads, a.head_dim)
        v = self.v_proj(x).view(b, t, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal attention over right-padded sequences (padding never leaks into real tokens), within the
        layer's sliding window if it has one."""
        q, k, v = self._qkv(x, cos, sin)
        out = self._self_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    def _self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a chunk that starts at position 0 to itself, within the layer's window."""
        t = q.shape[2]
        if self.window is not None and t > self.window:
            band = window_band(torch.arange(t, device=q.device), t, self.window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=self._gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self._gqa)

    def forward_cached(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
        start_pos: torch.Tensor,
        attn_len: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention that appends this chunk's K/V to cache rows `k_rows`/`v_rows` [B, kv, L, D] at
        `start_pos` [B]; `mask` [B, 1, T, attn_len] marks which cached positions each new token sees.

        mask None means every row starts at position 0 (a prefill): the chunk is written to the cache
        with a slice and attends causally to itself, which lets SDPA use its flash kernel.
        """
        q, k, v = self._qkv(x, cos, sin)
        b, t = x.shape[0], x.shape[1]
        if mask is None:
            k_rows[:, :, :t] = to_cache_dtype(k, k_rows.dtype)
            v_rows[:, :, :t] = to_cache_dtype(v, v_rows.dtype)
            out = self._self_attention(q, k, v)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        pos = start_pos[:, None] + torch.arange(t, device=x.device)[None, :]  # [B, T]
        if self.window is not None and attn_len > self.window:
            mask = mask & window_band(pos, attn_len, self.window)[:, None]
        rows = torch.arange(b, device=x.device)[:, None].expand(b, t)
        # Advanced indices around a slice put their dims first: the target is [B, T, kv, D]. Through a
        # same-width view: index_put is not implemented for every dtype a cache may have (float8).
        _bits(k_rows)[rows, :, pos] = _bits(to_cache_dtype(k, k_rows.dtype)).transpose(1, 2)
        _bits(v_rows)[rows, :, pos] = _bits(to_cache_dtype(v, v_rows.dtype)).transpose(1, 2)
        keys, values = k_rows[:, :, :attn_len].to(q.dtype), v_rows[:, :, :attn_len].to(q.dtype)
        if q.is_cuda:
            # Every decode step attends to one more cached position, a key shape cuDNN's attention has not seen:
            # it builds a new execution plan each time, 13 ms of host time per layer and step on an H100
            # (benchmarks/moe_h100_2026-12-06.md). Without cuDNN torch runs its math path here (two batched
            # matmuls), which builds nothing.
            with sdpa_kernel(_CACHED_ATTENTION_BACKENDS):
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self._gqa)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self._gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    @property
    def _gqa(self) -> bool:
        return self.args.num_heads != self.args.num_kv_heads


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0, routing: Routing | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(args, window=args.window(layer))
        if args.moe is not None and args.moe.sparse_layers[layer]:
            # Typed as the dense MLP: the paths that read its projections (the engine's fused kernels, the
            # batch-invariant forward) are refused for mixture-of-experts models before they run.
            self.mlp = cast(MLP, SparseMoeBlock(args.hidden_size, args.moe, layer, routing or Routing()))
        else:
            self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Going through the layer's own forward lets FSDP2 (fully_shard per layer) gather its weights.
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs, routing: Routing | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, routing) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers` as what they are: a type checker sees an nn.ModuleList's items as plain Modules."""
        return cast("list[DecoderLayer]", list(self.layers))


def _skip_init(module: nn.Module) -> None:
    """An initialiser that leaves the parameters as allocated (see CausalLM.without_init)."""


class CausalLM(nn.Module):
    """Parameter names match transformers' `*ForCausalLM` (model.layers.N.self_attn.q_proj.weight, ...)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.routing = Routing()
        """What the latest forward routed, and the routes to replay (mixture-of-experts models; see model/moe.py)."""
        self.model = Backbone(args, self.routing)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @classmethod
    def without_init(cls, args: ModelArgs, device: str | torch.device = "meta") -> CausalLM:
        """The model with its parameters allocated on `device` but not initialised, for weights that are copied
        in afterwards (on "meta": the structure and shapes alone).

        Built on the device itself rather than on meta and moved with to_empty, and with the Embedding and
        Linear initialisers skipped: on meta tensors both normal_ and empty_like go through torch._refs, whose
        first calls import torch._dynamo and sympy, seconds of CPU in every process that builds a model (the
        driver's check, each engine, each trainer rank); on a real device the initialisers cost a pass over
        weights that are overwritten anyway."""
        initialisers = nn.Embedding.reset_parameters, nn.Linear.reset_parameters
        nn.Embedding.reset_parameters = _skip_init  # type: ignore[method-assign,assignment]
        nn.Linear.reset_parameters = _skip_init  # type: ignore[method-assign,assignment]
        try:
            with torch.device(device):
                return cls(args)
        finally:
            nn.Embedding.reset_parameters, nn.Linear.reset_parameters = initialisers  # type: ignore[method-assign]

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.output_weight)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states of right-padded sequences [B, T] (positions start at 0 in every row)."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        self.routing.clear()
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, h.dtype, self.args.rope_scaling)
        for layer in self.model.decoder_layers:
            h = layer(h, cos, sin)
        return self.model.norm(h)

    def forward(self, input_ids: torch.Tensor, *, invariant: bool = False, hidden: bool = False) -> torch.Tensor:
        """Logits [B, T, V]; `invariant` runs the batch-invariant forward, `hidden` returns the final hidden
        states [B, T, H] instead of logits (a fused log-prob head follows). Both go through here, so DDP sees them."""
        if hidden:
            return self.hidden_states(input_ids)
        if invariant:
            from hpcrl.model import invariant as inv

            return inv.logits(self, input_ids)
        return self.logits(self.hidden_states(input_ids))

    def forward_cached(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        first_slot: int,
        start_pos: torch.Tensor,
        last_index: torch.Tensor,
        *,
        from_start: bool = False,
    ) -> torch.Tensor:
        """Run new tokens [B, T] of the sequences in cache slots first_slot..first_slot+B-1 and return
        the logits at `last_index` [B] of each row (the position that predicts the next token), [B, V].

        The engine keeps running sequences in contiguous slots so that the cache rows are a view,
        not a gather. Each row's new tokens start at `start_pos[b]`; rows are right-padded to T, and
        padded tokens write cache entries past the row's end that are overwritten before anyone reads them.
        `from_start=True` promises start_pos == 0 for every row (a prefill): no mask, no host sync.
        """
        b, t = input_ids.shape
        device = input_ids.device
        positions = start_pos[:, None] + torch.arange(t, device=device)[None, :]
        if from_start:
            attn_len, mask = t, None
        else:
            attn_len = int((start_pos + t).max().item())
        if not from_start:
            key_pos = torch.arange(attn_len, device=device)
            mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, L]
        self.routing.clear()
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, h.dtype, self.args.rope_scaling)
        rows = slice(first_slot, first_slot + b)
        for i, layer in enumerate(self.model.decoder_layers):
            h = h + layer.self_attn.forward_cached(
                layer.input_layernorm(h), cos, sin, cache.k[i][rows], cache.v[i][rows], start_pos, attn_len, mask
            )
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = h[torch.arange(b, device=device), last_index]
        return self.logits(self.model.norm(last))


def token_logprobs_of_sequence(model: CausalLM, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probs (temperature 1, fp32) of tokens ids[prompt_len:] given everything before them, by the
    standard forward of one unpadded sequence: the engine's `logprobs: recompute` re-score."""
    logits = model(ids[None])[0, prompt_len - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[prompt_len:, None])[:, 0]
