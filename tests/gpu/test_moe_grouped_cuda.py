"""Grouped expert GEMMs on CUDA (bf16, sm90+): the MoE block's CUDA path equals the plain per-expert path within bf16
tolerance at a Qwen3-30B-A3B layer's expert shape (128 experts, top-8, hidden 2048, expert width 768), and both
times are printed (decode-sized and prefill-sized batches; no timed assertion)."""

from __future__ import annotations

import time

import pytest
import torch

from hpcrl.model.moe import MoeArgs, Routing, SparseMoeBlock, grouped_mm_on

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not grouped_mm_on(torch.device("cuda")),
        reason="needs CUDA with torch._grouped_mm (torch >= 2.8, compute capability 9.0+)",
    ),
]


def _ms(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


@pytest.mark.parametrize("tokens", [64, 2048])
def test_grouped_experts_match_plain_and_are_timed(tokens: int) -> None:
    torch.manual_seed(0)
    args = MoeArgs(num_experts=128, top_k=8, moe_intermediate_size=768, sparse_layers=(True,))
    block = SparseMoeBlock(2048, args, 0, Routing()).to(device="cuda", dtype=torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        probs = torch.softmax(block.gate(x).float(), dim=-1)
        top_p, chosen = torch.topk(probs, 8, dim=-1)
        weights = top_p.to(torch.bfloat16)
    with torch.inference_mode():  # the engine's decode: the stacked weights are kept between forwards
        grouped = block.experts(x, chosen, weights)
        plain = block.experts.plain(x, chosen, weights)
        grouped_ms = _ms(lambda: block.experts(x, chosen, weights))
        plain_ms = _ms(lambda: block.experts.plain(x, chosen, weights))
    print(f"\n{tokens} tokens x top-8 of 128 experts: grouped {grouped_ms:.3f} ms, per-expert {plain_ms:.3f} ms "
          f"({plain_ms / grouped_ms:.1f}x)")  # fmt: skip
    scale = float(plain.float().abs().max())
    assert float((grouped.float() - plain.float()).abs().max()) <= 2e-2 * scale + 1e-3
    # The trainer's path (autograd records: the weights are stacked in the forward) matches too, gradients included.
    xg = x.clone().requires_grad_(True)
    out_g = block.experts(xg, chosen, weights)
    out_p = block.experts.plain(xg, chosen, weights)
    torch.testing.assert_close(out_g.float(), out_p.float(), atol=2e-2 * scale + 1e-3, rtol=2e-2)
    (gx_g, gw_g) = torch.autograd.grad(out_g.float().sum(), (xg, block.experts[0].up_proj.weight), allow_unused=True)
    (gx_p, gw_p) = torch.autograd.grad(out_p.float().sum(), (xg, block.experts[0].up_proj.weight), allow_unused=True)
    torch.testing.assert_close(gx_g.float(), gx_p.float(), atol=2e-2 * float(gx_p.abs().max()) + 1e-3, rtol=2e-2)
    if gw_p is not None:  # expert 0 got tokens
        assert gw_g is not None
        torch.testing.assert_close(gw_g.float(), gw_p.float(), atol=2e-2 * float(gw_p.abs().max()) + 1e-3, rtol=2e-2)
