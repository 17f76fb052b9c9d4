"""The decode step's GEMMs at batch 256: cuBLAS against the engine's Triton `kernels.linear` over launch configs.

    PYTHONPATH=.:tools/gpu python3 tools/gpu/decode_gemm_sweep.py [--rows 256] [--env-out best_gemm_env.txt]

At M = 256 the four GEMMs of a Qwen3-0.6B layer take 6.5-7.8 us each in cuBLAS, 28.8 us together
against 10.2 us for their FLOPs at 790 TFLOP/s (measured on an H200). Each stage is timed as the engine runs it with
engine.kernels.gemm cublas (the default) and triton, the op after the GEMM included where the Triton path fuses into
it:

    qkv        F.linear                       | linear
    o          F.linear + add_rmsnorm         | linear, SPLIT_K fp32 partials + add_rmsnorm summing them
    gate_up    F.linear + silu_mul            | linear(gated): the SwiGLU product in the GEMM's epilogue
    down       F.linear + add_rmsnorm         | as o

Device time per launch from CUDA-graph replays (`decode_microbench.graph_ms`), rotating through weight copies of
100 MB together so that L2 does not hold them (a decode step's 28 layers do not fit it either); the floor is the max
of the weight bytes at 4.3 TB/s and the FLOPs at 790 TFLOP/s; the error is against the cuBLAS stage's output. A
config is BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages. The best config of each stage (among those within
MAX_REL_ERR) goes to --env-out as HPCRL_ENGINE_GEMM_CONFIG_<STAGE>=... lines for the engine (run_decode_gpu.sh passes
them to its triton-GEMM bench).
Without a GPU, `TRITON_INTERPRET=1 ... --check-only` runs every stage's Triton side against its cuBLAS side on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hpcrl.engine.embedded.kernels import gemm, norms  # noqa: E402

HIDDEN, Q_OUT, QKV_OUT, INTER = 1024, 2048, 4096, 3072  # Qwen3-0.6B: 16 + 2 x 8 heads of 128, intermediate 3072
# (stage, N rows of its weight, K); gate_up's weight is [gate; up], 2 x INTER rows.
STAGES = [("qkv", QKV_OUT, HIDDEN), ("o", HIDDEN, Q_OUT), ("gate_up", 2 * INTER, HIDDEN), ("down", HIDDEN, INTER)]
WHOLE = [
    f"{bm},{bn},{bk},1,4,{st}"
    for bm, bn, bk, st in itertools.product((64, 128), (32, 64, 128), (64, 128), (3, 4))
    if bm * bn <= 8192
]
SPLIT = [
    f"{bm},{bn},{bk},{sk},4,3" for bm, bn, bk, sk in itertools.product((64, 128), (32, 64), (64, 128), (1, 2, 4, 8))
]


MAX_REL_ERR = 1e-2
"""A config whose output is further than this from the cuBLAS path's (bf16 rounding is ~4e-3) is never picked."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


class Stage:
    """One stage's inputs and its two implementations, cuBLAS (as the engine's default path) and Triton (config)."""

    def __init__(self, name: str, n: int, k: int, m: int, device: torch.device, dtype: torch.dtype) -> None:
        self.name, self.n, self.k, self.m = name, n, k, m
        gen = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
        # Enough weight copies to overflow the H200's ~50 MB L2 twice over: a decode step's 28 layers do not fit it.
        copies = max(4, -(-100_000_000 // (n * k * torch.finfo(dtype).bits // 8)))
        self.ws = [torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k**0.5 for _ in range(copies)]
        # o and down write the residual stream (n wide); gate_up's SwiGLU product is n / 2 wide.
        self.resid0 = torch.randn(m, n, device=device, dtype=dtype, generator=gen)
        self.resid = self.resid0.clone()
        self.norm_w = torch.ones(n, device=device, dtype=dtype)
        self.h = torch.empty(m, n, device=device, dtype=dtype)
        self.act = torch.empty(m, n // 2, device=device, dtype=dtype)
        self._turn = itertools.count()

    def _w(self, rotate: bool) -> torch.Tensor:
        return self.ws[next(self._turn) % len(self.ws)] if rotate else self.ws[0]

    def cublas(self, rotate: bool = True) -> torch.Tensor:
        y = F.linear(self.x, self._w(rotate))
        if self.name == "gate_up":
            gemm.silu_mul(y, self.act)
            return self.act
        if self.name in ("o", "down"):
            norms.add_rmsnorm(y, self.resid, self.norm_w, 1e-6, self.h)
            return self.h
        return y

    def cublas_split(self, parts: int, rotate: bool = True) -> torch.Tensor:
        """o or down as the engine's cuBLAS path runs it with engine.kernels.cublas_split_k: `kernels.split_k_linear`
        (one strided-batch GEMM of fp32 partials), then add_rmsnorm summing them."""
        norms.add_rmsnorm(gemm.split_k_linear(self.x, self._w(rotate), parts), self.resid, self.norm_w, 1e-6, self.h)
        return self.h

    def triton(self, config: tuple[int, ...], rotate: bool = True) -> torch.Tensor:
        y = gemm.linear(self.x, self._w(rotate), config=config, gated=self.name == "gate_up")
        if self.name in ("o", "down"):
            norms.add_rmsnorm(y, self.resid, self.norm_w, 1e-6, self.h)
            return self.h
        return y

    def error(self, config: tuple[int, ...]) -> float:
        return self._error_of(functools.partial(self.triton, config, rotate=False))

    def split_error(self, parts: int) -> float:
        return self._error_of(functools.partial(self.cublas_split, parts, rotate=False))

    def _error_of(self, variant: Callable[[], torch.Tensor]) -> float:
        """The variant's output against the cuBLAS path's, each from the same starting residual."""
        self.resid.copy_(self.resid0)
        ref = self.cublas(rotate=False).clone()
        self.resid.copy_(self.resid0)
        return _rel(variant(), ref)

    def floor_us(self) -> float:
        bytes_moved = 2 * (self.n * self.k + self.m * self.k + self.m * self.n)
        return max(bytes_moved / 4.3e12, 2 * self.m * self.n * self.k / 790e12) * 1e6


def configs_for(stage: str, given: str | None) -> list[tuple[int, ...]]:
    text = given if given else ";".join(SPLIT if stage in ("o", "down") else WHOLE)
    return [tuple(int(v) for v in c.split(",")) for c in text.split(";") if c]


def check_only() -> int:
    """Every stage on tiny shapes in float32 (the interpreter's dots), small tiles, against its cuBLAS side."""
    worst = 0.0
    for name, n, k in STAGES:
        stage = Stage(name, n // 16, k // 16, 5, torch.device("cpu"), torch.float32)
        for split in (1, 3) if name in ("o", "down") else (1,):
            worst = max(worst, stage.error((16, 16, 32, split, 4, 2)))
    print(f"check-only: worst ||triton - cublas|| / ||cublas|| {worst:.2e} over the 4 stages")
    return 0 if worst < 1e-5 else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256, help="M: the decode batch")
    p.add_argument("--configs", default=None, help="BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,warps,stages;... for every stage")
    p.add_argument("--env-out", default=None, help="write the best config of each stage as HPCRL_ENGINE_GEMM_CONFIG_*")
    p.add_argument("--check-only", action="store_true", help="tiny shapes against cuBLAS's side (TRITON_INTERPRET=1)")
    p.add_argument(
        "--cublas-splits",
        default="",
        help="o and down only: cuBLAS split over K into these part counts (comma-separated), fp32 partials that "
        "add_rmsnorm sums, against the cuBLAS path",
    )
    ns = p.parse_args()
    if ns.check_only:
        return check_only()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (or --check-only under TRITON_INTERPRET=1)")
    from decode_microbench import graph_ms  # a sibling script: this folder is on sys.path when run

    dev, m = torch.device("cuda"), ns.rows
    print(f"M = {m}, bf16; us per launch from graph replays; floor = max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s)")
    print("| stage | N x K | floor us | cuBLAS path us | Triton path us (config) | rel err vs cuBLAS path |")
    print("|---|---|---:|---:|---:|---:|")
    env: list[str] = []
    total_cublas = total_best = 0.0
    for name, n, k in STAGES:
        stage = Stage(name, n, k, m, dev, torch.bfloat16)
        cublas_us = graph_ms(stage.cublas, launches=16) * 1e3
        if ns.cublas_splits:
            if name in ("o", "down"):
                for parts in (int(v) for v in ns.cublas_splits.split(",")):
                    if k % parts:
                        continue
                    us = graph_ms(functools.partial(stage.cublas_split, parts), launches=16) * 1e3
                    again = graph_ms(stage.cublas, launches=16) * 1e3
                    print(f"| {name} | {n} x {k} | cuBLAS path {cublas_us:.2f} / {again:.2f} us | split {parts}: "
                          f"{us:.2f} us | rel err {stage.split_error(parts):.1e} |", flush=True)  # fmt: skip
            continue
        best: tuple[float, tuple[int, ...]] | None = None
        for cfg in configs_for(name, ns.configs):
            if name not in ("o", "down") and cfg[3] != 1:
                continue  # qkv's output goes to the QK-norm kernel and gate/up's epilogue needs whole sums
            try:
                err = stage.error(cfg)
                us = graph_ms(functools.partial(stage.triton, cfg), launches=16) * 1e3
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is reported, not fatal
                print(f"| {name} | config {cfg} failed: {type(exc).__name__} | | | | |")
                continue
            print(f"| {name} | {n} x {k} | {stage.floor_us():.1f} | {cublas_us:.1f} | {us:.1f} "
                  f"({','.join(map(str, cfg))}) | {err:.1e} |", flush=True)  # fmt: skip
            if err < MAX_REL_ERR and (best is None or us < best[0]):
                best = (us, cfg)
        total_cublas += cublas_us
        if best is not None:
            total_best += best[0]
            print(f"best {name}: cuBLAS path {cublas_us:.1f} us, Triton path {best[0]:.1f} us "
                  f"({','.join(map(str, best[1]))})", flush=True)  # fmt: skip
            env.append(f"HPCRL_ENGINE_GEMM_CONFIG_{name.upper()}={','.join(map(str, best[1]))}")
            if ns.env_out:  # after each stage: a sweep cut short still configures the stages it finished
                Path(ns.env_out).write_text("\n".join(env) + "\n")
    print(f"a layer's four stages: cuBLAS path {total_cublas:.1f} us, best Triton configs {total_best:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
