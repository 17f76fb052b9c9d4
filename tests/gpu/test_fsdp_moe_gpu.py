"""train.parallelism: fsdp2 with a mixture-of-experts model on one CUDA device (NCCL): the same step as DDP in fp32,
and the CUDA defaults (bf16 compute, the experts' grouped GEMMs inside their own FSDP2 group) with activation
checkpointing and routing replay.

Skipped without CUDA. On the GPU machine: `PYTHONPATH=. python3 -m pytest tests/gpu/test_fsdp_moe_gpu.py -q`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hpcrl.model.tiny import init_tiny_model
from hpcrl.trainer.config import FSDPConfig
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.unit.fsdp_moe_ranks import batch_for
from tests.unit.fsdp_ranks import config, pushed
from tests.unit.test_fsdp_moe import SPEC

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("no_tf32"),
]


def test_fsdp2_trains_moe_on_cuda_as_ddp(tmp_path: Path) -> None:
    model_dir = init_tiny_model(tmp_path / "moe", SPEC)
    # fp32 compute on both sides: the per-expert path, steps equal to fp32 rounding.
    ddp = TorchTrainer(config("ddp", 1, device="cuda", routing_replay="rollout"), model_dir)
    fp32 = FSDPConfig(param_dtype="float32")
    fsdp = TorchTrainer(config("fsdp2", 1, device="cuda", routing_replay="rollout", fsdp=fp32), model_dir)
    batch = batch_for(ddp)
    for _ in range(2):
        a, b = ddp.train_grpo(batch), fsdp.train_grpo(batch)
        for key in ("loss", "moe/aux_loss", "moe/route_agreement"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    want, got = pushed(ddp), pushed(fsdp)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=2e-5)
    # The defaults: bf16 compute (grouped GEMMs on compute capability >= 9.0), selective checkpointing.
    cfg = config("fsdp2", 1, device="cuda", routing_replay="rollout", activation_checkpointing="selective")
    bf16 = TorchTrainer(cfg, model_dir)
    first = TorchTrainer(config("ddp", 1, device="cuda", routing_replay="rollout"), model_dir).train_grpo(batch)
    metrics = bf16.train_grpo(batch)
    assert metrics["loss"] == pytest.approx(first["loss"], rel=5e-2, abs=5e-3)
    assert math.isfinite(metrics["moe/aux_loss"]) and metrics["moe/aux_loss"] > 0
    assert all(torch.isfinite(t).all() for _, t in bf16.push_weights())
