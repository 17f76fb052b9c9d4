#!/usr/bin/env python3
"""Where the embedded engine's MoE decode step spends its time: the reduced Qwen3-30B-A3B of moe_gpu.py, decoded
step by step through hpcrl's model forward (the path the engine takes for MoE models: eager, no CUDA graph).

    python3 tools/gpu/moe_decode_profile.py --out $OUT/moe_profile     # ~1-2 min on one H100 (builds the model
                                                                        # in /tmp/moe-gpu unless moe_gpu.py did)

It prefills --batch random prompts of 64 tokens, then times --steps greedy decode steps (ms per step, CUDA-synced),
the same steps under torch.profiler (the top operators by GPU and by CPU time), and one decode step captured in a
CUDA graph and replayed (what the step would cost without the host's launch overhead: a bound, the graph does not
re-route when the routes change shape). Writes moe_decode_profile.json and profile.txt to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/moe-gpu"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    ns = p.parse_args()
    from moe_gpu import SHAPE, make_model

    from hpcrl.model.hf import load_model
    from hpcrl.model.qwen3 import KVCache

    ns.out.mkdir(parents=True, exist_ok=True)
    model_dir = ns.workdir / f"qwen3-moe-30b-a3b-{ns.layers}l"
    if not (model_dir / "config.json").is_file():
        make_model(model_dir, SHAPE, ns.layers, "bfloat16", "cuda")
    dev = torch.device("cuda")
    model = load_model(model_dir, dtype=torch.bfloat16, device=dev).eval()
    b, prompt_len = ns.batch, 64
    cache = KVCache.allocate(model.args, b, prompt_len + ns.steps * 3 + 8, torch.bfloat16, dev)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SHAPE["vocab_size"], (b, prompt_len), generator=gen).to(dev)
    zero = torch.zeros(b, dtype=torch.long, device=dev)
    report: dict[str, float] = {}
    with torch.inference_mode():
        logits = model.forward_cached(ids, cache, 0, zero, torch.full((b,), prompt_len - 1, device=dev),
                                      from_start=True)  # fmt: skip
        pos = prompt_len

        def step() -> None:
            nonlocal logits, pos
            nxt = logits.argmax(-1, keepdim=True)
            logits = model.forward_cached(nxt, cache, 0, torch.full((b,), pos, device=dev), zero)
            pos += 1

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(ns.steps):
            step()
        torch.cuda.synchronize()
        report["eager_ms_per_step"] = (time.perf_counter() - t0) / ns.steps * 1e3
        print(f"eager decode: {report['eager_ms_per_step']:.2f} ms/step at batch {b} "
              f"({b / report['eager_ms_per_step'] * 1e3:.0f} tok/s)", flush=True)  # fmt: skip
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                step()
            torch.cuda.synchronize()
        avg = prof.key_averages()
        text = ("== by GPU time\n" + avg.table(sort_by="self_cuda_time_total", row_limit=25)
                + "\n== by CPU time\n" + avg.table(sort_by="self_cpu_time_total", row_limit=25))  # fmt: skip
        (ns.out / "profile.txt").write_text(text)
        print(text[:9000], flush=True)
        # One step in a CUDA graph: the step's GPU time without the host's launches.
        nxt = logits.argmax(-1, keepdim=True)
        start = torch.full((b,), pos, device=dev)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                model.forward_cached(nxt, cache, 0, start, zero)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model.forward_cached(nxt, cache, 0, start, zero)
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(ns.steps):
                graph.replay()
            torch.cuda.synchronize()
            report["graph_ms_per_step"] = (time.perf_counter() - t0) / ns.steps * 1e3
            print(f"one step as a CUDA graph: {report['graph_ms_per_step']:.2f} ms/step", flush=True)
        except Exception as exc:  # noqa: BLE001 - the graph is a bound; its failure is a finding, reported
            report["graph_error"] = repr(exc)[:500]  # type: ignore[assignment]
            print(f"CUDA graph capture failed: {exc!r}"[:800], flush=True)
    (ns.out / "moe_decode_profile.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
