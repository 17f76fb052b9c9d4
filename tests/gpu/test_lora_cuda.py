"""LoRA on CUDA in bf16: adapters pushed to a batch-invariant embedded engine are merged into the weights the trainer
scores with, bit for bit, and the engine samples the trainer's log-probs (tests/unit/test_lora_engine.py is the CPU
fp32 version that CI runs).

Skipped without CUDA. On the GPU machine: `PYTHONPATH=. python3 -m pytest tests/gpu/test_lora_cuda.py -q`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcrl.model.qwen3 import ModelArgs
from hpcrl.trainer.config import LoRAConfig, TrainConfig
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.conftest import start_engine
from tests.unit.test_lora import batch
from tests.unit.test_lora_engine import engine_logprobs, trainer_logprobs
from tests.unit.test_weight_apply import by_handover, weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_adapters_are_served_as_the_trainer_merges_them(tiny_model_dir: Path, tmp_path: Path) -> None:
    eng = start_engine(
        tiny_model_dir, tmp_path, "--device", "cuda", "--dtype", "bfloat16", "--batch-invariant", timeout_s=180
    )
    try:
        lora = LoRAConfig(rank=8, alpha=16.0)
        cfg = TrainConfig(
            lr=2e-2, device="cuda", dtype="bfloat16", logprobs="invariant", converters=("lora",), lora=lora
        )
        trainer = TorchTrainer(cfg, tiny_model_dir)
        vocab = ModelArgs.from_dir(tiny_model_dir).vocab_size
        for version in (1, 2):
            trainer.train_grpo(batch(vocab, seed=version))
            r = by_handover(eng.url, trainer.push_weights(), apply_strategy="lora")
            assert r.json()["success"], r.text
            for name, layer in list(trainer.converters[0].layers.items())[:4]:  # type: ignore[attr-defined]
                served = weight(eng.url, f"{name}.weight")
                assert served == layer.weight.detach().float().flatten().tolist(), (version, name)
            output_ids, engine_lps = engine_logprobs(eng.url)
            assert torch.equal(engine_lps, trainer_logprobs(trainer, output_ids).cpu()), version
    finally:
        eng.stop()
