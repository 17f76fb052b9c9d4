"""`engine.kernels`: the launch parameters of the embedded engine's CUDA kernels, typed, with their checks.

Every knob is declared here once. A run config sets them under `engine.kernels`, `hpcrl engine serve` takes them
from `--config FILE` or `--kernels-<name>` flags, and an environment variable may override one for a sweep
(`HPCRL_ENGINE_<NAME>`): `with_env_overrides` checks each with the same rules, and the engine names every override
in its start-up line. The kernels read the resolved config (`kernels.configure`), never the environment. Every knob
is CUDA-only: the CPU engine runs no Triton kernel.

The batch-invariant kernels' tiles (`invariant_matmul`, `invariant_attention`) are knobs here too, checked by
`hpcrl.model.invariant_config`: the trainer's `train.logprobs: invariant` forward must launch the same tiles, so it
reads them from `train.invariant_kernels`, and a run config whose two differ is refused. Their override variables
are HPCRL_INVARIANT_MATMUL and HPCRL_INVARIANT_ATTENTION, which the trainer applies too.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hpcrl.model.invariant_config import (
    ATTENTION_DEFAULT,
    MATMUL_DEFAULT,
    InvariantKernelsConfig,
    is_pow2,
    tile_problems,
    tiles_text,
)

REMOVED_ENV = {
    "HPCRL_ENGINE_DECODE": "engine.decode_mode (hpcrl engine serve --decode-mode)",
    "HPCRL_ENGINE_OVERLAP": "engine.decode_overlap (hpcrl engine serve --decode-overlap)",
    "HPCRL_ENGINE_PROFILE": "engine.decode_profile (hpcrl engine serve --decode-profile)",
}
"""Switches of settings that have a typed key: set that key instead (the variable would be a second way in)."""


@dataclass(frozen=True, kw_only=True)
class KernelsConfig:
    """Launch parameters of the embedded engine's Triton kernels (CUDA only; the CPU engine ignores them). The
    defaults are what the H200 sweeps of tools/gpu picked (benchmarks/decode_h200_2026-12.md)."""

    attn_config: tuple[int, int, int, int] = (64, 8, 3, 1)
    """decode_attention's (BLOCK_N, num_warps, num_stages, use_dot) with a K/V cache in the model's dtype; use_dot 0:
    CUDA-core dots, 1: q the first tensor-core dot operand, 2: K first. CUDA only."""
    attn_config_kv8: tuple[int, int, int, int] = (32, 1, 3, 2)
    """decode_attention's launch with an 8-bit K/V cache: small tiles, one warp, three stages, K first took 0.059 ms
    a layer on an H200 (batch 256, length 384) against 0.0625 with two warps. CUDA only."""
    sample_config: tuple[int, int, int, int] = (512, 2, 1024, 4)
    """sample_rows' (BLOCK, num_warps) of the pass over the logits, then of the draw; each a power of two, warps at
    most 32. H200, 256 x 151,936 bf16 logits: the pass 30.0 us at 512,2 against 32-48 at the others tried. CUDA
    only."""
    gemm: Literal["cublas", "triton"] = "cublas"
    """The decode step's GEMMs: `cublas` (torch's) or `triton` (the engine's own kernels, with the gemm_config_*
    tiles; in the triton and graph decode modes). CUDA only."""
    gemm_config_qkv: tuple[int, int, int, int, int, int] = (64, 64, 128, 1, 4, 3)
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) of the fused QKV GEMM with gemm: triton; SPLIT_K
    must be 1 (its output feeds a kernel that needs whole sums). Starting points for tools/gpu/decode_gemm_sweep.py.
    CUDA only."""
    gemm_config_o: tuple[int, int, int, int, int, int] = (64, 64, 128, 4, 4, 3)
    """The o projection's tiles with gemm: triton (as gemm_config_qkv; split-K partials that add_rmsnorm sums).
    CUDA only."""
    gemm_config_gate_up: tuple[int, int, int, int, int, int] = (64, 64, 64, 1, 4, 4)
    """The fused gate/up GEMM's tiles with gemm: triton (as gemm_config_qkv; SPLIT_K 1). CUDA only."""
    gemm_config_down: tuple[int, int, int, int, int, int] = (64, 64, 128, 4, 4, 3)
    """The down projection's tiles with gemm: triton (as gemm_config_o). CUDA only."""
    cublas_split_k: tuple[int, int] | None = None
    """gemm: cublas splits the o and down GEMMs over K into (o, down) parts, fp32 partials that add_rmsnorm sums, in
    steps of up to 384 rows (H200: the decode step 2.93 -> 2.87 ms). null: 2,2 where the parts divide the model's
    K, else whole; a value given must divide it (1 = whole). CUDA only."""
    pdl: bool = True
    """Programmatic dependent launch: each decode kernel starts while the one before drains and waits on the device
    for its writes (H200: 3.11 -> 3.04 ms a step, the same bits). CUDA with compute capability 9 or newer only."""
    prefill: Literal["auto", "fused", "model"] = "auto"
    """How prompts are prefilled in the triton and graph decode modes: `fused` with the decode step's kernels
    (H200: a 256 x 128-token prefill 0.174 -> 0.064 s), `model` with the model's own forward, `auto` fused where
    the decode mode has the kernels (`fused` in another mode is warned about). CUDA only."""
    invariant_matmul: tuple[int, int, int, int, int] = MATMUL_DEFAULT
    """The batch-invariant GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) with engine.batch_invariant: the
    blocks powers of two >= 16, num_warps a power of two <= 32, num_stages >= 1. With train.logprobs: invariant it
    must equal train.invariant_kernels.matmul (the same tiles give the same bits). CUDA only."""
    invariant_attention: tuple[int, int, int] = ATTENTION_DEFAULT
    """The batch-invariant attention's (keys per tile, num_warps, num_stages) with engine.batch_invariant: the tile a
    power of two >= 16, num_warps a power of two <= 32, num_stages >= 1. With train.logprobs: invariant it must
    equal train.invariant_kernels.attention. CUDA only."""

    def __post_init__(self) -> None:
        for problem in self.problems():
            raise ValueError(problem)

    def problems(self) -> list[str]:
        """What is wrong with these settings, one sentence a knob (empty: nothing)."""
        out: list[str] = []
        for name in ("attn_config", "attn_config_kv8"):
            block, warps, stages, use_dot = getattr(self, name)
            if not (is_pow2(block) and is_pow2(warps) and stages >= 1) or use_dot not in (0, 1, 2):
                out.append(
                    f"{name} {tiles_text(getattr(self, name))}: BLOCK_N and num_warps must be powers of two, "
                    "num_stages at least 1, and the 4th value, use_dot, must be 0 (CUDA-core dots), 1 (q the first dot "
                    f"operand) or 2 (K first), like {tiles_text(_default(name))} (the default)"
                )
        sample = self.sample_config
        if not all(is_pow2(v) for v in sample) or max(sample[1], sample[3]) > 32:
            out.append(
                f"sample_config {tiles_text(sample)}: expected BLOCK,num_warps of the pass over the logits, then "
                "BLOCK,num_warps of the draw, each a power of two, warps at most 32 (a BLOCK past the sampler's chunk "
                f"of 4096 ids scans the chunk), like {tiles_text(_default('sample_config'))} (the default)"
            )
        for part in ("qkv", "o", "gate_up", "down"):
            name = f"gemm_config_{part}"
            tiles = getattr(self, name)
            whole = part in ("qkv", "gate_up")
            if (
                not all(b >= 16 and is_pow2(b) for b in tiles[:3])
                or tiles[3] < 1
                or (whole and tiles[3] != 1)
                or (tiles[4] < 1 or tiles[5] < 1)
            ):
                out.append(
                    f"{name} {tiles_text(tiles)}: the blocks must be powers of two >= 16, SPLIT_K, the warps and the "
                    "stages >= 1 (SPLIT_K 1 for qkv and gate_up, whose outputs must be whole sums), like "
                    f"{tiles_text(_default(name))} (the default)"
                )
        if self.cublas_split_k is not None and min(self.cublas_split_k) < 1:
            out.append(
                f"cublas_split_k {tiles_text(self.cublas_split_k)}: the parts of the o and the down GEMM must be >= 1, "
                "like 2,2 (1 = no split), or null for the default"
            )
        out += tile_problems(self.invariant_matmul, self.invariant_attention, prefix="invariant_")
        return out

    def invariant(self) -> InvariantKernelsConfig:
        """The batch-invariant kernels' tiles, as the trainer's train.invariant_kernels holds them."""
        return InvariantKernelsConfig(matmul=self.invariant_matmul, attention=self.invariant_attention)

    def gemm_configs(self) -> dict[str, tuple[int, int, int, int, int, int]]:
        """The Triton GEMM tiles by stage, as the decode step names them."""
        return {
            "qkv": self.gemm_config_qkv,
            "o": self.gemm_config_o,
            "gate_up": self.gemm_config_gate_up,
            "down": self.gemm_config_down,
        }


def _default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(KernelsConfig) if f.name == name)


def env_var(name: str) -> str:
    """The environment variable that overrides knob `name` (HPCRL_INVARIANT_* for the batch-invariant tiles, the
    variables the trainer reads too)."""
    return f"HPCRL_{name.upper()}" if name.startswith("invariant_") else f"HPCRL_ENGINE_{name.upper()}"


ENV_VARS = {env_var(f.name): f.name for f in dataclasses.fields(KernelsConfig)}
"""Every override variable, to its knob."""


def parse_value(name: str, raw: str) -> Any:
    """The typed value of knob `name` from its text (`a,b,c` for a tuple, 0/1 for a bool, a choice's name); a
    ValueError says what the knob takes."""
    tp = typing.get_type_hints(KernelsConfig)[name]
    text = raw.strip()
    if tp is bool:
        if text not in ("0", "1"):
            raise ValueError("expected 1 (on) or 0 (off)")
        return text == "1"
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text
    optional = type(None) in typing.get_args(tp)
    if optional and text.lower() in ("", "null", "none"):
        return None
    tuple_tp = next(a for a in typing.get_args(tp) if a is not type(None)) if optional else tp
    size = len(typing.get_args(tuple_tp))
    parts = text.split(",")
    if name == "sample_config" and len(parts) == 2:
        parts += [str(v) for v in _default(name)[2:]]  # the pass only: the default draw
    if len(parts) != size or not all(p.strip().isdigit() for p in parts):
        example = tiles_text(_default(name)) if _default(name) is not None else ",".join(["2"] * size)
        raise ValueError(f"expected exactly {size} comma-separated non-negative integers, like {example}")
    return tuple(int(p) for p in parts)


@dataclass(frozen=True)
class Override:
    """One knob set by an environment variable."""

    var: str
    raw: str
    name: str

    def __str__(self) -> str:
        return f"{self.name}={self.raw} (from {self.var})"


def with_env_overrides(cfg: KernelsConfig, environ: Mapping[str, str]) -> tuple[KernelsConfig, list[Override]]:
    """`cfg` with every HPCRL_ENGINE_* and HPCRL_INVARIANT_* knob of `environ` applied (blank ones count as unset),
    and the overrides applied. A bad value or an unknown variable is a ValueError naming the variable and what it
    takes."""
    for var, key in REMOVED_ENV.items():
        if environ.get(var, "").strip():
            raise ValueError(f"{var} is no longer read: set {key}, then unset {var}")
    overrides: list[Override] = []
    resolved = cfg
    for var, raw in sorted(environ.items()):
        ours = var.startswith(("HPCRL_ENGINE_", "HPCRL_INVARIANT_"))
        if not raw.strip() or not ours or var == "HPCRL_ENGINE_API_KEY":
            continue
        name = ENV_VARS.get(var)
        if name is None:
            raise ValueError(
                f"{var}: no kernel knob is called so; the variables are {', '.join(ENV_VARS)} (the engine.kernels "
                "keys in upper case); unset it"
            )
        try:
            # One knob at a time: each rule is about one knob, so a failure is this variable's.
            resolved = dataclasses.replace(resolved, **{name: parse_value(name, raw)})
        except ValueError as exc:
            raise ValueError(f"{var}={raw.strip()!r}: {exc}; unset it to use engine.kernels.{name}") from None
        overrides.append(Override(var, raw.strip(), name))
    return resolved, overrides


def describe(cfg: KernelsConfig, overrides: list[Override]) -> str:
    """The start-up line's account of the kernel settings: every knob off its default, and where it came from."""
    by_env = {o.name: o for o in overrides}
    changed = [
        str(by_env[f.name]) if f.name in by_env else f"{f.name}={_show(getattr(cfg, f.name))} (engine.kernels)"
        for f in dataclasses.fields(cfg)
        if getattr(cfg, f.name) != f.default or f.name in by_env
    ]
    return ", ".join(changed) if changed else "defaults"


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return tiles_text(value)
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
