"""Training throughput and MFU of the Megatron backend against the torch backend, in one run.

    python tools/bench/megatron_train.py [--shape qwen3-0.6b] [--batch 8] [--seq-len 2048] [--micro-batch 4]
                                         [--steps 5] [--device cuda] [--dtype bfloat16]
                                         [--backends megatron megatron-local torch]
                                         [--backends torch torch+head torch+head+mb8 torch+head+compile+mb8]
                                         [--backends megatron megatron+head+compile+mb8 torch+head+compile+mb8]
                                         [--json PATH]

Workload: one GRPO optimizer step (forward, vocab-parallel log-probs and entropy, PPO loss, backward, AdamW)
on `batch` random sequences of `seq-len` tokens (prompt 64, response the rest), random advantages.
Each backend runs in its own process (Megatron's process groups are global) on the same model dir.
Reports the median step time over the steps after the first two, tokens/s, peak memory and MFU:
model FLOPs per token = 6 x (matmul parameters, the LM head included) + 12 x layers x heads x head_dim x
seq-len (PaLM's attention term, causal masking not discounted), against the H200's 989 TFLOP/s dense bf16.
Baseline: the torch backend (hpcrl's own model, the same losses), which is what a run uses today.

Levers, joined to a backend with `+` (torch, megatron, megatron-local, ...), each in its own process
like a backend: `head` is train.logprob_chunk_tokens=4096 (log-probs from the hidden states, no [tokens x vocab]
logits; megatron: from the last stage's final norm with each TP rank's vocabulary shard); `mbN` the micro-batch
size N instead of --micro-batch; `compile` is train.torch_compile (torch.compile of every decoder layer, megatron:
every TransformerLayer, and, with `head`, of the head's per-chunk softmax). The first two steps, which include
compilation, are left out of the median; a lever's speed is also printed against its plain backend.
`--profile LEVER` runs one more step of that backend or lever under torch.profiler and prints where its GPU time
went (the top kernels by self time, and the share of GEMMs, attention, elementwise/fused and the optimizer).
The sequences are all seq-len long, so packing variable-length sequences has nothing to remove here (no
padding); it is not a lever of this workload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PEAK_TFLOPS = {"cuda": 989.0}


def flops_per_token(args: object, seq_len: int) -> float:
    a = args  # hpcrl.model.qwen3.ModelArgs
    h, L = a.hidden_size, a.num_layers
    attn = h * a.num_heads * a.head_dim * 2 + h * a.num_kv_heads * a.head_dim * 2
    mlp = 3 * h * a.intermediate_size
    matmul_params = L * (attn + mlp) + h * a.vocab_size
    return 6.0 * matmul_params + 12.0 * L * a.num_heads * a.head_dim * seq_len


def one_backend(ns: argparse.Namespace) -> dict[str, float]:
    from hpcrl.model.qwen3 import ModelArgs
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.config import TrainConfig
    from hpcrl.trainer.ranks import build_trainer

    args = ModelArgs.from_dir(ns.model_dir)
    name, *levers = ns.backend.split("+")
    backend, _, optimizer = name.partition("-")  # megatron-local: the local optimizer
    unknown = [x for x in levers if x not in ("head", "compile") and not (x.startswith("mb") and x[2:].isdigit())]
    if unknown:
        raise SystemExit(
            f"unknown lever(s) {unknown} in {ns.backend!r}: BACKEND+head, BACKEND+mbN, BACKEND+compile "
            "(e.g. torch+head+compile+mb8, megatron+head+compile+mb8)"
        )
    micro = next((int(x[2:]) for x in levers if x.startswith("mb")), ns.micro_batch)
    cfg = TrainConfig(backend=backend, device=ns.device, dtype=ns.dtype, micro_batch_size=micro,  # type: ignore[arg-type]
                      lr=1e-6, num_threads=8, megatron_optimizer=optimizer or "auto",  # type: ignore[arg-type]
                      logprob_chunk_tokens=4096 if "head" in levers else None,
                      torch_compile="compile" in levers)  # fmt: skip
    trainer = build_trainer(cfg, ns.model_dir, rank=0, world_size=1, sft_lr=1e-6)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab_size, (64,), generator=g).tolist() for _ in range(ns.batch)]
    responses = [torch.randint(0, args.vocab_size, (ns.seq_len - 64,), generator=g).tolist() for _ in range(ns.batch)]
    batch = TrainBatch.from_sequences(prompts, responses, advantages=torch.randn(ns.batch, generator=g).tolist())
    times = []
    if ns.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(ns.steps):
        t0 = time.perf_counter()
        m = trainer.train_grpo(batch)
        if ns.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[2:] if len(times) > 2 else times)
    if ns.profile_out is not None:
        _profile_step(trainer, batch, ns.profile_out)
    tokens = ns.batch * ns.seq_len
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if ns.device == "cuda" else float("nan")
    out = {"step_s": step_s, "tokens_per_s": tokens / step_s, "loss": m["loss"], "grad_norm": m["grad_norm"],
           "peak_mem_gib": peak_mem, "micro_batch": micro, "first_step_s": times[0]}  # fmt: skip
    peak = PEAK_TFLOPS.get(ns.device)
    out["mfu"] = flops_per_token(args, ns.seq_len) * out["tokens_per_s"] / (peak * 1e12) if peak else float("nan")
    return out


# Kernel names by kind, for the profile's summary (cuBLAS/CUTLASS GEMMs, flash/SDPA attention, the optimizer).
_KINDS = (
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "aten::mm", "addmm", "bmm")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
)


def _profile_step(trainer: object, batch: object, out: Path) -> None:
    """One more step under torch.profiler: its top kernels by self time and the share of each kind."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        trainer.train_grpo(batch)  # type: ignore[attr-defined]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    from torch.autograd import DeviceType

    # The kernels alone: an op's own row also carries its kernels' device time, which would count it twice. On a
    # CPU-only machine (checking the script) the ops' self CPU time stands in for the kernels'.
    cuda = torch.cuda.is_available()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind and getattr(e, attr, 0) > 0]
    total_us = sum(getattr(e, attr) for e in events) or 1.0
    shares: dict[str, float] = {}
    for e in events:
        name = e.key.lower()
        kind = next((k for k, words in _KINDS if any(w in name for w in words)), "other (elementwise, fused, copies)")
        shares[kind] = shares.get(kind, 0.0) + getattr(e, attr)
    lines = [f"{attr} of one step: {total_us / 1e3:.1f} ms (kernels' self time, summed)"]
    lines += [f"  {k}: {v / 1e3:.1f} ms = {v / total_us:.0%}" for k, v in sorted(shares.items(), key=lambda x: -x[1])]
    lines.append("top kernels (ops on a CPU) by self time:")
    for e in sorted(events, key=lambda e: -getattr(e, attr))[:15]:
        lines.append(f"  {getattr(e, attr) / 1e3:8.2f} ms  x{e.count:<5d} {e.key[:110]}")
    out.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "tiny"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--backends", nargs="+", default=["megatron", "torch"],
                    help="megatron (train.megatron_optimizer auto: distributed on CUDA), megatron-local, "
                    "megatron-distributed, torch; each may take levers: BACKEND+head+compile+mbN")  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--timeout-s", type=float, default=None, help="give up on a backend or lever after this long")
    ap.add_argument("--profile", metavar="LEVER", help="profile one more step of this backend or lever")
    ap.add_argument("--profile-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.seq_len <= 64:
        ap.error("--seq-len must exceed the 64 prompt tokens")
    if ns.backend:  # child process: one backend
        print("RESULT " + json.dumps(one_backend(ns)), flush=True)
        return 0
    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, TinyModelSpec, init_shaped_model, init_tiny_model

    results = {}
    with tempfile.TemporaryDirectory(prefix="hpcrl-mbench-") as tmp:
        model_dir = Path(tmp) / "model"
        if ns.shape == "qwen3-0.6b":
            init_shaped_model(model_dir, QWEN3_0_6B_SHAPE, dtype=ns.dtype, device=ns.device)
        else:
            init_tiny_model(model_dir, TinyModelSpec(max_position_embeddings=max(1024, ns.seq_len)))
        for backend in ns.backends:
            cmd = [sys.executable, __file__, "--backend", backend, "--model-dir", str(model_dir),
                   *(f"--{k.replace('_', '-')}={v}" for k, v in vars(ns).items()
                     if k in ("batch", "seq_len", "micro_batch", "steps", "device", "dtype"))]  # fmt: skip
            profile_out = Path(tmp) / f"profile-{backend}.txt"
            if ns.profile == backend:
                cmd += ["--profile-out", str(profile_out)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=ns.timeout_s,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
            except subprocess.TimeoutExpired:
                print(f"{backend}: gave up after {ns.timeout_s:g} s", flush=True)
                continue
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if out.returncode or line is None:
                print(f"{backend}: failed ({out.returncode})\n{out.stderr[-3000:]}")
                continue
            results[backend] = json.loads(line.removeprefix("RESULT "))
            r = results[backend]
            if profile_out.exists():
                print(f"profile: {backend}\n{profile_out.read_text()}", flush=True)
            print(f"mfu: {backend}: {r['mfu']:.1%} MFU, {r['tokens_per_s']:,.0f} tok/s, step {r['step_s']:.3f} s, "
                  f"micro-batch {r['micro_batch']}, peak {r['peak_mem_gib']:.1f} GiB", flush=True)  # fmt: skip
    print(f"\nGRPO train step, shape={ns.shape} {ns.batch} x {ns.seq_len} tokens, micro-batch {ns.micro_batch}, "
          f"{ns.dtype} on {ns.device}, median of steps 3..{ns.steps}")  # fmt: skip
    print(
        "| backend | step (s) | tokens/s | MFU | peak memory (GiB) | loss | grad norm |\n|---|---|---|---|---|---|---|"
    )
    for backend, r in results.items():
        print(f"| {backend} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_mem_gib']:.1f} "
              f"| {r['loss']:.4f} | {r['grad_norm']:.3f} |")  # fmt: skip
    for backend, r in results.items():
        plain = backend.split("+")[0]
        if "+" in backend and plain in results:
            ratio = r["tokens_per_s"] / results[plain]["tokens_per_s"]
            print(f"mfu: {backend} / {plain} tokens/s: {ratio:.2f}x")
    if ns.json is not None:
        setup = {k: str(v) for k, v in vars(ns).items() if k not in ("json", "model_dir", "backend")}
        ns.json.write_text(json.dumps({"setup": setup, "results": results}, indent=1))
    if "megatron" in results and "torch" in results:
        print(
            f"megatron / torch tokens/s: {results['megatron']['tokens_per_s'] / results['torch']['tokens_per_s']:.2f}x"
        )
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
