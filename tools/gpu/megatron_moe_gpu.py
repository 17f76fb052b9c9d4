#!/usr/bin/env python3
"""The Megatron backend trains a reduced Qwen3-30B-A3B (tools/gpu/moe_gpu.py's shape) with expert parallelism 1 on one
GPU in bf16: GRPO steps with routing replay, the step time and the train/rollout log-prob gap with and without the
rollout's routes replayed.

    python3 tools/gpu/megatron_moe_gpu.py --out $OUT          # one H100/H200, megatron-core 0.16.1 or 0.19.x
    python3 tools/gpu/megatron_moe_gpu.py --out /tmp/m --tiny --device cpu --dtype float32   # CPU dry run

The rollout: hpcrl's own model (the embedded engine's forward: grouped expert GEMMs in bf16 on CUDA) runs --seqs
random sequences of --prompt-len + --response-len tokens once, recording each token's routed experts and the
response tokens' log-probs, as an engine that sampled them would hand them to the trainer. The Megatron trainer
(megatron-core's MoE layer, SequentialMLP experts, the allgather dispatcher, Megatron's distributed optimizer) then
scores the same tokens with its own router (`gap_own`) and with the rollout's routes forced (`gap_replay`): the
|trainer - rollout| log-prob per response token, max and mean. Then --steps GRPO steps (routing_replay: rollout) on
that batch, each timed (the first includes warm-up). Results: lines on stdout and megatron_moe_gpu.json in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from moe_gpu import SHAPE, TINY, make_model  # noqa: E402


def rollout(model_dir: Path, ns: argparse.Namespace) -> Any:
    """The batch an engine would hand the trainer: random tokens, their log-probs and routes under hpcrl's model."""
    from hpcrl.model import moe
    from hpcrl.model.hf import load_model, parse_dtype
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.logprobs import token_logprobs

    device = torch.device(ns.device)
    model = load_model(model_dir, dtype=parse_dtype(ns.dtype), device=device).eval()
    args = model.args
    assert args.moe is not None
    g = torch.Generator().manual_seed(0)
    length = ns.prompt_len + ns.response_len
    ids = torch.randint(3, args.vocab_size, (ns.seqs, length), generator=g)
    model.routing.replay = None
    with torch.no_grad():
        logits = model(ids.to(device))[:, :-1]
        lp, _ = token_logprobs(logits.float(), ids[:, 1:].to(device))
        routes = moe.routes_of(model.routing, args.moe, ns.seqs, length).cpu().numpy()
    lp = lp.cpu()
    del model, logits
    if device.type == "cuda":
        torch.cuda.empty_cache()
    prompts = [row[: ns.prompt_len].tolist() for row in ids]
    responses = [row[ns.prompt_len :].tolist() for row in ids]
    return TrainBatch.from_sequences(
        prompts, responses, advantages=torch.randn(ns.seqs, generator=g).tolist(),
        rollout_logprobs=[lp[i, ns.prompt_len - 1 :].tolist() for i in range(ns.seqs)],
        routed_experts=[np.ascontiguousarray(routes[i, : length - 1]) for i in range(ns.seqs)],
    )  # fmt: skip


def gap(lp: torch.Tensor, batch: Any) -> tuple[float, float]:
    d = (lp.float().cpu() - batch.rollout_logprobs)[batch.loss_mask].abs()
    return float(d.max()), float(d.mean())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=448)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", action="store_true", help="train.torch_compile (off by default: MoE layers untested)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape (CPU dry run)")
    ns = p.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    import megatron.core

    from hpcrl.trainer.config import TrainConfig
    from hpcrl.trainer.megatron.backend import MegatronTrainer

    shape = TINY if ns.tiny else SHAPE
    model_dir = make_model(ns.out / ("tiny-moe" if ns.tiny else "qwen3-30b-a3b-reduced"), shape, ns.layers,
                           ns.dtype, ns.device)  # fmt: skip
    batch = rollout(model_dir, ns)
    cfg = TrainConfig(
        backend="megatron", device=ns.device, dtype=ns.dtype, lr=ns.lr, kl_coef=0.0,
        micro_batch_size=ns.micro_batch, routing_replay="rollout", torch_compile=ns.compile,
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer = MegatronTrainer(cfg, model_dir)
    out: dict[str, Any] = {
        "megatron_core": megatron.core.__version__, "torch": torch.__version__, "device": ns.device,
        "gpu": torch.cuda.get_device_name() if ns.device.startswith("cuda") else "cpu", "shape": shape,
        "layers": ns.layers, "tokens": ns.seqs * (ns.prompt_len + ns.response_len), "optimizer": trainer.optimizer_kind,
        "build_s": time.perf_counter() - t0,
    }  # fmt: skip
    device = trainer.device
    own = trainer.pipeline.score(dataclasses.replace(batch, routed_experts=None).to(device), reference=False)
    replayed = trainer.pipeline.score(batch.to(device), reference=False)
    assert own is not None and replayed is not None
    out["gap_own_max"], out["gap_own_mean"] = gap(own, batch)
    out["gap_replay_max"], out["gap_replay_mean"] = gap(replayed, batch)
    print(f"megatron-core {out['megatron_core']}, {out['gpu']}, {ns.dtype}, {out['tokens']} tokens a step, "
          f"optimizer {out['optimizer']}", flush=True)  # fmt: skip
    print(f"gap without replay: max {out['gap_own_max']:.4f} mean {out['gap_own_mean']:.5f}; with replay: max "
          f"{out['gap_replay_max']:.4f} mean {out['gap_replay_mean']:.5f}", flush=True)  # fmt: skip
    steps = []
    for i in range(ns.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = trainer.train_grpo(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        m["step_s"] = time.perf_counter() - t0
        steps.append(m)
        print(f"step {i}: {m['step_s']:.2f} s, loss {m['loss']:.4f}, grad_norm {m['grad_norm']:.3f}, "
              f"route_agreement {m.get('moe/route_agreement', float('nan')):.3f}, "
              f"aux_loss {m.get('moe/aux_loss', float('nan')):.4f}, "
              f"gap (replayed) max {m['train_rollout_logprob_max_abs_diff']:.4f} "
              f"mean {m['train_rollout_logprob_abs_diff']:.5f}", flush=True)  # fmt: skip
    out["steps"] = steps
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        print(f"peak GPU memory {out['peak_memory_gb']:.1f} GB", flush=True)
    (ns.out / "megatron_moe_gpu.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
