"""The embedded engine serves a Qwen3-MoE model on CUDA over HTTP: the log-probs it reports are the trainer's, and
the routed experts it answers have SGLang's layout and are the trainer's router's choices."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hpcrl.model import moe
from hpcrl.model.hf import load_model
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
from tests.conftest import start_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("decode_mode", ["eager", "graph"])
def test_cuda_engine_serves_moe_with_routes(decode_mode: str, tmp_path: Path) -> None:
    spec = TinyModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                         head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    model_dir = init_tiny_model(tmp_path / "model", spec)
    eng = start_engine(model_dir, tmp_path, "--device", "cuda", "--dtype", "float32", "--decode-mode", decode_mode)
    try:
        prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
        body = {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True},
            "return_logprob": True,
            "return_routed_experts": True,
        }
        answers = httpx.post(f"{eng.url}/generate", json=body, timeout=120).json()
    finally:
        eng.stop()
    model = load_model(model_dir)
    args = model.args.moe
    assert args is not None
    agree = total = 0
    for prompt, a in zip(prompts, answers, strict=True):
        out = a["output_ids"]
        assert len(out) == 12
        ids = torch.tensor(prompt + out)
        with torch.no_grad():
            lp = torch.log_softmax(model(ids[None])[0], -1)
        trainer = lp[len(prompt) - 1 : -1].gather(-1, ids[len(prompt) :, None])[:, 0]
        engine = torch.tensor([t[0] for t in a["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(trainer, engine, atol=1e-3), (trainer - engine).abs().max()
        routes = moe.decode_routes(a["meta_info"]["routed_experts"], 2, 2)
        assert routes.shape == (len(prompt) + 12 - 1, 2, 2)
        own = moe.routes_of(model.routing, args, 1, len(ids))[0, :-1].numpy()
        same = (np.sort(own, -1) == np.sort(routes, -1)).all(-1)
        agree, total = agree + int(same.sum()), total + same.size
    assert agree / total > 0.95, agree / total
