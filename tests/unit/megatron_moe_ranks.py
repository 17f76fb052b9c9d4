"""A mixture-of-experts model on the Megatron backend over two real gloo ranks, run by tests/unit/test_megatron_moe.py.

    python tests/unit/megatron_moe_ranks.py MODEL_DIR OUT_DIR   (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the env)

The same two ranks (two data-parallel replicas) train with train.expert_parallel_size 1 (every rank holds all
experts), then 2 (each rank half of them; tokens travel to their expert's rank and back): each scores the replayed
batch, takes one GRPO step with routing replay and exports. Rank 0 writes OUT_DIR/ep{1,2}.json (the step's metrics),
OUT_DIR/ep{1,2}.safetensors (the log-probs it scored) and OUT_DIR/ep{1,2}_export/ (the Hugging Face export).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.megatron.backend import MegatronTrainer
from hpcrl.trainer.ranks import init_trainer_group
from tests.unit.fsdp_moe_ranks import replayed_batch
from tests.unit.megatron_ranks import NO_KL


def main() -> None:
    from megatron.core import parallel_state as ps

    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_trainer_group(rank=rank, world_size=world, device=torch.device("cpu"), timeout_s=120)
    for ep in (1, 2):
        cfg = TrainConfig(backend="megatron", num_ranks=world, expert_parallel_size=ep, routing_replay="rollout",
                          **NO_KL)  # type: ignore[arg-type]  # fmt: skip
        trainer = MegatronTrainer(cfg, model_dir, rank=rank, world_size=world)
        args = trainer.args
        assert args.moe is not None
        batch = replayed_batch(args.num_layers, args.moe.num_experts, args.moe.top_k, args.vocab_size)
        own = trainer.pipeline.score(batch, reference=False)
        assert own is not None
        metrics = trainer.train_grpo(batch)
        trainer.export(out / f"ep{ep}_export")
        if rank == 0:
            (out / f"ep{ep}.json").write_text(json.dumps(metrics))
            save_file({"logprobs": own.contiguous()}, str(out / f"ep{ep}.safetensors"))
        ps.destroy_model_parallel()  # the next split builds its own groups


if __name__ == "__main__":
    main()
