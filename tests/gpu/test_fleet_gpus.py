"""Faults across two GPUs: an engine on GPU 1 SIGKILLed in the middle of an NCCL weight push from the
trainer on GPU 0. The trainer must not hang in the broadcast: the push fails, the
fleet restarts the engine, and every weight is pushed again.

Skipped with fewer than two CUDA devices. On a 2-GPU machine:
    PYTHONPATH=. python3 -m pytest tests/gpu/test_fleet_gpus.py -q -s
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import sigkill_mid_push

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def test_sigkill_during_an_nccl_push_restarts_the_engine(tmp_path: Path, tiny_model_dir: Path) -> None:
    # One engine: NCCL refuses two ranks of one communicator on the same GPU.
    sigkill_mid_push(
        tmp_path, tiny_model_dir, 0, "engine.num_engines=1", "engine.device=cuda:1", "train.device=cuda:0",
    )  # fmt: skip
