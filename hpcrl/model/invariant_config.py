"""The launch tiles of the batch-invariant Triton kernels (`invariant_kernels`), typed, with their checks.

The engine's batch-invariant decode (engine.batch_invariant) and the trainer's invariant log-probs (train.logprobs:
invariant) run these kernels in two processes, and a token's log-prob is the same bits on both sides only when both
launch the same tiles. So both read one dataclass: the engine from `engine.kernels.invariant_matmul` /
`invariant_attention`, the trainer from `train.invariant_kernels`, and a run config whose two differ is refused.
An environment variable (HPCRL_INVARIANT_MATMUL, HPCRL_INVARIANT_ATTENTION) may override a tile for a benchmark
sweep: it is checked with the same rules, both processes of a run inherit it, and the engine names it in its
start-up line. The kernels read the resolved config (`invariant_kernels.configure`), never the environment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MATMUL_DEFAULT = (32, 16, 128, 2, 3)
ATTENTION_DEFAULT = (32, 4, 2)

ENV_VARS = {"HPCRL_INVARIANT_MATMUL": "matmul", "HPCRL_INVARIANT_ATTENTION": "attention"}
"""The override variables, to the field each sets."""


def is_pow2(v: int) -> bool:
    """Whether `v` is a power of two (Triton block sizes must be)."""
    return v >= 1 and v & (v - 1) == 0


def tiles_text(values: tuple[int, ...]) -> str:
    """Tiles as their environment variables write them: "32,16,128"."""
    return ",".join(map(str, values))


@dataclass(frozen=True, kw_only=True)
class InvariantKernelsConfig:
    """Launch tiles of the batch-invariant Triton kernels (CUDA only; the CPU forward runs plain torch). The engine
    and the trainer must launch the same tiles: a tile changes the order of a GEMM's or an attention's sums."""

    matmul: tuple[int, int, int, int, int] = MATMUL_DEFAULT
    """The GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): one program computes one output tile, K walked
    from 0 without split-K, and the tile never depends on the batch, so a row's products are the same instructions
    at any batch size. The blocks are powers of two >= 16, num_warps a power of two <= 32, num_stages >= 1. CUDA
    only."""
    attention: tuple[int, int, int] = ATTENTION_DEFAULT
    """The attention kernel's (keys per tile, num_warps, num_stages): keys walked from key 0 a tile at a time. The
    tile is a power of two >= 16, num_warps a power of two <= 32, num_stages >= 1. CUDA only."""

    def __post_init__(self) -> None:
        for problem in tile_problems(self.matmul, self.attention):
            raise ValueError(problem)


def tile_problems(matmul: tuple[int, ...], attention: tuple[int, ...], prefix: str = "") -> list[str]:
    """What is wrong with these tiles, one sentence a field named `prefix` + its name (empty: nothing)."""
    out: list[str] = []
    checks = (
        ("matmul", matmul, 5, 3, "BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages", MATMUL_DEFAULT),
        ("attention", attention, 3, 1, "keys per tile,num_warps,num_stages", ATTENTION_DEFAULT),
    )
    for name, tiles, size, blocks, form, default in checks:
        ok = (
            isinstance(tiles, tuple)
            and len(tiles) == size
            and all(isinstance(v, int) and not isinstance(v, bool) for v in tiles)
            and all(b >= 16 and is_pow2(b) for b in tiles[:blocks])
            and is_pow2(tiles[blocks])
            and tiles[blocks] <= 32
            and tiles[blocks + 1] >= 1
        )
        if not ok:
            shown = tiles_text(tiles) if isinstance(tiles, tuple) else repr(tiles)
            out.append(
                f"{prefix}{name} {shown}: expected {size} integers {form}, the "
                f"{'blocks powers' if blocks > 1 else 'tile a power'} of two >= 16, num_warps a power of two <= 32 "
                f"and num_stages >= 1, like {tiles_text(default)} (the default)"
            )
    return out


def parse_tiles(name: str, raw: str) -> Any:
    """Field `name`'s tiles from their text (`a,b,c`); a ValueError says what the field takes."""
    default = MATMUL_DEFAULT if name == "matmul" else ATTENTION_DEFAULT
    parts = raw.strip().split(",")
    if len(parts) != len(default) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"expected exactly {len(default)} comma-separated non-negative integers, like {tiles_text(default)} (the "
            "default)"
        )
    return tuple(int(p) for p in parts)


def with_env_overrides(
    cfg: InvariantKernelsConfig, environ: Mapping[str, str]
) -> tuple[InvariantKernelsConfig, list[tuple[str, str, str]]]:
    """`cfg` with HPCRL_INVARIANT_MATMUL / HPCRL_INVARIANT_ATTENTION of `environ` applied (blank ones count as
    unset), and the overrides applied as (variable, value, field). Another HPCRL_INVARIANT_* variable, or a bad
    value, is a ValueError naming the variable and what it takes."""
    resolved = cfg
    applied: list[tuple[str, str, str]] = []
    for var, raw in sorted(environ.items()):
        if not var.startswith("HPCRL_INVARIANT_") or not raw.strip():
            continue
        name = ENV_VARS.get(var)
        if name is None:
            raise ValueError(f"{var}: no batch-invariant kernel tile is called so; the variables are "
                             f"{', '.join(ENV_VARS)}; unset it")  # fmt: skip
        try:
            resolved = dataclasses.replace(resolved, **{name: parse_tiles(name, raw)})
        except ValueError as exc:
            raise ValueError(f"{var}={raw.strip()!r}: {exc}; unset it to use the configured tiles") from None
        applied.append((var, raw.strip(), name))
    return resolved, applied
