"""Sharded checkpoints of train.parallelism: fsdp2: each rank writes its shard file, any rank count resumes.

The FSDP2 ranks are processes over gloo (tests/unit/fsdp_ckpt_ranks.py); DDP on one rank, in this process, is the
unbroken reference and the one-rank end of the chain 2 -> 4 -> 1.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import pytest
import torch
from safetensors.torch import load_file

from hpcrl.model.hf import iter_safetensors
from hpcrl.store.checkpoint import (
    PENDING_SHARDS,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    remove_temp_files,
    save_checkpoint,
    shards_dir,
)
from hpcrl.store.run_dir import find_resume_point
from hpcrl.store.shards import ShardReader, write_shard
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.unit.fsdp_ranks import config, fixed_batch, pushed
from tests.unit.test_fsdp import STEPS, assert_close, launch, wait


def sharded_bytes(trainer: TorchTrainer) -> int:
    """Bytes of what FSDP2 shards: weights (and the reference model's) and both AdamW moments."""
    tensors, _ = trainer.state()
    return sum(t.nbytes for k, t in tensors.items() if k.startswith(("model/", "ref_model/")) or "/exp_avg" in k)


def assert_about_a_share(folder: Path, world: int, total: int) -> None:
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    assert len(sizes) == world, sizes
    for name, size in sizes.items():  # 1/N of the bytes, plus a file's header (a few KiB)
        assert total / world * 0.97 <= size <= total / world * 1.03 + 16384, (name, size, total / world)


def test_sharded_checkpoints_resume_bitwise_and_on_2_4_1_ranks(tiny_model_dir: Path, tmp_path: Path) -> None:
    two, four = tmp_path / "two", tmp_path / "four"
    procs = launch_ckpt(tiny_model_dir, two, 2)
    # The unbroken run, on one DDP rank, while the ranks work: the weights after steps 3, 4 and 5.
    ddp = TorchTrainer(config("ddp", 1), tiny_model_dir)
    batch = fixed_batch(ddp.model.args.vocab_size)
    after = {}
    for step in range(1, 6):
        ddp.train_grpo(batch)
        after[step] = pushed(ddp)
        if step == 2:
            total = sharded_bytes(ddp)
    wait(procs)

    # Two ranks: each writes about half of the state; the same rank count resumes bit for bit.
    assert_about_a_share(shards_dir(list_checkpoints(two / "ckpt")[-1]), 2, total)
    unbroken, resumed = load_file(two / "unbroken.safetensors"), load_file(two / "resumed.safetensors")
    assert sorted(resumed) == sorted(unbroken) and all(torch.equal(resumed[n], unbroken[n]) for n in unbroken)
    assert_close(unbroken, after[3], "2 ranks, step 3", STEPS)
    # The export: safetensors files of about 100 kB each and their index, holding the weights pushed.
    exported = dict(iter_safetensors(two / "export"))
    assert len(list((two / "export").glob("model-*-of-*.safetensors"))) >= 3
    assert sorted(exported) == sorted(unbroken) and all(torch.equal(exported[n], unbroken[n]) for n in unbroken)

    # 2 -> 4: each of four ranks reads its quarter from the two files and saves its own quarter.
    wait(launch_ckpt(tiny_model_dir, four, 4, two))
    assert_close(load_file(four / "resumed.safetensors"), after[3], "2 -> 4 ranks, step 3", STEPS)
    assert_about_a_share(shards_dir(list_checkpoints(four / "ckpt")[-1]), 4, total)
    # Hybrid sharding (2 replicas of 2 shards) resumes the same; its first replica writes the halves.
    assert_close(load_file(four / "hybrid.safetensors"), after[3], "2 -> 2x2 hybrid, step 3", STEPS)
    sizes = sorted(p.stat().st_size for p in shards_dir(list_checkpoints(four / "hybrid_ckpt")[-1]).iterdir())
    assert sizes[1] < 16384 and total / 2 * 0.97 <= sizes[2] <= sizes[3] <= total / 2 * 1.03 + 16384, sizes

    # 4 -> 1: one DDP rank reads every piece of the four files.
    single = TorchTrainer(config("ddp", 1), tiny_model_dir)
    ckpt = load_checkpoint(list_checkpoints(four / "ckpt")[-1])
    assert ckpt.step == 2 and ckpt.shards is not None
    single.load_state(ckpt.tensors, ckpt.state["trainer"], shards=ckpt.shards)
    single.train_grpo(batch)
    assert_close(pushed(single), after[4], "2 -> 4 -> 1 ranks, step 4", STEPS)

    # A flipped byte in one rank's file: the checkpoint is refused, naming that file.
    broken = tmp_path / "broken"
    shutil.copytree(two / "ckpt", broken)
    path = list_checkpoints(broken)[-1]
    victim = shards_dir(path) / "rank-00001-of-00002.h5"
    with h5py.File(victim, "r") as f:
        at = f["blob"].id.get_offset() + f["blob"].shape[0] // 2
    with open(victim, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    ckpt = load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"rank-00001-of-00002\.h5 fails its checksum.*the file is corrupt"):
        TorchTrainer(config("ddp", 1), tiny_model_dir).load_state(
            ckpt.tensors, ckpt.state["trainer"], shards=ckpt.shards
        )
    # A shard file gone: the checkpoint does not load at all (a resume falls back to an earlier one).
    victim.unlink()
    with pytest.raises(CheckpointError, match=r"rank-00001-of-00002\.h5 of checkpoint .* is missing"):
        load_checkpoint(path)


def launch_ckpt(model_dir: Path, out: Path, world: int, source: Path | None = None) -> list:
    return launch(model_dir, out, world, *([str(source)] if source else []), script="fsdp_ckpt_ranks.py")


def test_shard_files_commit_with_the_checkpoint_and_any_box_reads_back(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    whole = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    # Two ranks' pieces of a [7, 3] tensor (4 + 3 rows), as FSDP2 cuts dim 0, and a tensor rank 1 holds none of.
    write_shard(ckpt_dir, 0, 2, {"w": (whole[:4], [7, 3], [0, 0]), "b": (torch.ones(2), [2], [0])})
    write_shard(ckpt_dir, 1, 2, {"w": (whole[4:], [7, 3], [4, 0])})
    # Killed before the checkpoint's file: nothing loads, and a resume deletes the waiting shards.
    assert find_resume_point(ckpt_dir).checkpoint is None
    assert ckpt_dir / PENDING_SHARDS in remove_temp_files(ckpt_dir)
    write_shard(ckpt_dir, 0, 2, {"w": (whole[:4], [7, 3], [0, 0]), "b": (torch.ones(2), [2], [0])})
    write_shard(ckpt_dir, 1, 2, {"w": (whole[4:], [7, 3], [4, 0])})
    path = save_checkpoint(ckpt_dir, 0, {"plain": torch.zeros(1)}, {"x": 1})
    ckpt = load_checkpoint(path)
    assert ckpt.shards == shards_dir(path) and not (ckpt_dir / PENDING_SHARDS).exists()
    reader = ShardReader(ckpt.shards)
    # Three ranks' boxes (3, 3, 1 rows): the middle one spans both files.
    for offset, rows in ((0, 3), (3, 3), (6, 1)):
        assert torch.equal(reader.read("w", [offset, 0], [rows, 3]), whole[offset : offset + rows])
    assert torch.equal(reader.read("b", [0], [2]), torch.ones(2))
    # Retention deletes a checkpoint's shards with its file.
    save_checkpoint(ckpt_dir, 1, {"plain": torch.zeros(1)}, {"x": 2}, keep_last=1)
    assert not path.exists() and not shards_dir(path).exists()
