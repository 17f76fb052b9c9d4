"""The grouped-GEMM expert sum (the CUDA bf16 path of the MoE block) against the plain per-expert path, run here
through torch's CPU `_grouped_mm`: the same outputs and gradients within bf16 rounding, empty experts included."""

from __future__ import annotations

import pytest
import torch

from hpcrl.model.moe import MoeArgs, Routing, SparseMoeBlock, grouped_experts

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm needs torch >= 2.8")


def test_grouped_experts_equal_the_per_expert_path() -> None:
    torch.manual_seed(0)
    args = MoeArgs(num_experts=8, top_k=2, moe_intermediate_size=24, sparse_layers=(True,))
    block = SparseMoeBlock(32, args, 0, Routing()).to(torch.bfloat16)
    flat = torch.randn(37, 32, dtype=torch.bfloat16, requires_grad=True)
    # Experts 5-7 get no token: empty groups between and after full ones.
    chosen = torch.randint(0, 5, (37, 2))
    chosen[:, 1] = (chosen[:, 0] + 1) % 5
    weights = torch.rand(37, 2).to(torch.bfloat16)
    plain = block.experts.plain(flat, chosen, weights)
    gate_up, down = block.experts.stacked()
    grouped = grouped_experts(flat, chosen, weights, gate_up, down)
    assert grouped.shape == plain.shape
    torch.testing.assert_close(grouped.float(), plain.float(), atol=2e-2, rtol=2e-2)
    (g_plain,) = torch.autograd.grad(plain.float().square().sum(), block.experts[1].down_proj.weight)
    (g_grouped,) = torch.autograd.grad(grouped.float().square().sum(), block.experts[1].down_proj.weight)
    torch.testing.assert_close(g_grouped.float(), g_plain.float(), atol=5e-2, rtol=5e-2)
    assert float(g_plain.abs().max()) > 0


def test_stacked_weights_follow_in_place_updates_under_inference_mode() -> None:
    args = MoeArgs(num_experts=4, top_k=2, moe_intermediate_size=8, sparse_layers=(True,))
    block = SparseMoeBlock(16, args, 0, Routing()).to(torch.bfloat16)
    with torch.inference_mode():
        first = block.experts.stacked()[1].clone()
        assert block.experts.stacked()[1].data_ptr() == block.experts.stacked()[1].data_ptr()  # kept between forwards
    with torch.no_grad():
        block.experts[2].down_proj.weight.add_(1.0)
    with torch.inference_mode():
        assert torch.equal(block.experts.stacked()[1][2], first[2] + 1.0)
