"""The fused sampler alone on a GPU: its device time a step and its agreement with the torch sampler.

Run from a tree's root (its `hpcrl` is the one timed), e.g. once in this tree and once in a baseline's copy, in one
device call, to compare two samplers on the same machine:

    python3 tools/gpu/sampler_ab.py --label new
    (cd .carry/ab && PYTHONPATH=. python3 ../../tools/gpu/sampler_ab.py --label baseline)

Logits: [rows, vocab] bf16, N(0, 2^2) (as `decode_microbench.py samplers`), Qwen3's 151,936 ids by default.
Time: CUDA-graph replays of `--launches` calls, so no host launch is counted (as in the engine's loop).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from hpcrl.engine.embedded import kernels
from hpcrl.engine.embedded.sampling import RowParams, sample


def graph_ms(fn: Callable[[], None], launches: int, reps: int) -> float:
    # decode_microbench.py's graph_ms again: importing that script would import its hpcrl names from the tree
    # under test, and an older tree may lack some of them.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="this tree", help="the name printed with the figures")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--launches", type=int, default=20, help="sampler calls in one captured graph")
    ap.add_argument("--reps", type=int, default=15, help="graph replays; the median is printed")
    ap.add_argument("--profile", action="store_true", help="also each kernel's device time (torch.profiler), T=1")
    ns = ap.parse_args()
    if not torch.cuda.is_available() or not kernels.AVAILABLE:
        raise SystemExit("sampler_ab.py needs a CUDA device and Triton")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(ns.rows, ns.vocab, device=dev, generator=gen).mul_(2).to(torch.bfloat16)
    result: dict[str, object] = {"label": ns.label, "rows": ns.rows, "vocab": ns.vocab}
    ones = torch.ones(ns.rows, device=dev)
    seeds1 = torch.arange(ns.rows, device=dev)
    steps1 = torch.zeros(ns.rows, dtype=torch.int64, device=dev)
    tok1 = torch.empty(ns.rows, dtype=torch.int64, device=dev)
    lp1 = torch.empty(ns.rows, 2, device=dev)
    for temperature in (1.0, 0.7):
        temp = torch.full((ns.rows,), temperature, device=dev)
        seeds = torch.arange(ns.rows, device=dev) * 7919 + 3
        steps = torch.zeros(ns.rows, dtype=torch.int64, device=dev)
        tok = torch.empty(ns.rows, dtype=torch.int64, device=dev)
        lp = torch.empty(ns.rows, 2, device=dev)
        args = (logits, temp, seeds, steps, tok, lp)

        def run(args: tuple[torch.Tensor, ...] = args) -> None:
            kernels.sample_rows(args[0], args[1], args[2], args[3], args[4], args[5])

        result[f"fused_ms_T{temperature}"] = graph_ms(run, ns.launches, ns.reps)
        run()
        params = RowParams(
            temperature=temp,
            top_k=torch.full((ns.rows,), -1, device=dev),
            top_p=torch.ones(ns.rows, device=dev),
            min_p=torch.zeros(ns.rows, device=dev),
            seeds=seeds,
            steps=steps,
        )
        ref = sample(logits, params, want_support=False)
        same = tok == ref.token_ids
        result[f"token_agree_with_torch_T{temperature}"] = same.float().mean().item()
        # Over the rows that drew the same token: another token has another log-prob, which says nothing.
        result[f"logprob_maxdiff_T{temperature}"] = (lp[same, 0] - ref.logprobs[same]).abs().max().item()
        result[f"scaled_logprob_maxdiff_T{temperature}"] = (lp[same, 1] - ref.scaled_logprobs[same]).abs().max().item()
    if ns.profile:
        result["kernel_us_T1"] = kernel_us(lambda: kernels.sample_rows(logits, ones, seeds1, steps1, tok1, lp1))
    print(json.dumps(result), flush=True)


def kernel_us(fn: Callable[[], None], calls: int = 10) -> dict[str, float]:
    """Each kernel's device time a call, in us, from torch.profiler over eager calls: the pass and the draw apart
    (their names are the same in older trees, so a baseline tree reads the same way)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        total = getattr(event, "self_device_time_total", None)
        if total is None:
            total = event.self_cuda_time_total
        if total > 0:
            out[event.key] = round(total / calls, 2)
    return out


if __name__ == "__main__":
    main()
