"""`hpcrl run` end to end on this machine: real engine processes, real HDF5, real checkpoints."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from hpcrl.store import load_events, load_metrics
from tests.support import (
    SMALL,
    assert_same_metrics,
    hpcrl,
    signal_at_step,
)


def test_run_writes_metrics_checkpoints_and_model(workdir: Path, small_run: tuple[Path, str]) -> None:
    run, stdout = small_run
    assert "step    6/6 | reward" in stdout and "ETA" in stdout
    m = load_metrics(run / "metrics.h5")
    assert list(m["step"]) == list(range(6))
    for key in (
        "train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/entropy", "train/grad_norm",
        "train/train_rollout_logprob_abs_diff", "train/train_rollout_kl", "rollout/reward_mean",
        "rollout/response_len_mean", "rollout/truncated_share", "rollout/zero_std_group_share",
        "rollout/tokens_per_s", "timing/rollout_s", "timing/reward_s", "timing/logprob_s", "timing/train_s",
        "timing/sync_s", "timing/checkpoint_s", "timing/total_s", "sync/bytes",
    ):  # fmt: skip
        assert key in m and np.isfinite(m[key]).all(), key
    # Engine and trainer share one model implementation; the decode-vs-forward gap is float noise.
    assert m["train/train_rollout_logprob_abs_diff"].max() < 1e-4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004.h5", "step_00000006.h5"]
    kinds = [e["kind"] for e in load_events(run / "metrics.h5")]
    assert kinds[0] == "sft_done" and kinds[-1] == "finished"
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run / "model")
    assert sum(p.numel() for p in exported.parameters()) > 0
    assert (run / "config.yaml").is_file() and (run / "logs" / "engine-0.log").is_file()
    shutil.copytree(run, workdir / "r", symlinks=True)
    again = hpcrl("run", "qs.yaml", *SMALL, "--run-dir", "r", cwd=workdir)
    assert "already finished" in again.stdout


def test_sigkill_and_rerun_equals_an_uninterrupted_run(workdir: Path, small_run: tuple[Path, str]) -> None:
    full = small_run[0]
    kill_after = random.Random().randint(1, 4)
    print(f"killing after checkpoint-free progress past step {kill_after}")
    proc = signal_at_step(workdir, SMALL, "cut", kill_after + 1, signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    out = hpcrl("run", "qs.yaml", *SMALL, "--run-dir", "cut", cwd=workdir)
    if kill_after >= 1:
        assert "resumed from" in out.stdout
    assert_same_metrics(load_metrics(full / "metrics.h5"), load_metrics(workdir / "cut" / "metrics.h5"))
    a, b = (
        load_file(full / "model" / "model.safetensors"),
        load_file(workdir / "cut" / "model" / "model.safetensors"),
    )
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # The killed run's engine noticed its parent was gone and exited.
    time.sleep(2.5)
    ps = subprocess.run(["pgrep", "-f", f"--run-dir cut|{workdir}/cut"], capture_output=True, text=True)
    assert ps.stdout.strip() == ""


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(workdir: Path, small_run: tuple[Path, str]) -> None:
    shutil.copytree(small_run[0], workdir / "r", symlinks=True)
    first = load_metrics(workdir / "r" / "metrics.h5")
    latest = workdir / "r" / "checkpoints" / "step_00000006.h5"
    data = bytearray(latest.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    latest.write_bytes(bytes(data))
    out = hpcrl("run", "qs.yaml", *[*SMALL[1:], "num_steps=7"], "--run-dir", "r", cwd=workdir)
    assert "warning" in out.stdout and "step_00000006.h5" in out.stdout
    assert "resumed from" in out.stdout and "step_00000004.h5" in out.stdout
    second = load_metrics(workdir / "r" / "metrics.h5")
    assert list(second["step"]) == list(range(7))
    assert_same_metrics(first, {k: v[:6] for k, v in second.items()})
    assert "checkpoint_skipped" in [e["kind"] for e in load_events(workdir / "r" / "metrics.h5")]


def test_invariant_logprobs_make_the_logprob_gap_exactly_zero(workdir: Path) -> None:
    # 16 samples on an engine of 5 slots: batches of 5, shrinking and refilled as rows finish; the trainer
    # scores them in micro-batches of 3. The gap is the trainer's log-prob vs the one the engine sampled from.
    out = hpcrl(
        "run", "qs.yaml", *SMALL, "num_steps=3", "engine.batch_invariant=true", "train.logprobs=invariant",
        "engine.max_running_requests=5", "engine.deterministic=false", "train.micro_batch_size=3",
        "--run-dir", "r", cwd=workdir,
    )  # fmt: skip
    m = load_metrics(workdir / "r" / "metrics.h5")
    assert len(m["train/train_rollout_logprob_abs_diff"]) == 3
    assert (m["train/train_rollout_logprob_abs_diff"] == 0.0).all()
    assert (m["train/train_rollout_logprob_max_abs_diff"] == 0.0).all()
    assert (m["train/train_rollout_kl"] == 0.0).all()
    assert "gap 0.00e+00" in out.stdout


def test_two_trainer_ranks_match_one(workdir: Path) -> None:
    common = [*SMALL, "num_steps=2", "sft.num_steps=0"]
    hpcrl("run", "qs.yaml", *common, "--run-dir", "one", cwd=workdir)
    hpcrl("run", "qs.yaml", *common, "train.num_ranks=2", "--run-dir", "two", cwd=workdir)
    one, two = load_metrics(workdir / "one" / "metrics.h5"), load_metrics(workdir / "two" / "metrics.h5")
    # Step 0 sees the same rollout; DDP over gloo reproduces the single-rank loss and gradient norm.
    np.testing.assert_allclose(two["train/loss"][0], one["train/loss"][0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(two["train/grad_norm"][0], one["train/grad_norm"][0], rtol=1e-4)
    assert (workdir / "two" / "logs" / "trainer-rank1.log").is_file()


def test_sft_alone_exports_a_model(workdir: Path) -> None:
    out = hpcrl(
        "run", "qs.yaml", "num_steps=0", "sft.num_steps=10", "sft.log_every_steps=5", "--run-dir", "s", cwd=workdir
    )
    assert "sft   10/10" in out.stdout
    assert (workdir / "s" / "model" / "model.safetensors").is_file()


# ----- bad input: a clear message, a non-zero exit, nothing half-written -----


def test_unknown_key_and_bad_type(workdir: Path) -> None:
    out = hpcrl("run", "qs.yaml", "train.lrr=1", cwd=workdir, check=False)
    assert out.returncode == 2 and "train.lrr" in out.stderr and "lr" in out.stderr
    out = hpcrl("run", "qs.yaml", "train.lr=abc", cwd=workdir, check=False)
    assert out.returncode == 2 and "train.lr" in out.stderr and "float" in out.stderr
    assert not (workdir / "runs").exists()


def test_malformed_yaml(workdir: Path) -> None:
    (workdir / "bad.yaml").write_text("name: x\ntrain:\n  lr: 1\n   micro_batch_size: 2\n")
    out = hpcrl("run", "bad.yaml", cwd=workdir, check=False)
    assert out.returncode == 2 and "bad.yaml" in out.stderr and "line" in out.stderr


def test_missing_model_dir(workdir: Path) -> None:
    (workdir / "m.yaml").write_text("model:\n  path: nowhere\n")
    out = hpcrl("run", "m.yaml", "--run-dir", "r", cwd=workdir, check=False)
    assert out.returncode != 0 and "nowhere" in out.stderr and "init_tiny" in out.stderr
    assert not (workdir / "r").exists()


def test_empty_dataset_and_rows_without_fields(workdir: Path) -> None:
    (workdir / "empty.jsonl").write_text("")
    out = hpcrl("run", "qs.yaml", "data.source=empty.jsonl", "--run-dir", "r", cwd=workdir, check=False)
    assert out.returncode == 2 and "empty.jsonl" in out.stderr
    (workdir / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    out = hpcrl("run", "qs.yaml", "data.source=rows.jsonl", "--run-dir", "r", cwd=workdir, check=False)
    assert out.returncode == 2 and "rows.jsonl:2" in out.stderr and "prompt" in out.stderr
    assert not (workdir / "r").exists()


def test_reward_returning_a_non_number_stops_the_run(workdir: Path) -> None:
    (workdir / "myreward.py").write_text("def bad(response, answer):\n    return 'yes'\n")
    out = hpcrl(
        "run", "qs.yaml", *SMALL, "sft.num_steps=0", "reward.fn=myreward:bad", "--run-dir", "r",
        cwd=workdir, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and "str" in out.stderr and "reward" in out.stderr


def test_nan_loss_steps_are_skipped_then_the_run_stops(workdir: Path) -> None:
    # Rewards of +-1e308 are finite, but their group statistics overflow: advantages, then the loss, are NaN.
    (workdir / "huge.py").write_text("def huge(response, answer):\n    return 1e308 if len(response) % 2 else -1e308\n")
    out = hpcrl(
        "run", "qs.yaml", *SMALL, "sft.num_steps=0", "reward.fn=huge:huge", "train.max_nan_steps=2",
        "--run-dir", "r", cwd=workdir, check=False,
    )  # fmt: skip
    assert out.returncode == 1 and "non-finite" in out.stderr, out.stdout + out.stderr
    kinds = [e["kind"] for e in load_events(workdir / "r" / "metrics.h5")]
    assert kinds.count("nan_skipped") == 1
    m = load_metrics(workdir / "r" / "metrics.h5")
    assert m["train/nan_skipped"].tolist() == [1.0]


def test_colocated_offload_frees_engine_memory_and_changes_nothing(workdir: Path) -> None:
    common = [*SMALL, "num_steps=3", "sft.num_steps=5"]
    hpcrl("run", "qs.yaml", *common, "--run-dir", "plain", cwd=workdir)
    hpcrl("run", "qs.yaml", *common, "engine.offload_during_train=true", "--run-dir", "off", cwd=workdir)
    plain, off = load_metrics(workdir / "plain" / "metrics.h5"), load_metrics(workdir / "off" / "metrics.h5")
    assert (off["fleet/released_bytes"] > 0).all()
    # The push restores every released weight exactly: the runs are the same step for step.
    for key in ("rollout/reward_mean", "train/loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff"):
        np.testing.assert_array_equal(plain[key], off[key], err_msg=key)


def test_sigterm_checkpoints_records_preempted_and_the_rerun_resumes(workdir: Path) -> None:
    proc = signal_at_step(workdir, SMALL, "r", 2, signal.SIGTERM)
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, rest
    assert "received SIGTERM: checkpointed step" in rest
    events = load_events(workdir / "r" / "metrics.h5")
    assert [e["kind"] for e in events].count("preempted") == 1
    out = hpcrl("run", "qs.yaml", *SMALL, "--run-dir", "r", cwd=workdir)
    assert "resumed from" in out.stdout and "step    6/6" in out.stdout
    assert list(load_metrics(workdir / "r" / "metrics.h5")["step"]) == list(range(6))
