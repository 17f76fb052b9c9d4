"""train.parallelism: fsdp2 on one CUDA device (NCCL): the same step as DDP, CPU offload, the memory plan's refusal,
the CUDA defaults (compiled layers, the fused head, micro-batches sized from free memory).

Skipped without CUDA. On the GPU machine: `PYTHONPATH=. python3 -m pytest tests/gpu/test_fsdp_gpu.py -q`; MFU and
peak memory against DDP: `python tools/gpu/fsdp_mfu.py --shape qwen3-1.7b` (and --shape qwen3-4b, qwen3-8b).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcrl.trainer.config import FSDPConfig, TrainConfig
from hpcrl.trainer.sharded_state import gather_full
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.unit.fsdp_ranks import config, fixed_batch, pushed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("no_tf32"),
]


def test_fsdp2_on_cuda_takes_ddps_steps(tiny_model_dir: Path) -> None:
    # fp32 compute on both sides (FSDP2's CUDA default computes in bf16), so the steps compare at fp32 rounding.
    ddp = TorchTrainer(config("ddp", 1, device="cuda"), tiny_model_dir)
    fsdp = TorchTrainer(config("fsdp2", 1, device="cuda", fsdp=FSDPConfig(param_dtype="float32")), tiny_model_dir)
    batch = fixed_batch(ddp.model.args.vocab_size)
    for _ in range(2):
        a, b = ddp.train_grpo(batch), fsdp.train_grpo(batch)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    want, got = pushed(ddp), pushed(fsdp)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=2e-5)


def test_fsdp2_defaults_and_offload_with_activation_checkpointing_train(tiny_model_dir: Path) -> None:
    # Defaults on CUDA: bf16 compute, fp32 reductions and master weights. Offload: shards and AdamW on the host.
    plain = TorchTrainer(config("fsdp2", 1, device="cuda"), tiny_model_dir)
    cfg = config("fsdp2", 1, device="cuda", activation_checkpointing="selective", fsdp=FSDPConfig(offload=True))
    offload = TorchTrainer(cfg, tiny_model_dir)
    assert all(gather_full(p).device.type == "cpu" for p in offload.model.parameters())
    batch = fixed_batch(plain.model.args.vocab_size)
    a, b = plain.train_grpo(batch), offload.train_grpo(batch)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)  # both in bf16 compute
    assert all(torch.isfinite(t).all() for _, t in offload.push_weights())


def test_a_model_state_too_big_for_the_gpu_is_refused_with_the_fix(tmp_path: Path) -> None:
    # Qwen3-8B's config alone (no weights: the plan is checked before the model is loaded): 131 GB of fp32
    # model state under DDP, more than any one card; FSDP2 with offload keeps it in host memory instead.
    cfg = dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        torch_dtype="bfloat16",
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"131\.05 GB per GPU.*train\.parallelism: fsdp2"):
        TorchTrainer(config("ddp", 1, device="cuda"), tmp_path)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_cuda_defaults_compile_fuse_the_head_and_size_micro_batches_from_free_memory(
    tiny_model_dir: Path, parallelism: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = TrainConfig(device="cuda", dtype="bfloat16", parallelism=parallelism, lr=1e-3)
    assert (cfg.torch_compile, cfg.logprob_chunk_tokens, cfg.micro_batch_size) == (True, 4096, "auto")
    trainer = TorchTrainer(cfg, tiny_model_dir)
    line = capsys.readouterr().out
    assert "torch_compile on, fused log-prob head in chunks of 4096 tokens" in line
    assert "micro_batch_size auto (" in line and "1 beyond" in line
    assert trainer.activation_budget is not None and trainer.activation_budget > 10**9
    metrics = trainer.train_grpo(fixed_batch(trainer.model.args.vocab_size))
    assert metrics["micro_batch_size"] == 16  # a tiny model's short sequences: the largest size fits
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    _, state = trainer.state()
    assert state["activation_budget_bytes"] == trainer.activation_budget  # a resume cuts batches alike
