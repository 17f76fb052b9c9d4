"""The Megatron backend on two GPUs over NCCL: Megatron's DDP + distributed optimizer against the local
optimizer and TP=1, TP=2 across the GPUs, checkpoint resume and resharding of the distributed state.

Skipped with fewer than two CUDA devices. On a 2-GPU machine (megatron-core >= 0.17 on Python 3.12):
    PYTHONPATH=/tmp/site:. python3 -m pytest tests/gpu/test_megatron_gpus.py -q -s
Every rank runs fp32 with TF32 off, so the comparisons can be tight.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.support import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
KEYS = ("loss", "grad_norm", "entropy", "kl", "pg_loss", "train_rollout_logprob_abs_diff")


def on_gpus(monkeypatch: pytest.MonkeyPatch, optimizer: str) -> None:
    monkeypatch.setenv("HPCRL_TEST_DEVICE", "cuda")
    monkeypatch.setenv("HPCRL_TEST_MEGATRON_OPTIMIZER", optimizer)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


@pytest.fixture(scope="module")
def single_gpu_local(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """The reference: TP=1 on one GPU with the local optimizer (torch AdamW, no master copy in fp32)."""
    mp = pytest.MonkeyPatch()
    on_gpus(mp, "local")
    out = tmp_path_factory.mktemp("ref")
    try:
        result = run_ranks("grpo", tiny_model_dir, out, 1, 1, 1)
    finally:
        mp.undo()
    return result, load_file(out / "weights.safetensors")


@pytest.mark.parametrize("tp,pp,world", [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)], ids=["tp1", "dp2", "tp2", "pp2"])
def test_distributed_optimizer_matches_tp1_local(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, single_gpu_local: tuple,
    tp: int, pp: int, world: int,
) -> None:  # fmt: skip
    ref, ref_weights = single_gpu_local
    on_gpus(monkeypatch, "distributed")
    result = run_ranks("grpo", tiny_model_dir, tmp_path, tp, pp, world)
    assert result["optimizer"] == "distributed"
    for step, (a, b) in enumerate(zip(ref["metrics"], result["metrics"], strict=True)):
        for key in KEYS:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=f"step {step} {key}")
    weights = load_file(tmp_path / "weights.safetensors")
    worst = max(float((weights[k] - ref_weights[k]).abs().max()) for k in ref_weights)
    print(f"TP={tp} PP={pp} ranks={world} distributed vs TP=1 local: max |dw| after 3 steps (lr 1e-2) = {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("tp,world", [(1, 2), (2, 2)], ids=["dp2", "tp2"])
def test_distributed_optimizer_checkpoint_resumes(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, world: int
) -> None:
    """Master weights, moments and the step count come back: the resumed trainer's next step is the
    original's."""
    on_gpus(monkeypatch, "distributed")
    result = run_ranks("resume", tiny_model_dir, tmp_path, tp, 1, world)
    assert result["optimizer"] == "distributed" and result["restored_equal"]
    for key in KEYS:
        np.testing.assert_allclose(result["next_resumed"][key], result["next"][key], rtol=1e-6, err_msg=key)
    print(f"TP={tp} ranks={world}: resumed step vs uninterrupted: max |dw| = {result['after_max_abs_diff']:.2e}")
    assert result["after_max_abs_diff"] < 1e-6


def test_distributed_checkpoint_moves_to_one_gpu(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TP=2 distributed-optimizer checkpoint resumes on one GPU: same weights, same next step."""
    on_gpus(monkeypatch, "auto")
    result = run_ranks("reshard", tiny_model_dir, tmp_path, 2, 1, 2)
    assert result["optimizer"] == result["single_optimizer"] == "distributed"
    assert result["restored_equal"]
    for key in ("loss", "grad_norm", "train_rollout_logprob_abs_diff"):
        np.testing.assert_allclose(result["next_single"][key], result["next_sharded"][key], rtol=1e-5, err_msg=key)


def test_bf16_distributed_checkpoint_keeps_fp32_masters(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_gpus(monkeypatch, "distributed")
    result = run_ranks("bf16", tiny_model_dir, tmp_path, 2, 1, 2)
    assert result["pushed"] == ["torch.bfloat16"]
    assert result["saved"]["model/model.layers.0.self_attn.q_proj.weight"] == "torch.bfloat16"
    masters = {k: v for k, v in result["saved_all"].items() if k.startswith("optimizer/main_params/")}
    assert masters and set(masters.values()) == {"torch.float32"}
