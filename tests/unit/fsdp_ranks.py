"""The torch backend under train.parallelism: fsdp2 on real ranks over gloo, run by tests/unit/test_fsdp.py.

    python tests/unit/fsdp_ranks.py MODEL_DIR OUT_DIR [grads]   (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the env)

Rank 0 writes to OUT_DIR (safetensors, JSON):
- grads_{none,full,selective}: the clipped gradients of one GRPO update on the fixed batch (an optimizer with lr 0,
  so nothing moves), gathered whole, per activation_checkpointing, and metrics_*.json (loss, grad norm)
  (with `grads`: only those of activation_checkpointing none, and nothing else); grads_hybrid: the same under
  fsdp.shard_group_size 1 (a 2-D mesh: every rank a shard group of its own, the groups replicas);
- ckpt/: the trainer's checkpoint after two GRPO steps; step3: the pushed weights after a third;
- resumed: the pushed weights after a fresh trainer loaded ckpt/ and took the third step;
- from_ddp: the same from OUT_DIR/ddp_ckpt (written by a DDP trainer of another rank count) when it exists.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from hpcrl.store.checkpoint import checkpoint_file, load_checkpoint, save_checkpoint
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import FSDPConfig, TrainConfig
from hpcrl.trainer.ranks import init_trainer_group
from hpcrl.trainer.sharded_state import gather_full
from hpcrl.trainer.torch_backend import TorchTrainer

# The speed settings pinned: on CUDA their `auto` would compile and fuse the head, which these comparisons leave out.
TRAIN = dict(
    lr=1e-2, micro_batch_size=2, kl_coef=0.1, entropy_coef=0.01, num_threads=1, torch_compile=False,
    logprob_chunk_tokens=None,
)  # fmt: skip


def fixed_batch(vocab: int, num_samples: int = 6) -> TrainBatch:
    g = torch.Generator().manual_seed(0)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts, responses = [ids(2, 6) for _ in range(num_samples)], [ids(1, 7) for _ in range(num_samples)]
    return TrainBatch.from_sequences(
        prompts,
        responses,
        advantages=torch.randn(num_samples, generator=g).tolist(),
        rollout_logprobs=[[-2.0 - 0.1 * j for j in range(len(r))] for r in responses],
    )


def config(parallelism: str, world: int, **extra: object) -> TrainConfig:
    return TrainConfig(parallelism=parallelism, num_ranks=world, **TRAIN, **extra)  # type: ignore[arg-type]


def gradients(trainer: TorchTrainer, batch: TrainBatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One update's gradients (clipped) and metrics; an optimizer with lr 0 leaves the weights as they were."""
    frozen = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=0.0)
    metrics = trainer.step.grpo(batch, frozen)
    grads = {n: gather_full(p.grad).clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return grads, metrics


def pushed(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone().contiguous() for n, t in trainer.push_weights()}


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_trainer_group(rank=rank, world_size=world, device=torch.device("cpu"), timeout_s=120)
    grads_only = sys.argv[3:] == ["grads"]
    batch = None
    for ac in ("none",) if grads_only else ("none", "full", "selective"):
        cfg = config("fsdp2", world, activation_checkpointing=ac)
        trainer = TorchTrainer(cfg, model_dir, rank=rank, world_size=world)
        batch = batch or fixed_batch(trainer.model.args.vocab_size)
        grads, metrics = gradients(trainer, batch)
        if rank == 0:
            save_file(grads, out / f"grads_{ac}.safetensors")
            (out / f"metrics_{ac}.json").write_text(json.dumps(metrics))
    assert batch is not None
    if world > 1 and not grads_only:
        hybrid = TorchTrainer(
            config("fsdp2", world, fsdp=FSDPConfig(shard_group_size=1)), model_dir, rank=rank, world_size=world
        )
        grads, _ = gradients(hybrid, batch)
        if rank == 0:
            save_file(grads, out / "grads_hybrid.safetensors")
    if grads_only:
        torch.distributed.destroy_process_group()
        return
    cfg = config("fsdp2", world)
    trainer = TorchTrainer(cfg, model_dir, rank=rank, world_size=world)
    trainer.train_grpo(batch)
    trainer.train_grpo(batch)
    tensors, state = trainer.state()
    if rank == 0:
        save_checkpoint(out / "ckpt", 1, tensors, {"trainer": state})
    torch.distributed.barrier()
    trainer.train_grpo(batch)
    weights = pushed(trainer)
    if rank == 0:
        save_file(weights, out / "step3.safetensors")
    sources = [("resumed", out / "ckpt")] + ([("from_ddp", out / "ddp_ckpt")] if (out / "ddp_ckpt").is_dir() else [])
    for name, ckpt_dir in sources:
        fresh = TorchTrainer(cfg, model_dir, rank=rank, world_size=world)
        ckpt = load_checkpoint(checkpoint_file(ckpt_dir, 1))
        fresh.load_state(ckpt.tensors, ckpt.state["trainer"])
        fresh.train_grpo(batch)
        weights = pushed(fresh)
        if rank == 0:
            save_file(weights, out / f"{name}.safetensors")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
