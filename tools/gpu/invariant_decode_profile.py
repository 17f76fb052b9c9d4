"""Where one batch-invariant decode step's GPU time goes, kernel by kernel, against the plain fused step
(issue #17: decode <= 1.3x the plain step). Qwen3-0.6B shape, random weights, bf16, one H200:

    PYTHONPATH=. python3 tools/gpu/invariant_decode_profile.py [--batch 64] [--position 256] [--steps 5]

Each step runs eagerly (no CUDA graph, so every kernel shows) under torch.profiler; the table is the CUDA
time per kernel name, summed over one step, with the launch count. Then both steps are captured in CUDA
graphs, as the engine runs them, and timed with CUDA events (median of --steps replays): that is the figure
the price compares. `--cpu-check` runs the tiny shape on the CPU to check the script (no kernels there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--position", type=int, default=256, help="every row decodes at this position")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=18, help="kernel rows printed per step")
    p.add_argument("--cpu-check", action="store_true")
    ns = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from hpcrl.engine.embedded.runner import DecodeRunner
    from hpcrl.model import invariant
    from hpcrl.model.hf import load_model
    from hpcrl.model.qwen3 import KVCache
    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, ModelShape, init_shaped_model

    cuda = not ns.cpu_check
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = QWEN3_0_6B_SHAPE if cuda else ModelShape(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=32,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = init_shaped_model(Path(tmp) / "m", shape, dtype="bfloat16" if cuda else "float32", device=str(device))
        model = load_model(path, dtype=dtype, device=device).eval()
    n, max_len = ns.batch, ns.position + 64
    cache = KVCache.allocate(model.args, n, max_len, dtype, device)
    assert cache.buffer is not None
    cache.buffer.normal_(0.0, 1.0)
    gen = torch.Generator(device=device).manual_seed(0)
    plain = DecodeRunner(model, cache, max_batch=n, device=device, mode="graph" if cuda else "eager")
    inv = DecodeRunner(model, cache, max_batch=n, device=device, mode="invariant")
    for r in (plain, inv):
        r.tokens.copy_(torch.randint(3, shape.vocab_size, (n,), generator=gen, device=device))
        r.positions.fill_(ns.position)

    def step_plain() -> torch.Tensor:
        return plain.fast_forward(n) if cuda else plain.torch_forward(n)

    if cuda and invariant.fusable(model.args):
        inv._fuse_weights()  # as the engine's graphed step does: stacked q/k/v and gate/up GEMMs

    def step_inv() -> torch.Tensor:
        return inv._invariant_forward(n)

    summary = {}
    with torch.no_grad():
        for name, fn in (("plain", step_plain), ("invariant", step_inv)):
            for _ in range(2):
                fn()
            if cuda:
                torch.cuda.synchronize()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                fn()
                if cuda:
                    torch.cuda.synchronize()
            rows = []
            for ev in prof.key_averages():
                dev_us = getattr(ev, "self_device_time_total", 0.0) if cuda else ev.self_cpu_time_total
                if dev_us > 0 and (not cuda or ev.device_type.name == "CUDA"):
                    rows.append((dev_us, ev.count, ev.key))
            rows.sort(reverse=True)
            total = sum(r[0] for r in rows)
            print(f"== {name}: eager step, kernel time {total / 1000:.3f} ms in {sum(r[1] for r in rows)} launches")
            for us, count, key in rows[: ns.top]:
                print(f"  {us / 1000:8.3f} ms {100 * us / total:5.1f}%  x{count:<4d} {key[:110]}")
            summary[name] = total / 1000
            if cuda:
                graph = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph):
                    fn()
                times = []
                for _ in range(ns.steps + 1):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graph.replay()
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b))
                summary[name + "_graph"] = statistics.median(times[1:])
    line = " ".join(f"{k}={v:.3f}ms" for k, v in summary.items())
    ratio = summary.get("invariant_graph", 0.0) / summary["plain_graph"] if "plain_graph" in summary else float("nan")
    print(f"decode-profile: batch {n} position {ns.position} {line} graph ratio {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
