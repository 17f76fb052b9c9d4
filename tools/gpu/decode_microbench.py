"""Where a decode step's time goes, at Qwen3-0.6B's shape in bf16 (random weights, in memory).

    PYTHONPATH=. python3 tools/gpu/decode_microbench.py --out $OUT

Measures (CUDA events, median of repeats): the device's copy bandwidth and bf16 matmul rate (the
ceilings); prefill; one decode forward at batch B with every row at attention length L, eagerly
(`forward_cached`: masked SDPA), with the fused kernels launched one by one, and as a CUDA graph
replay; the torch sampler against the fused sampling kernel; the decode-attention kernel alone in
several launch configurations (GB/s against the K/V bytes it must read); and a torch.profiler
kernel table of one fused step. Checks the fused step's logits against the eager forward. Prints a
table last and writes microbench.json; writes the best attention/sampling launch configs to
best_attn_config.txt / best_sample_config.txt for the engine (engine.kernels.attn_config, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from hpcrl.engine.embedded import fused_prefill  # noqa: E402
from hpcrl.engine.embedded.kernels import attention as attention_kernels  # noqa: E402
from hpcrl.engine.embedded.kernels import launch, sampler  # noqa: E402
from hpcrl.engine.embedded.runner import DecodeRunner  # noqa: E402
from hpcrl.engine.embedded.sampling import RowParams, sample  # noqa: E402
from hpcrl.engine.embedded.step_output import RowState  # noqa: E402
from hpcrl.model.qwen3 import CausalLM, KVCache, ModelArgs  # noqa: E402
from hpcrl.model.tiny import QWEN3_0_6B_SHAPE  # noqa: E402


def cuda_ms(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn: Callable[[], Any], launches: int = 20, reps: int = 10) -> float:
    """Device time of one fn() as the engine runs it: `launches` calls captured in one CUDA graph, replays timed.

    Events around a single eager launch of a ~0.1 ms Triton kernel also time the host's launch (tens of
    microseconds of Python argument handling while the device idles), which the engine's graphs never pay.
    """
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return cuda_ms(graph.replay, reps=reps, warmup=2) / launches


SECTIONS: set[str] | None = None


def section(name: str, results: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> None:
    if SECTIONS is not None and name not in SECTIONS:
        return
    t0 = time.perf_counter()
    try:
        out = fn()
        results.update(out)
        print(f"[{name}] {json.dumps(out)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    except Exception:  # noqa: BLE001 - one failing section must not hide the others
        results[f"{name}_error"] = traceback.format_exc()
        print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)


def build_model(dtype: torch.dtype) -> CausalLM:
    s = QWEN3_0_6B_SHAPE
    args = ModelArgs(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_layers=s.num_layers,
        num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        eos_token_ids=(2,),
    )
    with torch.device("meta"):
        model = CausalLM(args)
    model = model.to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.to(dtype).eval()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--attn-len", type=int, default=384, help="every row's attention length in the decode timings")
    p.add_argument("--context", type=int, default=640)
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto", help="auto: the model's bf16")
    p.add_argument("--out", default=".")
    p.add_argument(
        "--prefill-profile-tokens",
        type=int,
        default=4096,
        help="prompt tokens in prefill_profile's batch (4096: the engine's default chunk; the 256 x 128 throughput "
        "bench prefills 32768 in one forward)",
    )
    p.add_argument("--sections", default="all", help="comma-separated section names to run (default: all)")
    ns = p.parse_args()
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    global SECTIONS
    SECTIONS = None if ns.sections == "all" else set(ns.sections.split(","))
    torch.set_grad_enabled(False)
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    B, L = ns.batch, ns.attn_len
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    results["kv_cache_dtype"] = ns.kv_cache_dtype
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    print(json.dumps(results), flush=True)

    def ceilings() -> dict[str, Any]:
        x = torch.empty(1 << 32, dtype=torch.uint8, device=dev).random_()
        y = torch.empty_like(x)
        ms = cuda_ms(lambda: y.copy_(x), reps=10)
        a = torch.randn(8192, 8192, device=dev, dtype=dtype)
        b = torch.randn(8192, 8192, device=dev, dtype=dtype)
        mm = cuda_ms(lambda: a @ b, reps=10)
        return {"copy_GBps": 2 * x.numel() / ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm / 1e9}

    section("ceilings", results, ceilings)

    model = build_model(dtype)
    a = model.args
    cache_dtype = torch.float8_e4m3fn if ns.kv_cache_dtype == "fp8_e4m3" else dtype
    cache = KVCache.allocate(a, B, ns.context, cache_dtype, dev)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    kv_bytes_step = a.num_layers * 2 * B * a.num_kv_heads * L * a.head_dim * cache.k[0].element_size()
    results.update({"weight_bytes": weight_bytes, "kv_bytes_read_per_step": kv_bytes_step})
    gen = torch.Generator(device=dev).manual_seed(1)

    def prefill() -> dict[str, Any]:
        ids = torch.randint(3, a.vocab_size, (B, ns.prompt_len), device=dev, generator=gen)
        zeros = torch.zeros(B, dtype=torch.int64, device=dev)
        last = torch.full((B,), ns.prompt_len - 1, device=dev)
        ms = cuda_ms(lambda: model.forward_cached(ids, cache, 0, zeros, last, from_start=True), reps=3, warmup=1)
        # Fill every row's cache up to L with random K/V so the decode timings read real data.
        for t in cache.k + cache.v:
            fill = torch.randn(t[:, :, ns.prompt_len : L].shape, device=dev, dtype=dtype, generator=gen)
            t[:, :, ns.prompt_len : L] = fill.to(t.dtype)
        return {"prefill_ms": ms, "prefill_tok_s": B * ns.prompt_len / ms * 1e3}

    section("prefill", results, prefill)

    def prefill_profile() -> dict[str, Any]:
        # The engine prefills in batches of max_prefill_tokens (4096 by default: 32 prompts of 128); the kernels
        # of one.
        from torch.profiler import ProfilerActivity, profile

        rows = max(1, min(B, ns.prefill_profile_tokens // ns.prompt_len))
        tokens = rows * ns.prompt_len
        ids = torch.randint(3, a.vocab_size, (rows, ns.prompt_len), device=dev, generator=gen)
        zeros = torch.zeros(rows, dtype=torch.int64, device=dev)
        last = torch.full((rows,), ns.prompt_len - 1, device=dev)
        fused, rope = DecodeRunner(model, cache, max_batch=B, device=dev, mode="triton")._kernel_tables()
        paths: dict[str, Callable[[], torch.Tensor]] = {
            "model": lambda: model.forward_cached(ids, cache, 0, zeros, last, from_start=True),
            "fused": lambda: fused_prefill.prefill_logits(model, cache, fused, rope, ids, 0, last),
        }
        out: dict[str, Any] = {}
        for name, fn in paths.items():
            out[f"prefill_{tokens}_tokens_{name}_ms"] = cuda_ms(fn, reps=5, warmup=2)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            events = prof.key_averages()
            key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
            table = events.table(sort_by=key, row_limit=20, max_name_column_width=70)
            (out_dir / f"profile_prefill_{name}.txt").write_text(table)
            print(f"prefill path {name}:\n{table}", flush=True)
        # The same logits both ways (bf16: the kernels round as the modules do, in another order of ops).
        ref, got = paths["model"]().float(), paths["fused"]().float()
        out["prefill_fused_rel_err"] = ((got - ref).norm() / ref.norm()).item()
        out["prefill_fused_same_argmax"] = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        return out

    section("prefill_profile", results, prefill_profile)

    runner = DecodeRunner(model, cache, max_batch=B, device=dev, mode="graph")
    toks = torch.randint(3, a.vocab_size, (B,), generator=torch.Generator().manual_seed(2)).tolist()
    runner.write_rows([RowState(toks[i], L - 1, i, 0, 1.0, -1, 1.0, 0.0) for i in range(B)])
    zeros = torch.zeros(B, dtype=torch.int64, device=dev)

    def eager_forward() -> torch.Tensor:
        return model.forward_cached(runner.slots.tokens[:, None], cache, 0, runner.slots.positions, zeros)

    def correctness() -> dict[str, Any]:
        # Both bf16 paths against the same model in fp32 (first 32 rows; the fp32 cache is a copy).
        m = 32
        with torch.device("meta"):
            model32 = CausalLM(a)
        model32 = model32.to_empty(device=dev)
        model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        cache32 = KVCache.allocate(a, m, ns.context, torch.float32, dev)
        for src, dst in zip(cache.k + cache.v, cache32.k + cache32.v, strict=True):
            dst.copy_(src[:m])
        ref = model32.forward_cached(
            runner.slots.tokens[:m, None], cache32, 0, runner.slots.positions[:m], zeros[:m]
        ).float()
        del model32, cache32
        eager = eager_forward()[:m].float()
        fast = runner.fast_forward(B)[:m].float()

        def rel(x: torch.Tensor) -> float:
            return ((x - ref).norm() / ref.norm()).item()

        def agree(x: torch.Tensor) -> float:
            return (x.argmax(-1) == ref.argmax(-1)).float().mean().item()

        return {
            "eager_bf16_vs_fp32_rel_err": rel(eager),
            "fused_bf16_vs_fp32_rel_err": rel(fast),
            "eager_bf16_vs_fp32_argmax_agree": agree(eager),
            "fused_bf16_vs_fp32_argmax_agree": agree(fast),
        }

    section("correctness", results, correctness)
    section("eager_forward", results, lambda: {"eager_forward_ms": cuda_ms(eager_forward, reps=5, warmup=1)})
    section("triton_forward", results, lambda: {"triton_forward_ms": cuda_ms(lambda: runner.fast_forward(B))})

    def graph_forward() -> dict[str, Any]:
        t0 = time.perf_counter()
        graph, _ = runner._graph(B)
        capture = time.perf_counter() - t0
        return {"graph_capture_s": capture, "graph_forward_ms": cuda_ms(graph.replay, reps=30)}

    section("graph_forward", results, graph_forward)

    logits = torch.randn(B, a.vocab_size, device=dev, generator=gen).mul_(2).to(dtype)
    params = RowParams(
        temperature=torch.ones(B, device=dev),
        top_k=torch.full((B,), -1, device=dev),
        top_p=torch.ones(B, device=dev),
        min_p=torch.zeros(B, device=dev),
        seeds=torch.arange(B, device=dev),
        steps=torch.zeros(B, dtype=torch.int64, device=dev),
    )
    out_tok = torch.empty(B, dtype=torch.int64, device=dev)
    out_lp = torch.empty(B, 2, device=dev)

    def samplers() -> dict[str, Any]:
        res: dict[str, Any] = {"torch_sample_ms": cuda_ms(lambda: sample(logits, params, want_support=False), reps=5)}
        best = None
        for cfg in [(256, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8), (512, 2), (1024, 2)]:

            def run(cfg: tuple[int, ...] = cfg) -> None:
                sampler.sample_rows(logits, params.temperature, params.seeds, params.steps, out_tok, out_lp, config=cfg)

            ms = graph_ms(run, launches=10)  # device time, as in the engine's loop (no host launch in it)
            res[f"fused_sample_ms_{'x'.join(map(str, cfg))}"] = ms
            if best is None or ms < best[0]:
                best = (ms, cfg)
        ref = sample(logits, params, want_support=False)
        sampler.sample_rows(logits, params.temperature, params.seeds, params.steps, out_tok, out_lp)
        res["fused_sample_token_agree"] = (out_tok == ref.token_ids).float().mean().item()
        res["fused_sample_lp_maxdiff"] = (out_lp[:, 0] - ref.logprobs).abs().max().item()
        assert best is not None
        (out_dir / "best_sample_config.txt").write_text(",".join(map(str, best[1])))
        res["best_sample_config"] = best[1]
        return res

    section("samplers", results, samplers)

    def attention() -> dict[str, Any]:
        q = torch.randn(B, a.num_heads * a.head_dim, device=dev, dtype=dtype)
        o = torch.empty_like(q)
        pos = torch.full((B,), L - 1, device=dev)
        layer_bytes = 2 * B * a.num_kv_heads * L * a.head_dim * 2
        res: dict[str, Any] = {}
        best = None
        # (BLOCK_N, warps, stages, use_dot); use_dot=0 (CUDA-core dot products) ran at ~1 TB/s on an H200.
        configs = [(64, 4, 3, 1), (64, 4, 2, 1), (128, 4, 3, 1), (32, 4, 3, 1), (32, 4, 4, 1), (32, 2, 3, 1)]
        configs += [(32, 2, 4, 1), (16, 2, 4, 1), (16, 4, 4, 1), (32, 8, 3, 1), (64, 8, 3, 1), (32, 4, 2, 0)]
        for cfg in configs:

            def run(cfg: tuple[int, ...] = cfg) -> None:
                attention_kernels.decode_attention(
                    q, cache.k[0], cache.v[0], pos, o, a.num_heads, a.num_kv_heads, a.head_dim, 0.088, config=cfg
                )

            try:
                ms = cuda_ms(run, reps=30)
            except Exception as exc:  # noqa: BLE001 - a config may exceed shared memory
                res[f"attn_{'x'.join(map(str, cfg))}"] = f"failed: {type(exc).__name__}"
                continue
            res[f"attn_GBps_{'x'.join(map(str, cfg))}"] = layer_bytes / ms / 1e6
            if best is None or ms < best[0]:
                best = (ms, cfg)
        assert best is not None
        res["attn_best_config"] = best[1]
        res["attn_best_ms_per_layer"] = best[0]
        (out_dir / "best_attn_config.txt").write_text(",".join(map(str, best[1])))
        # The eager path's attention for one layer: boolean mask over the cache slice, GQA in SDPA.
        qh = q.view(B, a.num_heads, 1, a.head_dim)
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device=dev)
        res["eager_sdpa_ms_per_layer"] = cuda_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(
                qh, cache.k[0][:, :, :L], cache.v[0][:, :, :L], attn_mask=mask, enable_gqa=True
            ),
            reps=10,
        )
        return res

    section("attention", results, attention)

    def loop_steps(steps: int = 64) -> float:
        """Seconds a step of the engine's real loop body: launch (graph + fused sampler + async copy), read the
        previous step's outputs."""
        warm_rows()
        t0 = time.perf_counter()
        run_loop(steps)
        return (time.perf_counter() - t0) / steps

    def warm_rows() -> None:
        """Every row at position L - 1, after three steps that compile the sampler's state-advancing variant."""
        runner.write_rows([RowState(toks[i], L - 1, i, 0, 1.0, -1, 1.0, 0.0) for i in range(B)])
        for _ in range(3):
            runner.decode(B, torch_sampler=False, want_support=False).result()
        runner.write_rows([RowState(toks[i], L - 1, i, 0, 1.0, -1, 1.0, 0.0) for i in range(B)])
        torch.cuda.synchronize()

    def run_loop(steps: int) -> None:
        """The engine's loop body: launch a step, then read the one before (it overlaps the device's work)."""
        prev = None
        for _ in range(steps):
            h = runner.decode(B, torch_sampler=False, want_support=False)
            if prev is not None:
                prev.result()
            prev = h
        assert prev is not None
        prev.result()

    def full_steps() -> dict[str, Any]:
        dt = loop_steps()
        return {"full_step_ms": dt * 1e3, "full_step_tok_s": B / dt}

    section("full_steps", results, full_steps)

    def step_trace(steps: int = 12) -> dict[str, Any]:
        """The device's timeline of the engine's loop body (graph replay, sampler, output copies) under
        torch.profiler: per step, the kernels' summed time against the span from the first kernel's start to the
        next step's first, where the idle time between consecutive operations lies (by the pair of kernel kinds
        around it; the part of a step that no kernel fills is what fewer launches could win), and each kind's
        share of the step (trace_slot_ms)."""
        from torch.profiler import ProfilerActivity, profile

        warm_rows()
        trace = out_dir / "step_trace.json"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_loop(steps)
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        ops = sorted(
            (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
            key=lambda e: e["ts"],
        )

        def kind(e: dict[str, Any]) -> str:
            name = str(e["name"])
            if e["cat"] != "kernel":
                return e["cat"]
            for key in ("attention", "rmsnorm", "qk_norm", "silu", "sample_partial", "sample_combine", "embed"):
                if key in name:
                    return key
            return "gemm" if ("gemm" in name or "sm90" in name or "cutlass" in name or "nvjet" in name) else name[:40]

        # A step starts at the first operation after the last step's sampler and output copies.
        ends = ("gpu_memcpy", "sample_combine")
        starts = [i for i in range(1, len(ops)) if kind(ops[i - 1]) in ends and kind(ops[i]) not in ends]
        out: dict[str, Any] = {"trace_ops": len(ops), "trace_steps": max(0, len(starts) - 1)}
        if len(starts) < 3:
            out["trace_note"] = "fewer than 3 step starts found in the trace"
            return out
        gaps: dict[str, float] = {}
        # Time from the end of the operation before to each one's end, by kind: with programmatic dependent launch
        # a kernel starts (and waits) before the one ahead of it ends, so durations overlap; ends come in order,
        # so these intervals do not overlap, add up to the step, and give each kernel the time it took once it
        # could run.
        slots: dict[str, float] = {}
        counts: dict[str, int] = {}
        busy = span = 0.0
        per_step_ops = 0
        for a, b in zip(starts[1:-1], starts[2:], strict=True):  # skip the first (it may hold warm-up effects)
            seg = ops[a : b + 1]
            span += seg[-1]["ts"] - seg[0]["ts"]
            per_step_ops = b - a
            for x, y in zip(seg[:-1], seg[1:], strict=True):
                busy += x["dur"]
                gap = y["ts"] - (x["ts"] + x["dur"])
                key = f"{kind(x)} -> {kind(y)}"
                gaps[key] = gaps.get(key, 0.0) + gap
                slots[kind(y)] = slots.get(kind(y), 0.0) + (y["ts"] + y["dur"]) - (x["ts"] + x["dur"])
                counts[kind(y)] = counts.get(kind(y), 0) + 1
        n = len(starts) - 2
        out.update({
            "trace_ops_per_step": per_step_ops,
            "trace_step_span_ms": span / n / 1e3,
            "trace_step_busy_ms": busy / n / 1e3,
            "trace_step_idle_ms": (span - busy) / n / 1e3,
        })  # fmt: skip
        for key, total in sorted(gaps.items(), key=lambda kv: -kv[1])[:12]:
            out[f"trace_gap_ms {key}"] = total / n / 1e3
        for key, total in sorted(slots.items(), key=lambda kv: -kv[1]):
            out[f"trace_slot_ms {key} (x{counts[key] // n})"] = total / n / 1e3
        return out

    section("step_trace", results, step_trace)

    def attn_batch() -> dict[str, Any]:
        """The 8-bit (or bf16) attention kernel at the default config against the batch: time per row at a fixed
        length. Rows run as (row, kv head) programs; if time per row falls as the batch grows past one wave of
        resident programs and rises at a partial wave, the last wave's idle SMs are a lever."""
        q = torch.randn(B, a.num_heads * a.head_dim, device=dev, dtype=dtype)
        o = torch.empty_like(q)
        res: dict[str, Any] = {}
        for rows in sorted({32, 64, 96, 128, 160, 192, 224, B}):
            if rows > B:
                continue
            pos = torch.full((rows,), L - 1, device=dev)

            def run(rows: int = rows, pos: torch.Tensor = pos) -> None:
                attention_kernels.decode_attention(
                    q[:rows], cache.k[0], cache.v[0], pos, o[:rows], a.num_heads, a.num_kv_heads, a.head_dim, 0.088
                )

            ms = graph_ms(run, launches=20)
            res[f"attn_rows_{rows}_ms"] = ms
            res[f"attn_rows_{rows}_us_per_row"] = ms * 1e3 / rows
        return res

    section("attn_batch", results, attn_batch)

    def step_variants() -> dict[str, Any]:
        # Variants of the same decode step, in one process: programmatic dependent launch of the Triton kernels
        # (engine.kernels.pdl) and torch's GEMMs through cuBLASLt instead of cuBLAS. Each is captured
        # afresh; rounds interleave the variants so that clock drift spreads over all of them. Neither may change
        # the logits: step_logits_maxdiff_* is the largest difference over the rounds. (Two half-batches on two streams
        # and an L2 prefetch of each GEMM's weights were both slower.)
        variants = {  # name: (pdl, blas library)
            "plain": (False, "cublas"),
            "pdl": (True, "cublas"),
            "cublaslt": (False, "cublaslt"),
        }
        graph_times: dict[str, list[float]] = {k: [] for k in variants}
        loop_times: dict[str, list[float]] = {k: [] for k in variants}
        out: dict[str, Any] = {}
        ref: torch.Tensor | None = None
        default_knobs, default_blas = launch.SETTINGS, torch.backends.cuda.preferred_blas_library()
        try:
            for _ in range(3):
                for name, (pdl, blas) in variants.items():
                    launch.configure(dataclasses.replace(default_knobs, pdl=pdl))
                    torch.backends.cuda.preferred_blas_library(blas)
                    runner.reset_graphs()
                    runner.write_rows([RowState(toks[i], L - 1, i, 0, 1.0, -1, 1.0, 0.0) for i in range(B)])
                    graph, logits = runner._graph(B)
                    graph_times[name].append(cuda_ms(graph.replay, reps=30))
                    got = logits.float()
                    if ref is None:
                        ref = got.clone()
                    diff = (got - ref).abs().max().item()
                    out[f"step_logits_maxdiff_{name}"] = max(diff, out.get(f"step_logits_maxdiff_{name}", 0.0))
                    loop_times[name].append(loop_steps() * 1e3)
        finally:
            launch.configure(default_knobs)
            torch.backends.cuda.preferred_blas_library(default_blas)
            runner.reset_graphs()
        for name in variants:
            out[f"step_graph_ms_{name}"] = statistics.median(graph_times[name])
            out[f"step_loop_ms_{name}"] = statistics.median(loop_times[name])
        return out

    section("step_variants", results, step_variants)

    def profile() -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        runner.write_rows([RowState(toks[i], L - 1, i, 0, 1.0, -1, 1.0, 0.0) for i in range(B)])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                logits = runner.fast_forward(B)
                sampler.sample_rows(
                    logits, runner.slots.temperature, runner.slots.seeds, runner.slots.steps, out_tok, out_lp
                )
            torch.cuda.synchronize()
        events = prof.key_averages()
        key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        table = events.table(sort_by=key, row_limit=18, max_name_column_width=60)
        (out_dir / "profile_fused_step.txt").write_text(table)
        print(table, flush=True)
        return {}

    section("profile", results, profile)

    (out_dir / "microbench.json").write_text(json.dumps(results, indent=2))
    print("\n| measure | value |\n|---|---:|")
    for k, v in results.items():
        if k.endswith("_error"):
            continue
        print(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    ideal = (weight_bytes + kv_bytes_step) / (results.get("copy_GBps", 4200) * 1e6)
    print(f"| bytes floor per step (weights + K/V at the measured copy rate), ms | {ideal:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
