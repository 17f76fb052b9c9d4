"""RunState writes checkpoints in the background: the loop waits only for the state hand-over, a failed write
surfaces on the next call, and neither a failure nor a kill mid-write loses the previous checkpoint."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch

import hpcrl.store.run_state as run_state_module
from hpcrl.store.checkpoint import checkpoint_path, list_checkpoints, load_checkpoint
from hpcrl.store.metrics import MetricsWriter
from hpcrl.store.run_dir import find_resume_point
from hpcrl.store.run_state import JsonState, RunState, StateError


class Weights:
    """A part with one tensor, handed over as a copy (the Stateful contract)."""

    def __init__(self) -> None:
        self.w = torch.zeros(1000)
        self.loaded: torch.Tensor | None = None

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"model/w": self.w.clone()}, {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any], *, step: int) -> None:
        self.loaded = tensors["model/w"]


def make_state(run_dir: Path, store: MetricsWriter, said: list[str]) -> tuple[RunState, Weights]:
    state = RunState(
        run_dir, store, every_steps=1, keep_last=2, num_steps=10, say=said.append, check_weights=lambda *_: None
    )
    weights = Weights()
    state.register("trainer", weights)
    cursor = {"cursor": 0}
    state.register("data", JsonState(lambda: dict(cursor), cursor.update))
    return state, weights


def gated_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds every checkpoint write at its start until the returned event is set."""
    gate = threading.Event()
    real = run_state_module.save_checkpoint

    def held(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(timeout=60), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(run_state_module, "save_checkpoint", held)
    return gate


def test_save_returns_before_the_write_and_the_next_call_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = gated_writes(monkeypatch)
    with MetricsWriter(tmp_path / "metrics.h5") as store:
        state, weights = make_state(tmp_path, store, [])
        gate.set()
        state.save(0, {"train/loss": 0.6})  # the first checkpoint of a run is waited for (rows need one)
        assert list_checkpoints(tmp_path / "checkpoints") == [checkpoint_path(tmp_path / "checkpoints", 0)]
        gate.clear()
        weights.w += 1
        state.save(1, {"train/loss": 0.5})  # returns while the write is held
        weights.w += 1  # the loop goes on changing its tensors; the checkpoint keeps the values of step 1
        closer = threading.Thread(target=state.close)
        closer.start()
        assert closer.is_alive() and len(list_checkpoints(tmp_path / "checkpoints")) == 1  # close waits
        gate.set()
        closer.join()
    ckpt = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 1))
    assert torch.equal(ckpt.tensors["model/w"], torch.ones(1000))
    assert ckpt.state["last_row_keys"] == ["train/loss"] and ckpt.tensors["last_row"].tolist() == [0.5]


def test_a_failed_background_write_surfaces_on_the_next_call_and_keeps_the_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    with MetricsWriter(tmp_path / "metrics.h5") as store:
        state, weights = make_state(tmp_path, store, [])
        state.save(0, {"train/loss": 0.5})
        state.wait()

        def disk_full(*args: Any) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwritev", disk_full)
        weights.w += 1
        state.save(1, {"train/loss": 0.4})  # fails in the background
        with pytest.raises(StateError, match=r"could not write checkpoint .*step_00000002.h5 \(No space left"):
            state.save(2, {"train/loss": 0.3})
        state.save(3, {"train/loss": 0.2})
        with pytest.raises(StateError, match=r"step_00000004.h5 \(No space left on device\).*free space and rerun"):
            state.close()
        monkeypatch.undo()
    assert [p.name for p in ckpt_dir.iterdir()] == ["step_00000001.h5"]  # no temporary file either
    assert torch.equal(load_checkpoint(ckpt_dir / "step_00000001.h5").tensors["model/w"], torch.zeros(1000))


def test_a_corrupt_newest_checkpoint_is_kept_aside_and_the_previous_resumed(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    with MetricsWriter(tmp_path / "metrics.h5") as store:
        state, weights = make_state(tmp_path, store, [])
        for step in (0, 1):
            weights.w += 1
            state.save(step, {"train/loss": 1.0 - step})
        state.close()
    newest = ckpt_dir / "step_00000002.h5"
    with h5py.File(newest, "r") as f:
        w_offset = f["blob"].id.get_offset()  # model/w is the first tensor of the blob
    data = bytearray(newest.read_bytes())
    data[w_offset + 100] ^= 0xFF
    newest.write_bytes(bytes(data))
    said: list[str] = []
    with MetricsWriter(tmp_path / "metrics.h5") as store:
        state, weights = make_state(tmp_path, store, said)
        assert state.resume(find_resume_point(ckpt_dir)) == 0
    assert weights.loaded is not None and torch.equal(weights.loaded, torch.ones(1000))
    assert "skipping checkpoint step_00000002.h5: tensor 'model/w'" in said[0] and "fails its checksum" in said[0]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_00000001.h5", "step_00000002.h5.unreadable"]


def test_a_process_killed_during_a_background_write_loses_nothing(tmp_path: Path) -> None:
    # A run preempted past its grace time: SIGKILL lands while the step-1 checkpoint is being written.
    script = textwrap.dedent(
        f"""
        import os, sys, threading
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import hpcrl.store.checkpoint as checkpoint
        from hpcrl.store.metrics import MetricsWriter
        from test_run_state import make_state

        real_pwritev = os.pwritev
        def pwritev(fd, views, offset):
            if threading.current_thread().name == "hpcrl-checkpoint-1":
                print("writing", flush=True)
                threading.Event().wait()  # until killed
            return real_pwritev(fd, views, offset)
        os.pwritev = pwritev
        store = MetricsWriter(Path({str(tmp_path)!r}) / "metrics.h5")
        state, weights = make_state(Path({str(tmp_path)!r}), store, [])
        state.save(0, {{"train/loss": 0.5}})
        weights.w += 1
        state.save(1, {{"train/loss": 0.4}})
        state.close()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    ckpt_dir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [".step_00000002.h5.tmp", "step_00000001.h5"]
    said: list[str] = []
    with (
        pytest.warns(RuntimeWarning, match="not closed by its last writer"),
        MetricsWriter(tmp_path / "metrics.h5") as store,
    ):
        state, weights = make_state(tmp_path, store, said)
        assert state.resume(find_resume_point(ckpt_dir)) == 0
    assert said[0] == "removed a partial checkpoint left by an interrupted write: .step_00000002.h5.tmp"
    assert weights.loaded is not None and torch.equal(weights.loaded, torch.zeros(1000))
    assert [p.name for p in ckpt_dir.iterdir()] == ["step_00000001.h5"]


def test_the_torch_trainer_hands_over_copies_that_training_does_not_change(tiny_model_dir: Path) -> None:
    from hpcrl.trainer.config import TrainConfig
    from hpcrl.trainer.torch_backend import TorchTrainer

    trainer = TorchTrainer(TrainConfig(), tiny_model_dir, rank=0, world_size=1, sft_lr=1e-3)
    tensors, _ = trainer.state()
    before = {name: tensor.clone() for name, tensor in tensors.items()}
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(1.0)  # what an optimizer step does to the live weights while the write goes on
    assert all(torch.equal(tensors[name], tensor) for name, tensor in before.items())
    assert any(name.startswith("model/") for name in tensors)
