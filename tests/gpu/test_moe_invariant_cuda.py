"""True on-policy for a mixture-of-experts model on CUDA: the batch-invariant engine's routes and log-probs equal the
trainer's invariant forward bit for bit without routing replay (tests/unit/test_moe_invariant.py on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcrl.engine.embedded.generate_routes import _extra_meta
from hpcrl.model import moe
from hpcrl.model.hf import load_model
from tests.unit.test_moe_invariant import SHAPE, generate, trainer_agreement

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_invariant_moe_routes_and_logprobs_equal_the_trainers(dtype: torch.dtype, tmp_path: Path) -> None:
    from hpcrl.model.tiny import TinyModelSpec, init_tiny_model

    spec = TinyModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                         head_dim=16, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32)  # fmt: skip
    model = load_model(init_tiny_model(tmp_path / "model", spec), dtype=dtype).to("cuda").eval()
    reqs = generate(model)
    engine_routes = [moe.decode_routes((_extra_meta(r) or {})["routed_experts"], *SHAPE) for r in reqs]
    assert trainer_agreement(model, reqs, engine_routes) == (1.0, 0.0)
