"""The batch-invariant forward's CUDA kernels (RMSNorm, tiled attention, the graphed decode step).

Runs on CUDA; without a GPU it runs under Triton's interpreter when TRITON_INTERPRET=1 (slow, small
shapes), and is skipped otherwise. tests/unit/test_invariant.py checks the plain-torch path in CI.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hpcrl.model import invariant, invariant_kernels
from hpcrl.model.qwen3 import CausalLM, KVCache, ModelArgs
from tests.gpu.triton_support import DEVICE, DTYPES, needs_triton

pytestmark = needs_triton
# Triton's interpreter runs tl.dot as numpy matmul, whose BLAS may round a row differently by its place in the
# tile; a GPU's MMA does not. Bitwise claims that go through the GEMM kernel are checked on CUDA only.
needs_cuda_gemm = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the interpreter's tl.dot is numpy's BLAS, not batch-invariant"
)


def _model(dtype: torch.dtype, *, fusable: bool = False, windows: tuple[int | None, ...] = ()) -> CausalLM:
    """A small Qwen3. Its MLP width (88) is off the GEMM's 16-column tiles, so the engine does not stack gate/up;
    `fusable` gives widths on them (the engine stacks q/k/v and gate/up); `windows`: each layer's sliding window."""
    widths = dict(intermediate_size=128, num_heads=4, head_dim=32) if fusable else {}
    args = ModelArgs(
        **{
            **dict(
                vocab_size=200, hidden_size=64, intermediate_size=88, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, eos_token_ids=(2,), layer_windows=windows,
            ),
            **widths,
        }
    )  # fmt: skip
    torch.manual_seed(0)
    model = CausalLM(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.2)
    return model.to(DEVICE, dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_path_is_taken_and_matches_the_reference_math(dtype: torch.dtype) -> None:
    """The kernels compute RMSNorm and causal GQA attention (against F.rms_norm-style math and SDPA)."""
    torch.manual_seed(1)
    x = torch.randn(37, 64, device=DEVICE, dtype=dtype)
    w = torch.rand(64, device=DEVICE, dtype=dtype) + 0.5
    assert invariant_kernels.usable(x, 16)
    ref = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(invariant_kernels.rms_norm(x, w, 1e-6), ref, rtol=tol, atol=tol)

    b, t, h, kvh, d = 2, 45, 4, 2, 16
    q = torch.randn(b * t, h, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, kvh, t, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, kvh, t, d, device=DEVICE, dtype=dtype)
    rows_b = torch.arange(b, device=DEVICE).repeat_interleave(t)
    rows_p = torch.arange(t, device=DEVICE).repeat(b)
    out = invariant_kernels.attention(q, k, v, rows_b, rows_p, 1 / math.sqrt(d))
    qh = q.view(b, t, h, d).transpose(1, 2).float()
    sdpa = F.scaled_dot_product_attention(
        qh, k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(out.float(), sdpa.transpose(1, 2).reshape(b * t, h, d), rtol=tol, atol=tol)


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])
def test_attention_handles_any_query_group_size(heads: int, kv_heads: int) -> None:
    """Three query heads per kv head (padded to four inside the kernel) and plain multi-head attention."""
    torch.manual_seed(3)
    b, t, d = 2, 40, 16
    q = torch.randn(b * t, heads, d, device=DEVICE)
    k = torch.randn(b, kv_heads, t, d, device=DEVICE)
    v = torch.randn(b, kv_heads, t, d, device=DEVICE)
    rows_b = torch.arange(b, device=DEVICE).repeat_interleave(t)
    rows_p = torch.arange(t, device=DEVICE).repeat(b)
    out = invariant_kernels.attention(q, k, v, rows_b, rows_p, 1 / math.sqrt(d))
    g = heads // kv_heads
    qh = q.view(b, t, heads, d).transpose(1, 2)
    sdpa = F.scaled_dot_product_attention(qh, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
    torch.testing.assert_close(out, sdpa.transpose(1, 2).reshape(b * t, heads, d), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 8, 21, 40])
def test_attention_kernel_sees_only_the_keys_in_the_window(window: int) -> None:
    """A sliding window: each row sees the keys q - window < k <= q (the band transformers masks), across tiles."""
    torch.manual_seed(5)
    b, t, h, kvh, d = 2, 45, 4, 2, 16
    q = torch.randn(b * t, h, d, device=DEVICE)
    k = torch.randn(b, kvh, t, d, device=DEVICE)
    v = torch.randn(b, kvh, t, d, device=DEVICE)
    rows_b = torch.arange(b, device=DEVICE).repeat_interleave(t)
    rows_p = torch.arange(t, device=DEVICE).repeat(b)
    out = invariant_kernels.attention(q, k, v, rows_b, rows_p, 1 / math.sqrt(d), window)
    pos = torch.arange(t, device=DEVICE)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    qh = q.view(b, t, h, d).transpose(1, 2)
    sdpa = F.scaled_dot_product_attention(qh, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=band)
    torch.testing.assert_close(out, sdpa.transpose(1, 2).reshape(b * t, h, d), rtol=1e-5, atol=1e-5)


def test_store_kv_writes_each_rows_k_and_v_at_its_own_position() -> None:
    torch.manual_seed(4)
    cache = KVCache.allocate(_model(torch.float32).args, 6, 20, torch.float32, DEVICE)
    k, v = torch.randn(2, 4, 2, 16, device=DEVICE).unbind(0)
    positions = torch.tensor([3, 0, 19, 7], device=DEVICE)
    expect_k, expect_v = cache.k[1].clone(), cache.v[1].clone()
    expect_k[torch.arange(4), :, positions] = k
    expect_v[torch.arange(4), :, positions] = v
    invariant_kernels.store_kv(k, v, cache.k[1], cache.v[1], positions)
    assert torch.equal(cache.k[1], expect_k) and torch.equal(cache.v[1], expect_v)
    assert not cache.k[0].any() and not cache.v[0].any()  # the other layer untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_the_qk_norm_rope_kernel_is_the_torch_ops_in_one_launch(dtype: torch.dtype, qk_norm: bool) -> None:
    torch.manual_seed(3)
    x = torch.randn(19, 4, 16, device=DEVICE, dtype=dtype)
    w = torch.rand(16, device=DEVICE, dtype=dtype) + 0.5 if qk_norm else None
    cos_t, sin_t = invariant.rope_tables(64, 16, 10000.0, DEVICE)
    pos = torch.randint(0, 64, (19,), device=DEVICE)
    cos, sin = cos_t[pos][:, None], sin_t[pos][:, None]
    got = invariant_kernels.qk_norm_rope(x, w, 1e-6, cos[:, 0].contiguous(), sin[:, 0].contiguous())
    want = invariant._torch_qk_norm_rope(x, w, 1e-6, cos, sin)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(invariant_kernels.qk_norm_rope(x[7:8], w, 1e-6, cos[7:8, 0], sin[7:8, 0]), got[7:8])


@needs_cuda_gemm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("windows", [(), (8, None)], ids=["full", "window-8"])
def test_prefill_equals_decode_at_every_position_on_the_kernels(
    dtype: torch.dtype, windows: tuple[int | None, ...]
) -> None:
    model = _model(dtype, windows=windows)
    t = 40  # two key tiles, the second one's tail masked
    ids = torch.randint(3, 199, (3, t), device=DEVICE)
    with torch.no_grad():
        whole = invariant.logits(model, ids)
        cache = KVCache.allocate(model.args, 3, 64, dtype, DEVICE)
        first = invariant.prefill(model, cache, ids[:, :1], 0, torch.zeros(3, dtype=torch.long, device=DEVICE))
        assert torch.equal(first, whole[:, 0])
        for pos in range(1, t):
            step = invariant.decode(model, cache, ids[:, pos], torch.full((3,), pos, device=DEVICE))
            assert torch.equal(step, whole[:, pos]), pos
        # One row alone (batch 1, a different grid) gives the same bits as in the batch of 3.
        alone = invariant.logits(model, ids[1:2])
    assert torch.equal(alone[0], whole[1])


@pytest.mark.parametrize("windows", [(), (8, None)], ids=["full", "window-8"])
def test_the_kernel_forward_has_the_plain_gradient(windows: tuple[int | None, ...]) -> None:
    """Training through the kernels: the gradient (and the log-probs) are standard attention's and RMSNorm's, within
    a sliding window too."""
    model = _model(torch.float32, windows=windows).train()
    ids = torch.randint(3, 199, (2, 20), device=DEVICE)
    got_lp = invariant.token_logprobs(model, ids)
    got_lp.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    lp = torch.log_softmax(model(ids)[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
    torch.testing.assert_close(got_lp, lp[..., 0], rtol=1e-4, atol=1e-4)
    lp.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(got[name], p.grad, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("fusable", [False, True])
def test_the_graphed_invariant_decode_step_equals_the_eager_one(fusable: bool) -> None:
    """The graphed step equals the eager one and the trainer-side forward of the whole sequence; with
    tile-aligned widths the engine's stacked q/k/v and gate/up GEMMs give the separate GEMMs' bits."""
    from hpcrl.engine.embedded.runner import DecodeRunner

    model = _model(torch.bfloat16, fusable=fusable)
    assert invariant.fusable(model.args) == fusable
    cache = KVCache.allocate(model.args, 16, 64, torch.bfloat16, DEVICE)
    ids = torch.randint(3, 199, (5, 12), device=DEVICE)
    with torch.no_grad():
        invariant.prefill(model, cache, ids[:, :11], 0, torch.full((5,), 10, device=DEVICE))
        runner = DecodeRunner(model, cache, max_batch=16, device=DEVICE, mode="invariant")
        runner.slots.tokens[:5] = ids[:, 11]
        runner.slots.positions[:5] = 11
        eager = runner._invariant_forward(5).clone()
        graph, lp = runner._invariant_graph(runner.graphs.bucket(5))
        graph.replay()
        assert (runner.paths.fused is not None) == fusable
        assert torch.equal(lp[:5], runner._invariant_forward(5))
        assert torch.equal(lp[:5], eager)
        whole = invariant.logprob_rows(invariant.logits(model, ids)[:, 11])
    assert torch.equal(eager, whole)


@needs_cuda_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gemm_and_log_softmax_kernels_give_a_row_the_same_bits_at_any_batch(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    x = torch.randn(70, 96, device=DEVICE, dtype=dtype)
    w = torch.randn(130, 96, device=DEVICE, dtype=dtype) / 10
    full = invariant_kernels.matmul(x, w)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), x.float() @ w.float().t(), rtol=tol, atol=tol)
    for rows in (slice(0, 1), slice(5, 12), slice(64, 70)):
        assert torch.equal(invariant_kernels.matmul(x[rows], w), full[rows])
    logits = torch.randn(9, 3000, device=DEVICE) * 4
    lp = invariant_kernels.log_softmax(logits)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(invariant_kernels.log_softmax(logits[3:4]), lp[3:4])
