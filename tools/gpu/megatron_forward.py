"""Megatron GPTModel forward vs transformers on the Qwen3-0.6B shape, fp32 on CUDA.

    python tools/gpu/megatron_forward.py [--batch 2] [--seq-len 512]

Random weights written by hpcrl (init_shaped_model), loaded into both; prints the max abs logit difference.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ns = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from hpcrl.model.hf import iter_safetensors
    from hpcrl.model.qwen3 import ModelArgs
    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, init_shaped_model
    from hpcrl.trainer.megatron.layout import Shard, to_megatron
    from hpcrl.trainer.megatron.model import build_gpt_model, init_parallel_state

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        d = init_shaped_model(Path(tmp) / "m", QWEN3_0_6B_SHAPE, dtype="float32", device="cuda")
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        init_parallel_state(1, 1)
        args = ModelArgs.from_dir(d)
        hf = {k: v.cuda() for k, v in iter_safetensors(d)}
        model = build_gpt_model(args, tp_size=1, pp_size=1, pp_rank=0, dtype=torch.float32, device=torch.device("cuda"))
        model.load_state_dict(to_megatron(hf.__getitem__, args, Shard(num_layers=args.num_layers)), strict=False)
        model.eval()
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
        ids = torch.randint(0, args.vocab_size, (ns.batch, ns.seq_len), device="cuda")
        pos = torch.arange(ns.seq_len, device="cuda").expand_as(ids)
        with torch.no_grad():
            ours = model(ids, pos, None)[..., : args.vocab_size]
            theirs = ref(ids).logits
        diff = (ours - theirs).abs()
        print(
            f"Qwen3-0.6B shape, fp32 (TF32 off), {ns.batch} x {ns.seq_len}: max |megatron - transformers| logit "
            f"= {diff.max().item():.3e} (mean {diff.mean().item():.3e}; logits up to {theirs.abs().max().item():.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
