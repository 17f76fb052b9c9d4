"""Routing replay's bad input: routes of another model's shape are refused naming both shapes; replay asked of a
dense model does nothing, and says so."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcrl.model.hf import load_model
from hpcrl.model.moe import replayed_routes_shape
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.moe_routing import MoeRouting

PROMPTS, RESPONSES = [[5, 6, 7], [8, 9]], [[20, 21], [22, 23, 24]]


def _routes(layers: int, top_k: int) -> list[np.ndarray]:
    return [np.zeros((len(p) + len(r) - 1, layers, top_k), np.int32) for p, r in zip(PROMPTS, RESPONSES, strict=True)]


def test_routes_of_another_shape_are_refused_naming_both(tmp_path: Path) -> None:
    spec = TinyModelSpec(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)  # fmt: skip
    model = load_model(init_tiny_model(tmp_path / "moe", spec))
    routing = MoeRouting(model, model.args.moe, "rollout")
    # Routes of a 3-layer top-4 model (another checkpoint's engine) for this 2-layer top-2 one.
    batch = TrainBatch.from_sequences(PROMPTS, RESPONSES, routed_experts=_routes(3, 4))
    with pytest.raises(ValueError, match=r"shape \(2, 5, 3, 4\), but this model has 2 layers and top-2 routing: "
                       r"\[sequences, tokens, 2, 2\] expected"):  # fmt: skip
        routing.before(model, batch)
    # The right shape passes and is forced on the next forward.
    routing.before(model, TrainBatch.from_sequences(PROMPTS, RESPONSES, routed_experts=_routes(2, 2)))
    assert model.routing.replay is not None and tuple(model.routing.replay.shape) == (2, 5, 2, 2)


def test_replay_asked_of_a_dense_model_is_a_no_op_that_says_so(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The run asks its engines for no routes ...
    assert replayed_routes_shape(tiny_model_dir, "rollout") is None
    model = load_model(tiny_model_dir)
    batch = TrainBatch.from_sequences(PROMPTS, RESPONSES)
    with caplog.at_level(logging.INFO, logger="hpcrl.trainer.moe_routing"):
        routing = MoeRouting(model, model.args.moe, "rollout")
    # ... and the trainer logs that the setting does nothing, and forces nothing.
    assert "train.routing_replay: rollout does nothing for this dense model" in caplog.text
    assert not routing.active
    routing.before(model, batch)
    with torch.no_grad():
        model(batch.input_ids)
    assert routing.after(model, batch) is None
