"""One GRPO train step of the torch backend on GPUs: DDP against FSDP2 (+ activation checkpointing, offload), MFU and
peak memory, each variant in its own processes on the same model dir, in one call.

    python tools/gpu/fsdp_mfu.py [--shape qwen3-1.7b] [--ranks 1] [--batch 8] [--seq-len 2048] [--steps 5]
                                 [--variants ddp fsdp2 fsdp2+ac fsdp2+sac+head+compile+mb8 ...]

Variants: a parallelism (`ddp`, `fsdp2`) and levers joined with `+`: `ac` (activation_checkpointing: full), `sac`
(selective), `offload` (fsdp.offload), `head` (logprob_chunk_tokens=4096), `compile` (torch_compile), `mbN`
(micro_batch_size N; default --micro-batch), `fp32` (train.dtype float32: fp32 master weights, with FSDP2's default bf16
compute). Without `defaults` a lever not named is off (no compile, the plain head, --micro-batch); `defaults` leaves the
levers not named at the config's own defaults (`auto`: what a user who sets nothing gets on CUDA), so `ddp+defaults`
against `ddp+head+compile+mb8` is MFU at defaults beside MFU with every lever; the `settings` column names what each
variant resolved to. Weights are bf16 unless `fp32`. Workload: `batch` random sequences of `seq-len` tokens (prompt 64),
random advantages, one optimizer step; median over the steps after the first two. MFU: model FLOPs per token = 6 x
matmul parameters (LM head included) + 12 x layers x heads x head_dim x seq-len, per GPU, against 989 TFLOP/s dense bf16
(H100 SXM and H200). A variant that runs out of memory is reported as such: the shape DDP cannot hold and FSDP2 (+
offload) can. Ranks are processes on GPUs 0..N-1 over NCCL (--ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PEAK_TFLOPS = 989.0
SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32, num_kv_heads=8),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8),
}
DEFAULT_VARIANTS = [
    "ddp+defaults", "ddp+head+compile+mb8", "fsdp2+defaults", "fsdp2+head+compile+mb8", "fsdp2+ac",
    "fsdp2+sac+head+compile+mb8",
]  # fmt: skip


def flops_per_token(a: object, seq_len: int) -> float:
    h, layers = a.hidden_size, a.num_layers  # type: ignore[attr-defined]
    attn = h * a.num_heads * a.head_dim * 2 + h * a.num_kv_heads * a.head_dim * 2  # type: ignore[attr-defined]
    mlp = 3 * h * a.intermediate_size  # type: ignore[attr-defined]
    matmul = layers * (attn + mlp) + h * a.vocab_size  # type: ignore[attr-defined]
    return 6.0 * matmul + 12.0 * layers * a.num_heads * a.head_dim * seq_len  # type: ignore[attr-defined]


def config(variant: str, ns: argparse.Namespace, world: int) -> object:
    from hpcrl.trainer.config import FSDPConfig, TrainConfig

    parallelism, *levers = variant.split("+")
    known = {"ac", "sac", "offload", "head", "compile", "fp32", "defaults"}
    unknown = [x for x in levers if x not in known and not (x.startswith("mb") and x[2:].isdigit())]
    if parallelism not in ("ddp", "fsdp2") or unknown:
        raise SystemExit(f"bad variant {variant!r}: ddp|fsdp2 joined with {sorted(known)} or mbN")
    micro = next((int(x[2:]) for x in levers if x.startswith("mb")), None)
    ac = "full" if "ac" in levers else "selective" if "sac" in levers else "none"
    speed: dict[str, object] = {
        "micro_batch_size": micro or ns.micro_batch, "logprob_chunk_tokens": 4096 if "head" in levers else None,
        "torch_compile": "compile" in levers,
    }  # fmt: skip
    if "defaults" in levers:  # only the levers the variant names; the others resolve as the config's `auto`
        named = {"micro_batch_size": micro is not None, "logprob_chunk_tokens": "head" in levers}
        speed = {k: v for k, v in speed.items() if named.get(k, k == "torch_compile" and "compile" in levers)}
    return TrainConfig(
        parallelism=parallelism, num_ranks=world, device="cuda", dtype="float32" if "fp32" in levers else "bfloat16",
        lr=1e-6, activation_checkpointing=ac, num_threads=8,
        fsdp=FSDPConfig(offload="offload" in levers) if parallelism == "fsdp2" else FSDPConfig(), **speed,
    )  # type: ignore[arg-type]  # fmt: skip


def rank_main(ns: argparse.Namespace) -> None:
    from hpcrl.model.qwen3 import ModelArgs
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.ranks import init_trainer_group
    from hpcrl.trainer.torch_backend import TorchTrainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    if world > 1:
        init_trainer_group(rank=rank, world_size=world, device=torch.device("cuda"), timeout_s=600)
    args = ModelArgs.from_dir(ns.model_dir)
    out: dict[str, object] = {"variant": ns.variant}
    try:
        trainer = TorchTrainer(config(ns.variant, ns, world), ns.model_dir, rank=rank, world_size=world)  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, args.vocab_size, (64,), generator=g).tolist() for _ in range(ns.batch)]
        responses = [
            torch.randint(0, args.vocab_size, (ns.seq_len - 64,), generator=g).tolist() for _ in range(ns.batch)
        ]
        batch = TrainBatch.from_sequences(prompts, responses, advantages=torch.randn(ns.batch, generator=g).tolist())
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(ns.steps):
            t0 = time.perf_counter()
            m = trainer.train_grpo(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times[2:] if len(times) > 2 else times)
        tokens_per_gpu_s = ns.batch * ns.seq_len / step_s / world
        cfg = trainer.cfg
        mb = int(m.get("micro_batch_size", cfg.micro_batch_size))  # type: ignore[call-overload]
        head = f"head {cfg.chunk_tokens}" if cfg.chunk_tokens else "plain head"
        out["settings"] = f"compile {'on' if cfg.compiled else 'off'}, {head}, mb {mb}"
        out.update(step_s=step_s, first_step_s=times[0], loss=m["loss"], grad_norm=m["grad_norm"],
                   peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30, tokens_per_gpu_s=tokens_per_gpu_s,
                   mfu=flops_per_token(args, ns.seq_len) * tokens_per_gpu_s / (PEAK_TFLOPS * 1e12))  # fmt: skip
    except torch.OutOfMemoryError as exc:
        out["error"] = f"out of memory ({str(exc).splitlines()[0][:120]})"
    except ValueError as exc:  # the memory plan's refusal
        out["error"] = str(exc)[:300]
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.variant:
        rank_main(ns)
        return 0
    from hpcrl.model.tiny import ModelShape, init_shaped_model

    print(
        f"GRPO train step, shape={ns.shape}, {ns.ranks} x {torch.cuda.get_device_name()}, "
        f"{ns.batch} x {ns.seq_len} tokens"
    )
    print(
        "| variant | settings | step (s) | tokens/s/GPU | MFU | peak memory (GiB) | loss |\n"
        "|---|---|---|---|---|---|---|",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="hpcrl-fsdp-") as tmp:
        model_dir = Path(tmp) / "model"
        shape = ModelShape(
            vocab_size=151936, head_dim=128, max_position_embeddings=max(4096, ns.seq_len), **SHAPES[ns.shape]
        )
        init_shaped_model(model_dir, shape, dtype="bfloat16", device="cuda")
        for variant in ns.variants:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env = {**os.environ, "WORLD_SIZE": str(ns.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            cmd = [sys.executable, __file__, "--variant", variant, "--model-dir", str(model_dir),
                   *(f"--{k.replace('_', '-')}={v}" for k, v in vars(ns).items()
                     if k in ("batch", "seq_len", "micro_batch", "steps"))]  # fmt: skip
            procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for r in range(ns.ranks)]  # fmt: skip
            try:
                outs = [p.communicate(timeout=ns.timeout_s) for p in procs]
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                print(f"| {variant} | gave up after {ns.timeout_s:g} s |", flush=True)
                continue
            line = next((x for x in outs[0][0].splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"| {variant} | failed: {outs[0][1][-500:]!r} |", flush=True)
                continue
            r = json.loads(line.removeprefix("RESULT "))
            if "error" in r:
                print(f"| {variant} | {r['error']} |", flush=True)
                continue
            print(f"| {variant} | {r['settings']} | {r['step_s']:.3f} | {r['tokens_per_gpu_s']:,.0f} | "
                  f"{r['mfu']:.1%} | {r['peak_mem_gib']:.1f} | {r['loss']:.5f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
