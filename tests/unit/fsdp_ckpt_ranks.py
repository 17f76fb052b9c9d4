"""FSDP2 ranks that save and resume sharded checkpoints over gloo, run by tests/unit/test_fsdp_checkpoints.py.

    python tests/unit/fsdp_ckpt_ranks.py MODEL_DIR OUT_DIR [FROM_DIR]   (RANK/WORLD_SIZE/... in the env)

Without FROM_DIR the ranks take two GRPO steps from the model, save the checkpoint of step index 1 into
OUT_DIR/ckpt (each rank its shard file), take a third step (OUT_DIR/unbroken.safetensors: the pushed weights;
OUT_DIR/export: the export), then a fresh trainer resumes OUT_DIR/ckpt and takes the third step again
(OUT_DIR/resumed.safetensors). With FROM_DIR the ranks resume FROM_DIR/ckpt's newest checkpoint, take one step,
save its checkpoint into OUT_DIR/ckpt and write the pushed weights (OUT_DIR/resumed.safetensors); four ranks
do the same under hybrid sharding (2 replicas of 2 shards: OUT_DIR/hybrid_ckpt, OUT_DIR/hybrid.safetensors).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from hpcrl.store.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from hpcrl.store.shards import clear_pending
from hpcrl.trainer.config import FSDPConfig
from hpcrl.trainer.ranks import init_trainer_group
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.unit.fsdp_ranks import config, fixed_batch, pushed


def save(trainer: TorchTrainer, ckpt_dir: Path, step: int) -> None:
    """What a run's checkpoint does (hpcrl/trainer/ranks.py): the ranks write their shards, rank 0 the file."""
    if trainer.rank == 0:
        clear_pending(ckpt_dir)
    torch.distributed.barrier()
    tensors, state = trainer.state(shards_to=ckpt_dir)
    if trainer.rank == 0:
        save_checkpoint(ckpt_dir, step, tensors, {"trainer": state})
    torch.distributed.barrier()


def resume(trainer: TorchTrainer, ckpt_dir: Path) -> int:
    ckpt = load_checkpoint(list_checkpoints(ckpt_dir)[-1])
    trainer.load_state(ckpt.tensors, ckpt.state["trainer"], shards=ckpt.shards)
    return ckpt.step


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_trainer_group(rank=rank, world_size=world, device=torch.device("cpu"), timeout_s=120)
    cfg = config("fsdp2", world)
    trainer = TorchTrainer(cfg, model_dir, rank=rank, world_size=world)
    batch = fixed_batch(trainer.model.args.vocab_size)
    if len(sys.argv) > 3:
        step = resume(trainer, Path(sys.argv[3]) / "ckpt")
        trainer.train_grpo(batch)
        save(trainer, out / "ckpt", step + 1)
        weights = pushed(trainer)
        if rank == 0:
            save_file(weights, out / "resumed.safetensors")
        if world == 4:  # hybrid sharding, 2 replicas of 2 shards: the first replica writes the pieces
            hybrid = TorchTrainer(
                config("fsdp2", world, fsdp=FSDPConfig(shard_group_size=2)), model_dir, rank=rank, world_size=world
            )
            step = resume(hybrid, Path(sys.argv[3]) / "ckpt")
            hybrid.train_grpo(batch)
            save(hybrid, out / "hybrid_ckpt", step + 1)
            weights = pushed(hybrid)
            if rank == 0:
                save_file(weights, out / "hybrid.safetensors")
    else:
        trainer.train_grpo(batch)
        trainer.train_grpo(batch)
        save(trainer, out / "ckpt", 1)
        trainer.train_grpo(batch)
        weights = pushed(trainer)
        if rank == 0:
            save_file(weights, out / "unbroken.safetensors")
        # Files of 100 kB: the export is written a file at a time, gathered a tensor at a time.
        trainer.export(out / "export", max_file_bytes=100_000)
        fresh = TorchTrainer(cfg, model_dir, rank=rank, world_size=world)
        resume(fresh, out / "ckpt")
        fresh.train_grpo(batch)
        weights = pushed(fresh)
        if rank == 0:
            save_file(weights, out / "resumed.safetensors")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
