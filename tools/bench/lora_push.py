"""What LoRA saves on the Qwen3-0.6B shape (random weights, CPU): push bytes, optimizer-state bytes, and the time to
collect a push on the trainer and to apply it on an engine's weights, LoRA against full fine-tuning.

    python tools/bench/lora_push.py [--rank 16] [--alpha 32] [--dtype bfloat16] [--targets all-linear]

The model is built in-process with random weights (no download). LoRA: the `lora` converter on it, AdamW over the
adapters after one step on random gradients (the optimizer state is measured). Full fine-tuning: the push is every
weight, Adam's two moments are the parameters' size in their dtype (computed, not allocated). The engine side runs
the embedded engine's apply strategies on a second copy of the weights: `replace` of every weight against `lora`
(first version: it also keeps the host copy of the base; second: the steady state), and checks that the merged
weight equals the trainer's bit for bit.
"""

from __future__ import annotations

import argparse
import time

import torch

from hpcrl.engine.embedded.apply import MergeLoRA, Replace
from hpcrl.model.qwen3 import CausalLM, ModelArgs
from hpcrl.trainer.config import LoRAConfig, TrainConfig
from hpcrl.trainer.converters.lora import LoRA

QWEN3_0_6B = ModelArgs(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
    head_dim=128, tie_word_embeddings=True,
)  # fmt: skip


def random_model(dtype: torch.dtype, seed: int = 0) -> CausalLM:
    with torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            model = CausalLM.without_init(QWEN3_0_6B, device="cpu")
        finally:
            torch.set_default_dtype(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def nbytes(tensors: object) -> int:
    items = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(t.numel() * t.element_size() for t in items)  # type: ignore[union-attr]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--targets", nargs="+", default=["all-linear"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)

    model = random_model(dtype)
    served = {n: p.detach().clone() for n, p in model.named_parameters()}  # an engine's copy, as loaded
    full_state = {k: v.detach() for k, v in model.state_dict().items()}
    full_numel = sum(p.numel() for p in model.parameters())
    full_push = nbytes(full_state)
    full_adam = 2 * nbytes([p for p in model.parameters()])

    cfg = TrainConfig(dtype=args.dtype, converters=("lora",), lora=LoRAConfig(rank=args.rank, alpha=args.alpha,
                      target_modules=tuple(args.targets)))  # fmt: skip
    lora = LoRA(cfg)
    lora.convert(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for p in trained:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    optimizer.step()
    lora_adam = sum(nbytes([t for t in s.values() if t.dim() > 0]) for s in optimizer.state.values())

    t0 = time.perf_counter()
    pushed = list(lora.push_state(model, {}).items())
    collect_lora_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    full_list = [(k, v.detach()) for k, v in full_state.items()]
    collect_full_s = time.perf_counter() - t0
    lora_push = nbytes([t for _, t in pushed])

    t0 = time.perf_counter()
    Replace().apply(served, full_list)
    replace_s = time.perf_counter() - t0
    merge = MergeLoRA()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        merge.apply(served, pushed)
        times.append(time.perf_counter() - t0)
    name = next(iter(lora.layers))
    assert torch.equal(served[f"{name}.weight"], lora.layers[name].weight.detach()), "merged weight differs"

    mib = 2**20
    print(f"Qwen3-0.6B shape, {args.dtype}, random weights; LoRA rank {args.rank} alpha {args.alpha:g} on "
          f"{' '.join(args.targets)} ({len(lora.layers)} layers)")  # fmt: skip
    print(f"{'':24}{'full':>14}{'lora':>14}{'ratio':>10}")
    rows = [
        ("trained parameters", full_numel, sum(p.numel() for p in trained)),
        ("push MiB", full_push / mib, lora_push / mib),
        ("Adam state MiB", full_adam / mib, lora_adam / mib),
        ("trainer push prep s", collect_full_s, collect_lora_s),
        ("engine apply s (v1)", replace_s, times[0]),
        ("engine apply s (v2)", replace_s, times[1]),
    ]
    for label, full, lo in rows:
        print(f"{label:24}{full:>14.4g}{lo:>14.4g}{lo / full:>10.4f}")
    print(f"engine host copy of the base (lora only): {nbytes(merge.base) / mib:.1f} MiB; merged weight equals the "
          "trainer's bit for bit")  # fmt: skip


if __name__ == "__main__":
    main()
