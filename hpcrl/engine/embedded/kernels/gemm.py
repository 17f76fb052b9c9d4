"""The decode step's GEMMs: the Triton GEMM (engine.kernels.gemm triton, optionally with the SwiGLU product
built in), the cuBLAS path's split-K GEMM, and the SwiGLU product of one fused gate/up projection."""

from __future__ import annotations

import torch

from hpcrl.engine.embedded.kernels.launch import AVAILABLE, pdl_args, pdl_enter, tl, triton

# The decode step's o and down GEMMs on the cuBLAS path (KernelsConfig.cublas_split_k), split over K: one
# strided-batch cuBLAS call of fp32 partials that add_rmsnorm sums, as the Triton path's split-K. At batch 256
# their [256, 1024] outputs are too few tiles to fill an H200's 132 multiprocessors. H200, Qwen3-0.6B shape, each
# GEMM with its add_rmsnorm (tools/gpu/decode_gemm_sweep.py --cublas-splits): o 8.2 us whole, 7.2 / 7.4 / 10.0 in
# 2 / 4 / 8 parts; down 9.7 whole, 8.2 / 8.3 / 8.3 / 9.0 / 10.1 in 2 / 3 / 4 / 6 / 8. Above
# CUBLAS_SPLIT_K_MAX_ROWS rows a step keeps whole GEMMs: the same sweep at 1 to 512 rows found 2 parts faster at
# every batch up to 384 (o 7.35 -> 6.40 us at 8 rows, 8.16 -> 7.61 at 384) and slower at 512 (o 8.49 -> 8.91).
CUBLAS_SPLIT_K_DEFAULT = (2, 2)
CUBLAS_SPLIT_K_MAX_ROWS = 384


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """F.linear(x, weight) for parts == 1; else its fp32 partial products [parts, n, N] over `parts` equal shares of
    K (add_rmsnorm sums them), from one strided-batch GEMM over views of x and weight (no copies)."""
    if parts == 1:
        return torch.nn.functional.linear(x, weight)
    (n, k), out_features = x.shape, weight.shape[0]
    if k % parts or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(
            f"split_k_linear: K = {k} must split into {parts} equal parts of contiguous x and weight; set "
            "engine.kernels.cublas_split_k to parts that divide the model's heads x head_dim and intermediate size"
        )
    share = k // parts
    xs = x.view(n, parts, share).transpose(0, 1)  # [parts, n, share], rows k apart
    ws = weight.view(out_features, parts, share).permute(1, 2, 0)  # [parts, share, N]
    if x.is_cuda:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    # CPU builds have no bmm with out_dtype: the same products (a bf16 x bf16 product is exact in fp32).
    return torch.bmm(xs.float(), ws.float())


if AVAILABLE:

    @triton.jit
    def _linear_kernel(
        X,
        W,
        Bias,
        Out,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        part_stride,
        up_rows,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GATED: tl.constexpr,
        IEEE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        # Out [M, N] = X [M, K] @ W[:N]^T (+ bias), over program (m, n)'s tile. With SPLIT_K > 1, program k's share
        # of K goes to Out[k] (fp32 partials that add_rmsnorm sums: at M = 256 an [M, 1024] output has too few tiles
        # to fill the GPU, and the reduction costs no launch of its own there). GATED: W is [gate; up] with the up
        # rows from `up_rows`, and Out gets silu(gate) * up, each product rounded as a separate GEMM's would be.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mm = offs_m[:, None] < M
        mn = offs_n[:, None] < N
        k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        xp = X + offs_m[:, None].to(tl.int64) * stride_xm
        wp = W + offs_n[:, None].to(tl.int64) * stride_wn
        for k0 in range(k_lo, tl.minimum(K, k_lo + k_per), BLOCK_K):
            ks = k0 + offs_k
            mk = ks[None, :] < K
            x = tl.load(xp + ks[None, :], mask=mm & mk, other=0.0)
            w = tl.load(wp + ks[None, :], mask=mn & mk, other=0.0)
            # fp32 models: full-precision products, as cuBLAS's fp32 GEMM (tl.dot would round them to TF32).
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            if GATED:
                wu = tl.load(wp + up_rows * stride_wn + ks[None, :], mask=mn & mk, other=0.0)
                if IEEE:
                    acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(x, tl.trans(wu), acc_up)
        mask = mm & (offs_n[None, :] < N)
        ptrs = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        if SPLIT_K > 1:
            tl.store(ptrs + pid_k * part_stride, acc, mask=mask)
        else:
            dt = Out.dtype.element_ty
            if HAS_BIAS:
                acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            if GATED:
                g = acc.to(dt).to(tl.float32)
                u = acc_up.to(dt).to(tl.float32)
                sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
                tl.store(ptrs, (sg * u).to(dt), mask=mask)
            else:
                tl.store(ptrs, acc.to(dt), mask=mask)

    @triton.jit
    def _silu_mul_kernel(GU, Out, n, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # GU [rows, 2*inter] = [gate | up] (one GEMM); Out [rows, inter] = silu(gate) * up.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        r = offs // inter
        c = offs % inter
        g = tl.load(GU + r * (2 * inter) + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + r * (2 * inter) + inter + c, mask=m, other=0.0).to(tl.float32)
        dt = Out.dtype.element_ty
        sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(Out + offs, (sg * u).to(dt), mask=m)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, ...],
    gated: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias), as F.linear, on Triton tiles; config = (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
    num_warps, num_stages). SPLIT_K > 1 returns fp32 partials [SPLIT_K, M, N] for `add_rmsnorm` to sum (no
    bias then). gated: weight is [gate; up] (2I rows) and the result is silu(x @ gate.T) * (x @ up.T), [M, I]."""
    bm, bn, bk, split, warps, stages = config
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if split > 1 and (bias is not None or gated):
        raise ValueError(f"linear: SPLIT_K {split} returns partial products, which take no bias or gate; use 1")
    if split > 1:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        n,
        m * n,
        n,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=split,
        HAS_BIAS=bias is not None,
        GATED=gated,
        IEEE=x.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(x),
    )
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out [n, I] = silu(gate_up[:, :I]) * gate_up[:, I:]."""
    n = out.numel()
    block = 1024
    _silu_mul_kernel[(triton.cdiv(n, block),)](gate_up, out, n, out.shape[1], BLOCK=block, num_warps=4, **pdl_args(out))
