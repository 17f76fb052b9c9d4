"""A mixture-of-experts model under train.parallelism ddp and fsdp2 on the same real gloo ranks, run by
tests/unit/test_fsdp_moe.py.

    python tests/unit/fsdp_moe_ranks.py MODEL_DIR OUT_DIR   (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the env)

Each parallelism takes one GRPO step with routing replay on the fixed batch (routes the model's own router would
not pick), then rank 0 writes OUT_DIR/{ddp,fsdp2}.safetensors (the pushed weights), {ddp,fsdp2}.json (the step's
metrics) and {ddp,fsdp2}_export/ (the Hugging Face export); DDP's checkpoint goes to OUT_DIR/ddp_ckpt, FSDP2's
(each rank its shard file) to OUT_DIR/fsdp2_ckpt.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule

from hpcrl.store.checkpoint import save_checkpoint
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.ranks import init_trainer_group
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.unit.fsdp_ckpt_ranks import save
from tests.unit.fsdp_ranks import config, fixed_batch, pushed


def replayed_batch(layers: int, experts: int, top_k: int, vocab: int) -> TrainBatch:
    """The fixed batch with rollout routes: per token and layer, top_k distinct experts drawn at random, the last
    expert never and the one before it only in odd rows (rank 1's of two). Only a sequence's last token (which has
    no rollout route) goes where the model's own router sends it: some experts run on one rank and not the other."""
    batch = fixed_batch(vocab)
    g = np.random.default_rng(0)
    prompts, responses, routes = [], [], []
    for row in range(len(batch)):
        length, prompt = int(batch.lengths[row]), int(batch.prompt_lens[row])
        ids = batch.input_ids[row, :length].tolist()
        prompts.append(ids[:prompt])
        responses.append(ids[prompt:])
        pool = experts - 1 if row % 2 else experts - 2
        picks = np.argsort(g.random((length - 1, layers, pool)), axis=-1)[..., :top_k]
        routes.append(picks.astype(np.int32))
    return TrainBatch.from_sequences(
        prompts,
        responses,
        advantages=batch.advantages.tolist(),
        rollout_logprobs=[[-2.0 - 0.1 * j for j in range(len(r))] for r in responses],
        routed_experts=routes,
    )


def batch_for(trainer: TorchTrainer) -> TrainBatch:
    args = trainer.model.args
    assert args.moe is not None
    return replayed_batch(args.num_layers, args.moe.num_experts, args.moe.top_k, args.vocab_size)


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_trainer_group(rank=rank, world_size=world, device=torch.device("cpu"), timeout_s=120)
    for parallelism in ("ddp", "fsdp2"):
        trainer = TorchTrainer(
            config(parallelism, world, routing_replay="rollout"), model_dir, rank=rank, world_size=world
        )
        if parallelism == "fsdp2":  # each MoE layer's experts a unit of their own
            assert all(isinstance(layer.mlp.experts, FSDPModule) for layer in trainer.model.model.layers)
        metrics = trainer.train_grpo(batch_for(trainer))
        weights = pushed(trainer)
        if parallelism == "fsdp2":
            save(trainer, out / "fsdp2_ckpt", 1)
        else:
            tensors, state = trainer.state()
            if rank == 0:
                save_checkpoint(out / "ddp_ckpt", 1, tensors, {"trainer": state})
        if parallelism == "fsdp2" or rank == 0:  # FSDP2's ranks gather together; DDP's rank 0 holds it all
            trainer.export(out / f"{parallelism}_export")
        if rank == 0:
            save_file(weights, out / f"{parallelism}.safetensors")
            (out / f"{parallelism}.json").write_text(json.dumps(metrics))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
