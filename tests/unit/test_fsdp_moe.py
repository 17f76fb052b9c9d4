"""A mixture-of-experts model under train.parallelism: fsdp2 against DDP on two real gloo ranks: one GRPO step
with routing replay gives the same loss, routing metrics, weights and export; its sharded checkpoint resumes on
one rank as DDP's does.

The ranks are processes (tests/unit/fsdp_moe_ranks.py); the one-rank resumes run in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
from hpcrl.store.checkpoint import checkpoint_file, load_checkpoint
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.unit.fsdp_moe_ranks import batch_for
from tests.unit.fsdp_ranks import config, pushed
from tests.unit.test_fsdp import FP32, STEPS, assert_close, launch, wait

# Two sparse layers of 8 experts, top-2.
SPEC = TinyModelSpec(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                     max_position_embeddings=128)  # fmt: skip


def resumed_step(model_dir: Path, ckpt_dir: Path) -> dict:
    """One rank (DDP) resumes a checkpoint and takes the next step on the same batch: the pushed weights."""
    trainer = TorchTrainer(config("ddp", 1, routing_replay="rollout"), model_dir)
    ckpt = load_checkpoint(checkpoint_file(ckpt_dir, 1))
    trainer.load_state(ckpt.tensors, ckpt.state["trainer"], shards=ckpt.shards)
    trainer.train_grpo(batch_for(trainer))
    return pushed(trainer)


def test_fsdp2_trains_moe_as_ddp_and_its_checkpoint_resumes_on_one_rank(tmp_path: Path) -> None:
    model_dir = init_tiny_model(tmp_path / "moe", SPEC)
    out = tmp_path / "two"
    wait(launch(model_dir, out, 2, script="fsdp_moe_ranks.py"))

    ddp, fsdp2 = (json.loads((out / f"{p}.json").read_text()) for p in ("ddp", "fsdp2"))
    for key in ("loss", "grad_norm", "pg_loss", "entropy", "kl", "moe/aux_loss", "moe/expert_load_cv"):
        assert fsdp2[key] == pytest.approx(ddp[key], rel=1e-5, abs=1e-7), key
    # The rollout's routes are random: the router agrees on few of them, and replay forced them all the same.
    assert fsdp2["moe/route_agreement"] == ddp["moe/route_agreement"] < 0.5
    assert fsdp2["moe/aux_loss"] > 0
    after_ddp, after_fsdp2 = load_file(out / "ddp.safetensors"), load_file(out / "fsdp2.safetensors")
    assert_close(after_fsdp2, after_ddp, "fsdp2 x2 after one step", FP32)
    before = load_file(model_dir / "model.safetensors")
    assert sum(not torch.equal(after_ddp[n], before[n]) for n in before) > len(before) // 2  # the step moved them
    assert_close(
        load_file(out / "fsdp2_export" / "model.safetensors"),
        load_file(out / "ddp_export" / "model.safetensors"),
        "fsdp2 export",
        FP32,
    )
    # The two ranks' shards resume on one rank: its next step equals the one resumed from DDP's checkpoint.
    assert_close(
        resumed_step(model_dir, out / "fsdp2_ckpt"), resumed_step(model_dir, out / "ddp_ckpt"), "2 -> 1", STEPS
    )
