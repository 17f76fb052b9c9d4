"""The decode step's GEMMs at batch 256: cuBLAS (torch.mm) against a Triton matmul over launch configs, split-K too.

    PYTHONPATH=.:tools/gpu python3 tools/gpu/decode_gemm_sweep.py [--rows 256] [--configs "64,64,128,1,4,3;..."]

Issue #21, item 2: at M = 256 the four GEMMs of a Qwen3-0.6B layer take 6.5-7.8 us each in cuBLAS, 28.8 us together
against 10.2 us for their FLOPs at 790 TFLOP/s (docs/benchmarks.md). This script asks whether another kernel gets
closer: for each shape (x [M, K] @ W[N, K]^T, bf16 in, fp32 accumulate, bf16 out, as `nn.Linear`), device time per
launch from CUDA-graph replays (`decode_microbench.graph_ms`, rotating through 4 weight copies so that L2 does not
hold them), the floor (max of bytes at 4.3 TB/s and FLOPs at 790 TFLOP/s), and ||out - ref|| / ||ref|| against
torch.mm. A Triton config is BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages; SPLIT_K > 1 adds partial
products in fp32 with atomics into a zeroed buffer and casts it (both launches are in the time).
Without a GPU, `TRITON_INTERPRET=1 ... --check-only` runs the Triton kernel on tiny shapes on the CPU against torch.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Qwen3-0.6B: (name, N, K) of each decode GEMM; hidden 1024, 16 + 2 x 8 heads of 128, intermediate 3072, vocab 151936.
SHAPES = [
    ("qkv", 4096, 1024),
    ("o", 1024, 2048),
    ("gate_up", 6144, 1024),
    ("down", 1024, 3072),
    ("lm_head", 151936, 1024),
]
CONFIGS = (
    "64,64,128,1,4,3;64,128,64,1,4,4;128,64,64,1,4,4;64,64,128,2,4,3;64,64,128,4,4,3;64,32,128,4,4,4;32,64,128,4,4,4;"
    "128,128,64,1,8,3;64,128,128,1,4,3;128,64,128,2,4,3;64,64,64,4,4,4;128,32,128,1,4,4;32,128,128,2,4,3;"
    "256,32,64,1,8,3;128,64,64,1,4,5;64,32,256,2,4,3"
)


@triton.jit
def _matmul_kernel(X, W, Out, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    # Out[M, N] (+)= X[M, K] @ W[N, K]^T over this program's share of K (pid 2 of SPLIT_K).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(pid_k * k_per, tl.minimum(K, (pid_k + 1) * k_per), BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=(offs_m[:, None] < M) & (ks[None, :] < K),
                    other=0.0)  # fmt: skip
        w = tl.load(W + offs_n[:, None] * stride_wn + ks[None, :], mask=(offs_n[:, None] < N) & (ks[None, :] < K),
                    other=0.0)  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = Out + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(Out.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask)


def triton_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: tuple[int, ...],
                  partial: torch.Tensor | None = None) -> None:  # fmt: skip
    """out = x @ w.T with config (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages); SPLIT_K > 1 needs `partial`,
    an fp32 buffer of out's shape."""
    bm, bn, bk, split, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    target = out
    if split > 1:
        assert partial is not None
        partial.zero_()
        target = partial
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _matmul_kernel[grid](x, w, target, m, n, k, x.stride(0), w.stride(0), target.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                         BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)  # fmt: skip
    if split > 1:
        out.copy_(partial)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_only(configs: list[tuple[int, ...]]) -> int:
    """Tiny shapes in float32 (the interpreter's dots): every config against torch."""
    torch.manual_seed(0)
    worst = 0.0
    for m, n, k in ((5, 40, 70), (33, 17, 130)):
        x, w = torch.randn(m, k), torch.randn(n, k)
        ref = x @ w.T
        for cfg in configs:
            small = (16, 16, 32, *cfg[3:])
            out = torch.full((m, n), float("nan"))
            triton_linear(x, w, out, small, torch.empty(m, n))
            worst = max(worst, _rel(out, ref))
    print(f"check-only: worst ||out - ref|| / ||ref|| {worst:.2e} over {len(configs)} split/warp configs, 2 shapes")
    return 0 if worst < 1e-5 else 1


def sweep_shape(name: str, xk: torch.Tensor, n: int, configs: list[tuple[int, ...]],
                graph_ms: Callable[..., float]) -> None:  # fmt: skip
    m, k = xk.shape
    ws = [torch.randn(n, k, device=xk.device, dtype=torch.bfloat16) / k**0.5 for _ in range(4)]
    out = torch.empty(m, n, device=xk.device, dtype=torch.bfloat16)
    partial = torch.empty(m, n, device=xk.device, dtype=torch.float32)
    ref = xk @ ws[0].T
    floor_us = max(2 * (n * k + m * k + m * n) / 4.3e12, 2 * m * n * k / 790e12) * 1e6
    turn = itertools.count()

    def cublas() -> None:
        torch.mm(xk, ws[next(turn) % 4].T, out=out)

    cublas_us = graph_ms(cublas, launches=16) * 1e3
    best: tuple[float, tuple[int, ...]] | None = None
    for cfg in configs:

        def run(cfg: tuple[int, ...] = cfg) -> None:
            triton_linear(xk, ws[next(turn) % 4], out, cfg, partial)

        try:
            triton_linear(xk, ws[0], out, cfg, partial)
            torch.cuda.synchronize()
            err = _rel(out, ref)
            us = graph_ms(run, launches=16) * 1e3
        except Exception as exc:  # noqa: BLE001 - a config that does not fit is reported, not fatal
            print(f"| {name} | config {cfg} failed: {type(exc).__name__} | | | | |")
            continue
        print(f"| {name} | {n} x {k} | {floor_us:.1f} | {cublas_us:.1f} | {us:.1f} ({','.join(map(str, cfg))}) | "
              f"{err:.1e} |", flush=True)  # fmt: skip
        if best is None or us < best[0]:
            best = (us, cfg)
    if best:
        print(f"best {name}: cuBLAS {cublas_us:.1f} us, Triton {best[0]:.1f} us ({','.join(map(str, best[1]))})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256, help="M: the decode batch")
    p.add_argument("--configs", default=CONFIGS, help="BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,warps,stages;...")
    p.add_argument("--check-only", action="store_true", help="tiny shapes against torch (CPU: TRITON_INTERPRET=1)")
    ns = p.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in ns.configs.split(";") if c]
    if any(len(c) != 6 for c in configs):
        p.error("--configs: each config is 6 integers, BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,warps,stages")
    if ns.check_only:
        return check_only(configs)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (or --check-only under TRITON_INTERPRET=1)")
    from decode_microbench import graph_ms  # a sibling script: this folder is on sys.path when run

    dev, m = torch.device("cuda"), ns.rows
    torch.manual_seed(0)
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    print(f"M = {m}, bf16; device time per launch from graph replays; floor = max(bytes / 4.3 TB/s, FLOPs / 790 T)")
    print("| GEMM | N x K | floor us | cuBLAS us | Triton us (config) | rel err vs torch.mm |")
    print("|---|---|---:|---:|---:|---:|")
    for name, n, k in SHAPES:
        sweep_shape(name, x[:, :k].contiguous(), n, configs, graph_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
