"""The fast path is the default on CUDA: train.torch_compile, train.logprob_chunk_tokens and train.micro_batch_size
resolve per device (an explicit value wins), the run's config names what runs, and `auto` micro-batches are sized
from the memory left after the model state."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config import dump_yaml, load_yaml
from hpcrl.model.qwen3 import ModelArgs
from hpcrl.run_config import load_run_config
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.memory_plan import activation_bytes, auto_micro_batch_line, micro_batch_for

QUICKSTART = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"
QWEN3_06B = ModelArgs(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
    head_dim=128,
)  # fmt: skip
GB = 10**9


def resolved(cfg: TrainConfig) -> tuple[object, object, object]:
    return cfg.torch_compile, cfg.logprob_chunk_tokens, cfg.micro_batch_size


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (dict(), (False, None, 16)),  # CPU: no compiler needed, the plain head, as before
        (dict(device="cuda"), (True, 4096, "auto")),  # the trainer sizes micro-batches from the GPU's memory
        (dict(device="cuda:1", parallelism="fsdp2"), (True, 4096, "auto")),
        (dict(device="cuda", backend="megatron"), (True, 4096, 16)),
        (dict(device="cuda", logprobs="invariant"), (False, None, "auto")),  # the engine's own op sequence
        (dict(device="cuda", torch_compile=False, logprob_chunk_tokens=None, micro_batch_size=2), (False, None, 2)),
        (dict(torch_compile=True, logprob_chunk_tokens=1024, micro_batch_size=4), (True, 1024, 4)),
    ],
)
def test_auto_settings_resolve_per_device_and_an_explicit_value_wins(settings: dict, expected: tuple) -> None:
    assert resolved(TrainConfig(**settings)) == expected


def test_the_run_config_names_the_resolved_values_and_replay_keeps_the_plain_head(tmp_path: Path) -> None:
    cuda = load_run_config(QUICKSTART, ["train.device=cuda"])
    dumped = load_yaml(_write(tmp_path / "cuda.yaml", dump_yaml(cuda)))["train"]
    assert (dumped["torch_compile"], dumped["logprob_chunk_tokens"]) == (True, 4096)
    # A resume reads the dumped config back: the same settings.
    assert load_run_config(tmp_path / "cuda.yaml") == cuda
    cpu = load_run_config(QUICKSTART)
    assert (cpu.train.torch_compile, cpu.train.logprob_chunk_tokens) == (False, None)
    # Sampling-support replay scores the logits: `auto` resolves to the plain head; a set chunk is still refused.
    replay = load_run_config(QUICKSTART, ["train.device=cuda", "rollout.top_k=20"])
    assert (replay.train.torch_compile, replay.train.logprob_chunk_tokens) == (True, None)
    with pytest.raises(ValueError, match="train.logprob_chunk_tokens .* would not be used"):
        load_run_config(QUICKSTART, ["train.device=cuda", "rollout.top_k=20", "train.logprob_chunk_tokens=4096"])
    with pytest.raises(ValueError, match="torch_compile fuses the layers' kernels"):
        TrainConfig(device="cuda", logprobs="invariant", torch_compile=True)


def test_auto_micro_batches_are_the_largest_that_fit_the_memory_left() -> None:
    bf16 = TrainConfig(device="cuda", dtype="bfloat16")
    per_sequence = activation_bytes(bf16, QWEN3_06B, 1, 2048)
    assert 8 * GB < per_sequence < 10 * GB  # 28 layers x 2048 tokens of activations (5.6 GB), the head's chunk
    # One H200 (or H100) after the 0.6B model's state: the 8 x 2048-token step in one micro-batch.
    assert micro_batch_for(bf16, QWEN3_06B, 108 * GB, 2048) == 16
    assert micro_batch_for(bf16, QWEN3_06B, 60 * GB, 2048) == 8
    assert micro_batch_for(bf16, QWEN3_06B, 20 * GB, 2048) == 2
    assert micro_batch_for(bf16, QWEN3_06B, 1 * GB, 2048) == 1  # never 0: the step runs or reports the OOM
    # Longer sequences get fewer rows; checkpointing keeps less, so more fit.
    assert micro_batch_for(bf16, QWEN3_06B, 20 * GB, 8192) == 1
    full = TrainConfig(device="cuda", dtype="bfloat16", activation_checkpointing="full")
    assert micro_batch_for(full, QWEN3_06B, 20 * GB, 8192) >= 4
    # Without the fused head the [tokens x vocab] logits, their fp32 softmax and gradient count too.
    plain = TrainConfig(device="cuda", dtype="bfloat16", logprob_chunk_tokens=None)
    assert activation_bytes(plain, QWEN3_06B, 8, 2048) > activation_bytes(bf16, QWEN3_06B, 8, 2048) + 150 * GB // 10
    line = auto_micro_batch_line(bf16, QWEN3_06B, 59 * GB)
    assert line == (
        "micro_batch_size auto (59.00 GB for activations): 16 up to 1024 tokens, 8 up to 2304, 4 up to 4608, "
        "2 up to 9472, 1 beyond"
    )


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
