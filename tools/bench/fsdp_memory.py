"""Bytes a trainer rank holds for weights, gradients and AdamW state: train.parallelism ddp against fsdp2.

    python tools/bench/fsdp_memory.py [--ranks 1 2 4] [--layers 4] [--hidden 256]

For each rank count N, N processes on this machine (CPU, gloo) build the torch backend twice, DDP and then
FSDP2, on one random Qwen3-architecture model (the character tokenizer; `--layers`, `--hidden` and an MLP twice
as wide), take one GRPO step on a fixed batch of 8 samples, and measure what every rank then holds: the bytes
of its parameters, gradients (before the optimizer zeroes them) and AdamW moments, counted from the tensors'
storage (a DTensor: its local shard). Printed per N: rank 0's bytes under each parallelism and FSDP2's share of
DDP's, which should be about 1/N (a tensor whose first dimension does not divide by N is padded).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


def local_bytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def held(trainer: object, batch: object) -> dict[str, int]:
    """One GRPO step's gradients (an optimizer with lr 0 keeps them), then a real AdamW step's moments."""
    from hpcrl.trainer.torch_backend import TorchTrainer

    assert isinstance(trainer, TorchTrainer)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.step.grpo(batch, torch.optim.SGD(params, lr=0.0))  # type: ignore[arg-type]
    grads = local_bytes([p.grad for p in params if p.grad is not None])
    trainer.train_grpo(batch)  # type: ignore[arg-type]
    moments = [v for state in trainer.optimizer.state.values() for v in state.values() if v.dim() > 0]
    return {"weights": local_bytes(params), "gradients": grads, "optimizer": local_bytes(moments)}


def fixed_batch(vocab: int, num_samples: int = 8) -> object:
    from hpcrl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(num_samples)]
    responses = [torch.randint(3, vocab, (24,), generator=g).tolist() for _ in range(num_samples)]
    return TrainBatch.from_sequences(
        prompts, responses, advantages=torch.randn(num_samples, generator=g).tolist(),
        rollout_logprobs=[[-2.0] * len(r) for r in responses],
    )  # fmt: skip


def rank_main(model_dir: str, out: str) -> None:
    from hpcrl.trainer.config import TrainConfig
    from hpcrl.trainer.ranks import init_trainer_group
    from hpcrl.trainer.torch_backend import TorchTrainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_trainer_group(rank=rank, world_size=world, device=torch.device("cpu"), timeout_s=300)
    result = {}
    for parallelism in ("ddp", "fsdp2"):
        cfg = TrainConfig(parallelism=parallelism, num_ranks=world, micro_batch_size=4)  # type: ignore[arg-type]
        trainer = TorchTrainer(cfg, model_dir, rank=rank, world_size=world)
        result[parallelism] = held(trainer, fixed_batch(trainer.model.args.vocab_size))
        del trainer
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def run(model_dir: Path, world: int, out: Path) -> dict[str, dict[str, int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": path}  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, __file__, "--rank-of", str(model_dir), str(out)], env={**env, "RANK": str(r)})
        for r in range(world)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit(f"a rank of the {world}-rank run failed")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> None:
    if sys.argv[1:2] == ["--rank-of"]:
        rank_main(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    from hpcrl.model.tiny import TinyModelSpec, init_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(num_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden)
        model_dir = init_tiny_model(Path(tmp) / "model", spec)
        print(f"model: {args.layers} layers, hidden {args.hidden}; bytes held by rank 0 after one GRPO step (fp32)")
        print(f"{'ranks':>5} {'what':>10} {'ddp':>12} {'fsdp2':>12} {'fsdp2/ddp':>10} {'1/N':>6}")
        for world in args.ranks:
            result = run(model_dir, world, Path(tmp) / f"result-{world}.json")
            ddp, fsdp = result["ddp"], result["fsdp2"]
            rows = [(what, ddp[what], fsdp[what]) for what in ("weights", "gradients", "optimizer")]
            rows.append(("w+opt", ddp["weights"] + ddp["optimizer"], fsdp["weights"] + fsdp["optimizer"]))
            for what, a, b in rows:
                print(f"{world:>5} {what:>10} {a:>12,} {b:>12,} {b / a:>10.3f} {1 / world:>6.3f}")


if __name__ == "__main__":
    main()
