"""train.parallelism: fsdp2 against DDP: the same gradients, steps and checkpoints on real gloo ranks.

The FSDP2 ranks are processes (tests/unit/fsdp_ranks.py); DDP on one rank runs in this process and is the
reference: gradients of one update on the fixed batch (per activation checkpointing mode), the weights after three
GRPO steps, and checkpoints that move between rank counts and parallelisms (2 -> 1, 1 -> 2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.model.qwen3 import ModelArgs
from hpcrl.store.checkpoint import checkpoint_file, load_checkpoint, save_checkpoint
from hpcrl.store.metrics import load_metrics
from hpcrl.trainer.config import FSDPConfig, TrainConfig
from hpcrl.trainer.memory_plan import fit_problem_on, plan_memory
from hpcrl.trainer.torch_backend import TorchTrainer
from hpcrl.weightwire.finite import first_non_finite
from tests.support import SMALL, assert_same_metrics, final_weights, free_port, hpcrl, signal_at_step
from tests.unit.fsdp_ranks import config, fixed_batch, gradients, pushed

REPO = Path(__file__).resolve().parents[2]
FP32 = {"rtol": 1e-4, "atol": 1e-6}
# Weights after AdamW steps: a step divides by the root of the squared-gradient average, which magnifies the
# rounding of gradients near 0 (to ~3e-6 here) into the weights.
STEPS = {"rtol": 1e-4, "atol": 2e-5}


def launch(
    model_dir: Path, out: Path, world: int, *extra: str, script: str = "fsdp_ranks.py"
) -> list[subprocess.Popen[str]]:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    path = str(REPO / "tests" / "unit" / script)
    return [
        subprocess.Popen(
            [sys.executable, path, str(model_dir), str(out), *extra],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in range(world)
    ]


def wait(procs: list[subprocess.Popen[str]]) -> None:
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-3000:]}"


def assert_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, tolerance: dict[str, float] = FP32
) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tolerance, msg=lambda m, n=name: f"{what} {n}: {m}")


def test_fsdp2_matches_ddp_and_checkpoints_move_between_rank_counts(tiny_model_dir: Path, tmp_path: Path) -> None:
    one = launch(tiny_model_dir, tmp_path / "one", 1, "grads")
    # The DDP reference, on one rank: gradients per activation checkpointing mode, a checkpoint after two steps
    # (which the two FSDP2 ranks resume), the weights after a third.
    ddp_grads, ddp_metrics = {}, {}
    for ac in ("none", "full", "selective"):
        trainer = TorchTrainer(config("ddp", 1, activation_checkpointing=ac), tiny_model_dir)
        batch = fixed_batch(trainer.model.args.vocab_size)
        ddp_grads[ac], ddp_metrics[ac] = gradients(trainer, batch)
    ddp = TorchTrainer(config("ddp", 1), tiny_model_dir)
    ddp.train_grpo(batch)
    ddp.train_grpo(batch)
    tensors, state = ddp.state()
    save_checkpoint(tmp_path / "two" / "ddp_ckpt", 1, tensors, {"trainer": state})
    ddp.train_grpo(batch)
    ddp_step3 = pushed(ddp)
    two = launch(tiny_model_dir, tmp_path / "two", 2)
    # Activation checkpointing recomputes the same forward: the same gradients (DDP here, FSDP2 below).
    for ac in ("full", "selective"):
        assert_close(ddp_grads[ac], ddp_grads["none"], f"ddp activation_checkpointing={ac}")
    wait(one)
    wait(two)

    for out, modes in ((tmp_path / "one", ("none",)), (tmp_path / "two", ("none", "full", "selective"))):
        for ac in modes:
            metrics = json.loads((out / f"metrics_{ac}.json").read_text())
            for key in ("loss", "grad_norm", "pg_loss", "entropy", "kl"):
                assert metrics[key] == pytest.approx(ddp_metrics["none"][key], rel=1e-5, abs=1e-7), (out.name, ac, key)
            assert_close(load_file(out / f"grads_{ac}.safetensors"), ddp_grads["none"], f"fsdp2 {out.name} {ac}")
    two_dir = tmp_path / "two"
    assert_close(load_file(two_dir / "grads_hybrid.safetensors"), ddp_grads["none"], "fsdp2 x2 hybrid")
    step3 = load_file(two_dir / "step3.safetensors")
    assert_close(step3, ddp_step3, "fsdp2 x2 after three steps", STEPS)
    # The same rank count resumes bitwise; a DDP checkpoint of one rank resumes on two FSDP2 ranks (1 -> 2).
    resumed = load_file(two_dir / "resumed.safetensors")
    assert all(torch.equal(resumed[n], step3[n]) for n in step3)
    assert_close(load_file(two_dir / "from_ddp.safetensors"), ddp_step3, "1 -> 2 ranks", STEPS)
    # ... and the two ranks' checkpoint resumes on one DDP rank (2 -> 1).
    single = TorchTrainer(config("ddp", 1), tiny_model_dir)
    ckpt = load_checkpoint(checkpoint_file(two_dir / "ckpt", 1))
    single.load_state(ckpt.tensors, ckpt.state["trainer"])
    single.train_grpo(batch)
    assert_close(pushed(single), ddp_step3, "2 -> 1 ranks", STEPS)


def test_the_finite_check_keeps_no_tensor_and_finds_the_first_bad_one() -> None:
    big = torch.full((4,), 3e38)  # finite, but its float32 sum overflows: the exact test clears it
    named = [("a", torch.ones(2)), ("big", big), ("ids", torch.arange(3)), ("nan", torch.tensor([1.0, float("nan")]))]
    assert first_non_finite(named) == "nan"
    assert first_non_finite(named[:3]) is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(backend="megatron", parallelism="fsdp2"), r"parallelism: fsdp2 is not implemented by backend: megatron"),
        (dict(parallelism="fsdp2", num_ranks=4, fsdp=FSDPConfig(shard_group_size=3)), r"must divide num_ranks \(4\)"),
        (dict(parallelism="fsdp2", fsdp=FSDPConfig(offload=True)), r"device is 'cpu'.*fsdp.offload: false"),
        (dict(fsdp=FSDPConfig(reduce_dtype="bfloat16")), r"set parallelism: fsdp2, or remove the fsdp settings"),
        (dict(parallelism="fsdp2", logprobs="invariant"), r"use parallelism: ddp with logprobs: invariant"),
        (dict(activation_checkpointing="full", logprobs="invariant"), r"set activation_checkpointing: none"),
    ],
)
def test_bad_fsdp_settings_are_refused_with_the_fix(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)


# Qwen3-8B's shape: 8.19B parameters, 16 bytes each in fp32 under DDP.
QWEN3_8B = ModelArgs(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
    head_dim=128, tie_word_embeddings=False,
)  # fmt: skip


def test_the_memory_plan_divides_the_state_by_the_shards_and_refuses_what_cannot_fit() -> None:
    ddp, fsdp = TrainConfig(device="cuda"), TrainConfig(device="cuda", parallelism="fsdp2", num_ranks=8)
    whole, sharded = plan_memory(ddp, QWEN3_8B), plan_memory(fsdp, QWEN3_8B)
    assert whole.parameters == sharded.parameters == 8_190_735_360
    assert whole.state_bytes == 16 * whole.parameters
    assert sharded.state_bytes == whole.state_bytes // 8
    card, host = 80 * 10**9, 100 * 10**9
    problem = fit_problem_on(whole, ddp, gpu_bytes=card, host_bytes=host)
    assert problem is not None and "131.05 GB per GPU" in problem and "train.parallelism: fsdp2" in problem
    assert fit_problem_on(sharded, fsdp, gpu_bytes=card, host_bytes=host) is None
    offload = TrainConfig(device="cuda", parallelism="fsdp2", num_ranks=1, fsdp=FSDPConfig(offload=True))
    plan = plan_memory(offload, QWEN3_8B)
    assert plan.device_bytes < 10**9  # two gathered layers in bf16
    problem = fit_problem_on(plan, offload, gpu_bytes=card, host_bytes=host)
    assert problem is not None and "100.00 GB is available" in problem and "more ranks" in problem


def test_two_fsdp2_ranks_resume_after_sigterm_bitwise(workdir: Path) -> None:
    # Resumes on another rank count (2 -> 4 -> 1): tests/unit/test_fsdp_checkpoints.py.
    two = [*SMALL[1:], "sft.num_steps=0", "checkpoint.every_steps=1", "train.parallelism=fsdp2", "num_steps=2"]
    two.append("train.num_ranks=2")
    hpcrl("run", "qs.yaml", *two, "--run-dir", "full", cwd=workdir)
    assert (workdir / "full" / "logs" / "trainer-rank1.log").is_file()
    proc = signal_at_step(workdir, two, "cut", 1, signal.SIGTERM)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, rest
    assert "received SIGTERM: checkpointed step" in rest
    out = hpcrl("run", "qs.yaml", *two, "--run-dir", "cut", cwd=workdir)
    assert "resumed from" in out.stdout and "step    2/2" in out.stdout
    # Each rank wrote its shard file into the checkpoint.
    assert [p.name for p in sorted((workdir / "cut" / "checkpoints").glob("step_00000002.shards/*"))] == [
        "rank-00000-of-00002.h5",
        "rank-00001-of-00002.h5",
    ]
    # The same rank count: the resumed run is the unbroken one, bit for bit.
    assert_same_metrics(load_metrics(workdir / "full" / "metrics.h5"), load_metrics(workdir / "cut" / "metrics.h5"))
    a, b = final_weights(workdir / "full"), final_weights(workdir / "cut")
    assert sorted(a) == sorted(b) and all(torch.equal(a[name], b[name]) for name in a)
