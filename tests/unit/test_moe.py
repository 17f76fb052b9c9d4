"""Qwen3-MoE in hpcrl's model: the same function as transformers' Qwen3MoeForCausalLM on the same weights, the
load-balancing loss, the HF directory round trip, and routing replay."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcrl.model import moe
from hpcrl.model.hf import check_model_dir, load_model, save_state_dict
from hpcrl.model.qwen3 import ModelArgs
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model

SPEC = TinyModelSpec(
    num_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("moe") / "model", SPEC)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (3, 12), generator=gen)
    lengths = torch.tensor([12, 9, 5])
    mask = torch.arange(12)[None, :] < lengths[:, None]
    return ids * mask, mask


def test_logprobs_and_aux_loss_equal_transformers(moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    model = load_model(moe_dir)
    assert model.args.moe is not None and model.args.moe.num_experts == 8 and model.args.moe.top_k == 2
    ids, mask = _batch()
    model.routing.record_logits = True
    with torch.no_grad():
        ours = torch.log_softmax(model(ids), -1)
        theirs_out = ref(input_ids=ids, attention_mask=mask.long(), output_router_logits=True)
    theirs = torch.log_softmax(theirs_out.logits, -1)
    # Right padding never reaches a real token (causal), so real positions compare across the two.
    assert torch.allclose(ours[mask], theirs[mask], atol=2e-5, rtol=0), (ours[mask] - theirs[mask]).abs().max()
    aux = moe.aux_loss(model.routing, model.args.moe, mask)
    assert torch.allclose(aux, theirs_out.aux_loss.float(), atol=1e-6), (aux, theirs_out.aux_loss)
    # Each layer's routed experts: the top-k of the router (two per token, distinct).
    routes = moe.routes_of(model.routing, model.args.moe, *ids.shape)
    assert routes.shape == (3, 12, 2, 2) and int(routes.min()) >= 0 and int(routes.max()) < 8
    assert bool((routes[..., 0] != routes[..., 1]).all())


def test_hf_round_trip_and_fused_experts(moe_dir: Path, tmp_path: Path) -> None:
    model = load_model(moe_dir)
    names = set(model.state_dict())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    out = save_state_dict(model.state_dict(), tmp_path / "export", source_dir=moe_dir)
    again = load_model(out)
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    # transformers 5's in-memory layout (fused experts) saved as is loads to the same weights.
    from safetensors.torch import save_file

    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((moe_dir / "config.json").read_text())
    state = {k: v.clone() for k, v in model.state_dict().items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        state[p + "gate_up_proj"] = torch.stack(
            [torch.cat([model.state_dict()[f"{p}{e}.gate_proj.weight"], model.state_dict()[f"{p}{e}.up_proj.weight"]])
             for e in range(8)])  # fmt: skip
        state[p + "down_proj"] = torch.stack([model.state_dict()[f"{p}{e}.down_proj.weight"] for e in range(8)])
    save_file(state, str(fused / "model.safetensors"))
    check_model_dir(fused)
    for k, v in load_model(fused).state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_config_fields_parsed_or_refused(moe_dir: Path) -> None:
    cfg = json.loads((moe_dir / "config.json").read_text())
    args = ModelArgs.from_hf_config({**cfg, "decoder_sparse_step": 2, "num_hidden_layers": 4, "mlp_only_layers": [3]})
    assert args.moe is not None and args.moe.sparse_layers == (False, True, False, False)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelArgs.from_hf_config({**cfg, "shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelArgs.from_hf_config({**cfg, "num_experts_per_tok": 9})


def test_replay_forces_experts_and_keeps_router_gradient(moe_dir: Path) -> None:
    model = load_model(moe_dir).train()
    args = model.args.moe
    assert args is not None
    ids, mask = _batch()
    with torch.no_grad():
        model(ids)
    own = moe.routes_of(model.routing, args, *ids.shape)
    stats = moe.route_stats(model.routing, args, mask)
    assert np.isnan(stats["moe/route_agreement"]) and stats["moe/expert_load_cv"] >= 0
    # Replaying the model's own routes changes nothing and agrees everywhere.
    model.routing.replay = own
    with torch.no_grad():
        same = model(ids)
    assert moe.route_stats(model.routing, args, mask)["moe/route_agreement"] == 1.0
    model.routing.replay = None
    with torch.no_grad():
        assert torch.equal(same, model(ids))
    # Other routes: the forward uses them, the agreement says how many token x layer sets differ, and the
    # router still gets a gradient through the gate weights of the forced experts.
    forced = (own + 1) % args.num_experts
    forced[0, 0] = -1  # unknown: routed by the model's own router, not counted
    model.routing.replay = forced
    lp = torch.log_softmax(model(ids), -1)[mask].sum()
    assert torch.equal(moe.routes_of(model.routing, args, *ids.shape)[0, 1:], forced[0, 1:])
    assert moe.route_stats(model.routing, args, mask)["moe/route_agreement"] == 0.0
    lp.backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and float(gate.grad.abs().sum()) > 0
    # Observed, not forced: the model's own routes and output, and the agreement with the given routes.
    model.routing.force = False
    with torch.no_grad():
        assert torch.equal(model(ids), same)
    assert moe.route_stats(model.routing, args, mask)["moe/route_agreement"] == 0.0
    model.routing.force = True
    model.routing.replay = forced[:, :5]
    with pytest.raises(ValueError, match=r"routes of shape \(3, 5, 2, 2\) do not fit"):
        model(ids)


def test_route_wire_format() -> None:
    routes = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2)
    text = moe.encode_routes(routes)
    assert np.array_equal(moe.decode_routes(text, 2, 2), routes)
    with pytest.raises(ValueError, match="3 layers x 2 experts"):
        moe.decode_routes(text, 3, 2)


def test_trainer_replays_rollout_routes_and_adds_the_aux_loss(moe_dir: Path) -> None:
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.config import TrainConfig
    from hpcrl.trainer.torch_backend import TorchTrainer

    trainer = TorchTrainer(TrainConfig(lr=1e-3, micro_batch_size=2), moe_dir)
    model = trainer.model
    args = model.args.moe
    assert args is not None
    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[20, 21, 22], [23, 24, 25, 26], [27]]
    routes = []
    for p, r in zip(prompts, responses, strict=True):
        with torch.no_grad():
            model(torch.tensor([p + r]))
        routes.append(moe.routes_of(model.routing, args, 1, len(p) + len(r))[0, :-1].numpy())
    # Replaying the routes the model itself picks: the trainer's router agrees everywhere.
    batch = TrainBatch.from_sequences(prompts, responses, advantages=[1.0, -1.0, 0.5], routed_experts=routes)
    assert batch.routed_experts is not None and tuple(batch.routed_experts.shape) == (3, 6, 2, 2)
    metrics = trainer.train_grpo(batch)
    assert metrics["moe/route_agreement"] == 1.0
    assert metrics["moe/aux_loss"] > 0 and metrics["moe/expert_load_cv"] >= 0
    # Other experts in every set: agreement 0 (measured before replay).
    shifted = [(r + 1) % args.num_experts for r in routes]
    metrics = trainer.train_grpo(
        TrainBatch.from_sequences(prompts, responses, advantages=[1.0, -1.0, 0.5], routed_experts=shifted)
    )
    assert metrics["moe/route_agreement"] == 0.0
    with pytest.raises(ValueError, match=r"sequence 0: routed experts for 4 tokens, but it has 6 tokens"):
        TrainBatch.from_sequences(prompts, responses, routed_experts=[routes[2], routes[1], routes[0]])
