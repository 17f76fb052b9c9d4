"""The run directory's state: every stateful part of a run saved and loaded together, through one protocol.

A part is registered once under a name (`state.register("data", ...)`); a checkpoint then holds each part's
JSON under that name and its tensors under their own keys, plus the step's metrics row (logged only after the
save: a resume re-logs it if the process died in between). Adding a part is one `register` line.

Parts of a synchronous run: `trainer` (model, optimizer; the other ranks load their own copy), `rng` (python,
numpy, torch, CUDA generators), `data` (the prompt cursor), `weights` (the version the engines serve),
`warm_start` (whether SFT is done).

`save` blocks the loop only while the parts hand over their state (the trainer's device-to-host copy); a
background thread writes the file. The next `save`, `wait`, `resume` and `close` wait for that write and
raise its error, if it had one; a write that fails leaves the previous checkpoint in place, and one cut
short by a kill leaves only a temporary file that the next `resume` removes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from hpcrl.store.checkpoint import CheckpointError, list_checkpoints, remove_temp_files, save_checkpoint
from hpcrl.store.metrics import MetricsWriter
from hpcrl.store.run_dir import ResumePoint, keep_unreadable
from hpcrl.store.state_tree import capture_rng_state, restore_rng_state

ROW_KEY = "last_row"


class Stateful(Protocol):
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Tensors (their keys unique across parts) and JSON; no pickle anywhere in a checkpoint.

        The tensors must be copies the part never changes afterwards (a live parameter is not): the file is
        written from them in the background while the loop goes on.
        """
        ...

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any], *, step: int) -> None:
        """`tensors` holds every part's tensors; `step` is the checkpoint's (a part may read more of it)."""
        ...


class RngState:
    """The process's random generators (python, numpy, torch CPU and CUDA)."""

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return capture_rng_state()

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any], *, step: int) -> None:
        restore_rng_state({k: v for k, v in tensors.items() if k.startswith("rng/")}, state)


class JsonState:
    """A part whose whole state is JSON, read and restored through two functions."""

    def __init__(self, get: Callable[[], dict[str, Any]], put: Callable[[dict[str, Any]], None]) -> None:
        self.get, self.put = get, put

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, self.get()

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any], *, step: int) -> None:
        self.put(state)


class StateError(RuntimeError):
    """The run's state cannot be saved or loaded; the message says why and what to do."""


class RunState:
    def __init__(
        self,
        run_dir: Path,
        store: MetricsWriter,
        *,
        every_steps: int,
        keep_last: int,
        num_steps: int,
        say: Callable[[str], None],
        check_weights: Callable[[list[tuple[str, torch.Tensor]], str], None],
    ) -> None:
        self.ckpt_dir = run_dir / "checkpoints"
        self.store = store
        self.every_steps, self.keep_last, self.num_steps = every_steps, keep_last, num_steps
        self.say = say
        self.check_weights = check_weights  # NaN/inf weights must never reach a checkpoint
        self.parts: dict[str, Stateful] = {}
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None

    def register(self, name: str, part: Stateful) -> None:
        assert name not in self.parts and name != ROW_KEY, f"state part {name!r} registered twice"
        self.parts[name] = part

    def due(self, step: int) -> bool:
        return (step + 1) % self.every_steps == 0 or step + 1 == self.num_steps

    def save(self, step: int, row: dict[str, float]) -> None:
        """Start writing a checkpoint of every part at `step`, with the step's metrics row; returns once the
        parts have handed over their state. Raises the previous write's error, if it failed."""
        self.wait()
        self.store.flush()
        tensors: dict[str, torch.Tensor] = {}
        state: dict[str, Any] = {}
        for name, part in self.parts.items():
            part_tensors, state[name] = part.state_dict()
            clash = tensors.keys() & part_tensors.keys()
            assert not clash, f"state part {name!r} reuses tensor keys {sorted(clash)[:3]}"
            tensors.update(part_tensors)
        self.check_weights([(k, v) for k, v in tensors.items() if k.startswith("model/")], f"step {step + 1} weights")
        keys = sorted(row)
        tensors[ROW_KEY] = torch.tensor([row[k] for k in keys], dtype=torch.float64)
        state["last_row_keys"] = keys
        self._writer = threading.Thread(
            target=self._write, args=(step, tensors, state), name=f"hpcrl-checkpoint-{step}"
        )
        self._writer.start()
        if not list_checkpoints(self.ckpt_dir):
            # The first checkpoint is waited for: a kill before it lands would leave metric rows with no
            # checkpoint, a run dir that refuses to resume. Later ones fall back to the previous checkpoint.
            self.wait()

    def _write(self, step: int, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        try:
            save_checkpoint(self.ckpt_dir, step, tensors, state, keep_last=self.keep_last)
        except BaseException as exc:  # noqa: BLE001 - raised in the loop's thread by wait()
            self._write_error = exc

    def wait(self) -> None:
        """Wait for the checkpoint being written, if any; raise StateError if its write failed."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        error, self._write_error = self._write_error, None
        if isinstance(error, CheckpointError):
            raise StateError(str(error)) from None
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the last checkpoint: the process must not exit, nor release the run dir, before it is on disk."""
        self.wait()

    def resume(self, point: ResumePoint) -> int | None:
        """Load every part from the checkpoint found before the run started; returns its step (None: none)."""
        self.wait()
        for path in remove_temp_files(self.ckpt_dir) if self.ckpt_dir.exists() else []:
            self.say(f"removed a partial checkpoint left by an interrupted write: {path.name}")
        kept = keep_unreadable(self.ckpt_dir, list(point.unreadable))
        for name, reason in point.unreadable.items():
            kept_as = kept[name].name if name in kept else name
            self.say(f"warning: skipping checkpoint {name}: {reason}; kept as {kept_as}")
            self.store.event("checkpoint_skipped", step=None, detail={"reason": reason, "kept_as": kept_as})
        ckpt = point.checkpoint
        if ckpt is None:
            self.store.truncate_after(-1)
            return None
        missing = [name for name in self.parts if name not in ckpt.state]
        if missing:
            raise StateError(
                f"{ckpt.path} lacks the state of {', '.join(missing)}: it was written by another version of hpcrl; "
                "resume with that version, or start a new run with --run-dir"
            )
        for name, part in self.parts.items():
            part.load_state_dict(ckpt.tensors, ckpt.state[name], step=ckpt.step)
        self.store.truncate_after(ckpt.step)
        if self.store.last_step != ckpt.step:
            row = dict(zip(ckpt.state["last_row_keys"], ckpt.tensors[ROW_KEY].tolist(), strict=True))
            self.store.log(ckpt.step, row)
        if ckpt.step + 1 < self.num_steps:
            # The steps after this resume make the run's end; an earlier `finished` no longer is.
            self.store.rename_events("finished", "finished_superseded")
        self.store.event("resumed", step=ckpt.step, detail={"checkpoint": ckpt.path.name})
        self.say(f"resumed from {ckpt.path} (step {ckpt.step + 1} done); continuing at step {ckpt.step + 2}")
        return ckpt.step
