"""Checkpoint write and read time against ``torch.save`` / ``torch.load`` of the same tensors.

    python tools/bench/checkpoint_speed.py [--repeats 3] [--dir DIR] [--scale 1.0]

The tensors are a transformer's training state in fp32, ~0.43 GB at ``--scale 1``: weights, Adam's two
moments (embedding 8192 x 512 and 10 layers of QKV, output, gate/up and down projections and two norms;
183 tensors), plus the RNG and metrics-row tensors a run adds. Every round writes and reads with both
sides into one temporary directory under ``--dir`` (default: the current one, so both hit the same disk),
alternating within the round so that load from other processes hits them alike; the figures are medians
of ``--repeats`` rounds. Reads come from the disk for both sides, as on a resume: after its timed write,
each file is dropped from the page cache (hpcrl writes its tensor bytes around the cache with O_DIRECT, so a
read from the cache would have favoured torch).

- ``write``: ``save_checkpoint`` (temporary name, checksums, fsync, rename) against ``torch.save``, and
  against ``torch.save`` followed by an fsync of its file (``+fsync``: the same durability).
- ``read``: ``load_checkpoint`` (every checksum verified) against ``torch.load(weights_only=True)``.
- ``blocked``: how long ``RunState.save`` keeps the training loop waiting (the snapshot copy of every
  tensor; the file is written by its background thread), against a plain copy of the same tensors.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hpcrl.store.checkpoint import load_checkpoint, save_checkpoint
from hpcrl.store.metrics import MetricsWriter
from hpcrl.store.run_state import RunState


def training_state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Weights and Adam moments of a small transformer, fp32, seeded."""
    hidden, vocab, layers = 512, int(8192 * scale), max(1, round(10 * scale))
    shapes = {"embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "qkv.weight": (3 * hidden, hidden),
            p + "o_proj.weight": (hidden, hidden),
            p + "gate_up.weight": (4 * hidden, hidden),
            p + "down_proj.weight": (hidden, 4 * hidden),
            p + "input_norm.weight": (hidden,),
            p + "post_norm.weight": (hidden,),
        }
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for prefix in ("model/", "optimizer/exp_avg/", "optimizer/exp_avg_sq/"):
        for name, shape in shapes.items():
            tensors[prefix + name] = torch.randn(shape, generator=gen)
    tensors["rng/torch_cpu"] = torch.get_rng_state()
    tensors["last_row"] = torch.arange(40, dtype=torch.float64)
    return tensors


def drop_from_page_cache(path: Path) -> None:
    """Evicts a file's pages (clean after its fsync) from the page cache, so that it is read from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def blocked_by_run_state(tensors: dict[str, torch.Tensor], work: Path, step: int) -> tuple[float, float]:
    """Seconds RunState.save keeps the loop waiting, and seconds of one plain copy of the same tensors."""
    part = CopyingPart(tensors)
    work.mkdir(exist_ok=True)
    with MetricsWriter(work / "metrics.h5") as store:
        state = RunState(work, store, every_steps=1, keep_last=2, num_steps=step + 1, say=print,
                         check_weights=lambda *_: None)  # fmt: skip
        state.register("trainer", part)
        start = time.perf_counter()
        state.save(step, {"train/loss": 0.5})
        blocked_s = time.perf_counter() - start
        getattr(state, "close", lambda: None)()  # RunState before the background writer had none
    start = time.perf_counter()
    part.state_dict()
    return blocked_s, time.perf_counter() - start


class CopyingPart:
    """Hands over copies, as a trainer on the CPU does (its device-to-host copy)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {k: v.clone() for k, v in self.tensors.items()}, {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any], *, step: int) -> None:
        raise NotImplementedError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="where the temporary files go (one disk)")
    parser.add_argument("--scale", type=float, default=1.0, help="size factor of the state (1: ~0.43 GB)")
    args = parser.parse_args()
    tensors = training_state(args.scale)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    state = {"step": 7, "data": {"cursor": 123}}
    print(f"{len(tensors)} tensors, {nbytes / 1e9:.3f} GB fp32; {args.repeats} rounds in {args.dir}")
    times: dict[str, list[float]] = {
        k: [] for k in ("torch.save", "+fsync", "save", "torch.load", "load", "blocked", "copy")
    }
    work = Path(tempfile.mkdtemp(prefix="hpcrl-ckpt-bench-", dir=args.dir))
    try:
        for round_index in range(args.repeats):
            torch_path = work / "torch.pt"
            torch_path.unlink(missing_ok=True)
            order = ("torch", "hpcrl") if round_index % 2 == 0 else ("hpcrl", "torch")
            for side in order:
                start = time.perf_counter()
                if side == "torch":
                    torch.save(tensors, torch_path)
                    times["torch.save"].append(time.perf_counter() - start)
                    fd = os.open(torch_path, os.O_RDONLY)
                    os.fsync(fd)  # what torch.save skips and a checkpoint must not: the data on disk
                    times["+fsync"].append(time.perf_counter() - start)
                    os.close(fd)
                    drop_from_page_cache(torch_path)
                else:
                    path = save_checkpoint(work / "checkpoints", round_index, tensors, state)
                    times["save"].append(time.perf_counter() - start)
                    drop_from_page_cache(path)
            for side in order:
                start = time.perf_counter()
                if side == "torch":
                    loaded = torch.load(torch_path, weights_only=True)
                else:
                    loaded = load_checkpoint(path).tensors
                times["torch.load" if side == "torch" else "load"].append(time.perf_counter() - start)
                assert all(torch.equal(loaded[k], v) for k, v in tensors.items()), f"{side}: round trip differs"
                del loaded
            blocked_s, copy_s = blocked_by_run_state(tensors, work / "run", round_index)
            times["blocked"].append(blocked_s)
            times["copy"].append(copy_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    for key, values in times.items():
        print(f"  {key:<10} median {med[key]:.3f} s  ({', '.join(f'{v:.3f}' for v in values)})")
    fsynced = med["save"] / med["+fsync"]
    print(f"write {med['save'] / med['torch.save']:.2f}x torch.save ({fsynced:.2f}x torch.save + fsync)")
    print(f"read {med['load'] / med['torch.load']:.2f}x torch.load")
    print(f"blocked {med['blocked'] / med['copy']:.2f}x the host copy (RunState.save; the write goes on behind)")


if __name__ == "__main__":
    main()
