"""Rotary position embeddings: the inverse frequencies of plain RoPE and of the long-context scalings that
Hugging Face configs name in `rope_scaling` / `rope_parameters` (`llama3`: Llama 3.1+; `yarn`: Qwen's long-context
setting), computed as transformers computes them, so that weights trained with a scaling score the same here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
# Keys of a rope_scaling / rope_parameters dict that change no number hpcrl computes.
_BOOKKEEPING_KEYS = {"rope_type", "type", "rope_theta"}
_KEYS_BY_TYPE = {
    "default": set(),
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
        "mscale_all_dim", "truncate",
    },
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """A long-context RoPE scaling: the inverse frequencies are rescaled band by band (`llama3`) or blended
    between interpolation and extrapolation (`yarn`, which also scales cos and sin by `attention_factor`)."""

    rope_type: Literal["llama3", "yarn"]
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


def parse_rope_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    """The scaling a Hugging Face config asks for (None: plain RoPE); a type or a setting hpcrl does not compute is
    refused by name, never ignored."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported: hpcrl computes RoPE as {', '.join(SUPPORTED_ROPE_TYPES)}; "
            "a model trained with another scaling would be scored wrong"
        )
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported: hpcrl rotates every head dimension")
    unknown = set(params) - _BOOKKEEPING_KEYS - _KEYS_BY_TYPE[rope_type] - {"partial_rotary_factor"}
    if unknown:
        raise ValueError(
            f"rope settings {sorted(unknown)} are not computed by hpcrl for rope_type {rope_type!r} "
            f"(it reads {sorted(_KEYS_BY_TYPE[rope_type]) or 'none'})"
        )
    if rope_type == "default":
        return None
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    original = int(cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or max_pos)  # fmt: skip
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3", factor=float(params["factor"]), original_max_position_embeddings=original,
            low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]),
        )  # fmt: skip
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_pos / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    return RopeScaling(
        rope_type="yarn", factor=factor, original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=float(attention), truncate=bool(params.get("truncate", True)),
    )  # fmt: skip


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(
    head_dim: int, theta: float, device: torch.device | str, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, float]:
    """fp32 inverse frequencies [head_dim / 2] and the factor that scales cos and sin."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    base = 1.0 / (theta**exponents)
    if scaling is None:
        return base, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(base, scaling), 1.0
    return _yarn(theta**exponents, head_dim, theta, scaling), scaling.attention_factor


def _llama3(freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Wavelengths shorter than the original context / high_freq_factor keep their frequency, longer than
    # context / low_freq_factor are divided by the factor, and the band between blends the two.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / s.factor, freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(pos_freqs: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).to(pos_freqs.device)
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
