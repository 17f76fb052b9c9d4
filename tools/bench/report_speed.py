"""Time of ``hpcrl report`` (read + summary + plots) on a synthetic 10,000-step metrics.h5, against baselines.

    python tools/bench/report_speed.py [--steps 10000] [--repeats 3] [--keep DIR]

The file is written by MetricsWriter with the keys a real run logs (rollout/*, train/*, timing/*, sync/*)
plus every optional group the report handles (guard/* for 8 GPUs on 2 nodes, queue/*, memory/*) and
events (preemptions, engine restarts, thermal pauses): the worst case for the report, 56 columns.
Target: a few seconds for 10,000 steps.

Variants, each timed by phase (median of --repeats rounds; the variants alternate within a round so that
load from other processes on a shared machine hits them alike):
- ``hpcrl``: what ``hpcrl report`` does: ``load_run`` (one slice per dataset), NumPy summary, plots with
  curves past 1,000 steps drawn as bin means with a min-max band, fixed figure margins.
- ``full-res plots``: the same, every step drawn (``max_points`` = number of steps).
- ``constrained layout``: the same, with matplotlib's constrained layout engine instead of fixed margins
  (the usual choice; it draws each figure twice).
- ``pandas`` (read + summary): ``load_metrics_frame`` and a pandas summary (``head/tail/median/diff``).
- ``per-row h5py`` (read + summary): a reader that walks the file row by row, ``ds[i]`` per dataset and
  step, as a line-per-step log parser would.
Last line: the whole command, ``python -m hpcrl.report.cli report DIR`` in a fresh process
(interpreter start, imports, read, summary, plots, markdown), as a user runs it.
"""

from __future__ import annotations

import argparse
import importlib
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl.store.metrics import MetricsWriter

NODES = ("node0", "node1")
GPUS_PER_NODE = 4
NODES_GPUS = [(node, gpu) for node in NODES for gpu in range(GPUS_PER_NODE)]


def synthesize(path: Path, num_steps: int, seed: int = 0) -> None:
    """A run-shaped metrics.h5: learning curves, noisy timings, heating GPUs with pauses, preemptions."""
    rng = np.random.default_rng(seed)
    t = np.arange(num_steps)
    reward = 0.9 / (1 + np.exp(-(t - num_steps * 0.3) / (num_steps * 0.08))) + rng.normal(0, 0.05, num_steps)
    length = 6 + 3 * np.exp(-t / (num_steps * 0.2)) + rng.normal(0, 0.3, num_steps)
    temps = {ng: 65.0 for ng in NODES_GPUS}
    heat = {ng: 0.0 for ng in NODES_GPUS}
    paused: dict[str, int] = {}  # node -> step its pause began
    clock_s = 1.7e9
    # Rows are flushed 500 at a time: per-step flushes would make synthesis, not the report, the slow part.
    with MetricsWriter(
        path, flush_every_steps=500, flush_interval_s=1e9, root_attrs={"config": "num_steps: 10000\n"}
    ) as w:
        for step in range(num_steps):
            phases = {
                p: float(rng.lognormal(math.log(s), 0.2))
                for p, s in [("rollout", 0.8), ("reward", 0.01), ("train", 0.5), ("sync", 0.1)]
            }
            phases["logprob"] = phases["train"] * 0.3
            phases["checkpoint"] = 3.0 if step % 500 == 499 else 1e-5
            total = sum(v for k, v in phases.items() if k != "logprob") + 0.02
            row = {f"timing/{k}_s": v for k, v in phases.items()} | {"timing/total_s": total}
            row |= {
                "rollout/reward_mean": reward[step],
                "rollout/response_len_mean": length[step],
                "rollout/response_len_median": round(length[step]),
                "rollout/response_len_max": 16.0,
                "rollout/truncated_share": max(0.0, 0.2 * math.exp(-step / 2000) + rng.normal(0, 0.01)),
                "rollout/aborted_share": 0.0,
                "rollout/zero_std_group_share": float(rng.uniform(0, 0.3)),
                "rollout/reward_failed_share": 0.0,
                "rollout/tokens_per_s": 2048 * length[step] / phases["rollout"],
                "rollout/num_samples": 2048.0,
                "sync/seconds": phases["sync"],
                "sync/bytes": 1.2e9,
                "sync/num_buckets": 8.0,
                "queue/size": float(rng.integers(0, 64)),
                "queue/staleness_mean": float(rng.uniform(0, 2)),
                "memory/rollout_gb": 60 + rng.normal(0, 1),
                "memory/train_gb": 110 + rng.normal(0, 1),
            }
            row |= {f"train/{k}": float(rng.normal(0, 1)) for k in ("loss", "pg_loss", "ppo_kl", "grad_norm")}
            row |= {
                "train/pg_clipfrac": float(rng.uniform(0, 0.1)),
                "train/entropy": 1.5 - step / num_steps,
                "train/train_rollout_logprob_abs_diff": float(rng.lognormal(math.log(2e-3), 0.3)),
                "train/train_rollout_kl": float(rng.lognormal(math.log(1e-5), 0.3)),
                "train/train_rollout_logprob_max_abs_diff": float(rng.lognormal(math.log(0.3), 0.3)),
                "train/num_tokens": 2048 * length[step],
                "train/nan_skipped": 0.0,
            }
            # One guard per node, as hpcrl.guard does: it pauses when any GPU of the node reaches 84 C and
            # resumes when all are back at 72 C, naming the hottest GPU; a paused node cools ~1.5 C per step.
            for node in NODES:
                gpus = [(node, gpu) for gpu in range(GPUS_PER_NODE)]
                for key in gpus:
                    drift = 0.01 * (74.0 - temps[key]) + heat[key] + rng.normal(0, 0.4)
                    temps[key] += -1.5 if node in paused else drift
                    heat[key] = 0.995 * heat[key] + rng.normal(0, 0.004)
                    row[f"guard/peak_temp_c/{node}/{key[1]}"] = temps[key]
                hottest = max(gpus, key=temps.__getitem__)
                detail = {"node": node, "gpu": hottest[1], "temperature_c": temps[hottest]}
                if node not in paused and temps[hottest] >= 84.0:
                    paused[node] = step
                    w.event("thermal_pause", step=step, detail=detail, time_s=clock_s)
                elif node in paused and temps[hottest] <= 72.0:
                    detail["duration_s"] = 40.0 * (step - paused.pop(node) + 1)
                    w.event("thermal_resume", step=step, detail=detail, time_s=clock_s)
            step_paused_s = 40.0 if paused else 0.0
            row["guard/paused_s"] = step_paused_s
            w.log(step, row)
            clock_s += total + step_paused_s
            if step % 2500 == 1200:
                w.event("preempted", step=step, detail={"signal": "SIGUSR2"}, time_s=clock_s)
                clock_s += 600.0
                w.event("resumed", step=step, detail={"checkpoint": f"step_{step:08d}.h5"}, time_s=clock_s)
            if step % 3000 == 2000:
                w.event("engine_dead", step=step, detail={"engine": 0}, time_s=clock_s)
                w.event("engine_restarted", step=step, detail={"engine": 0}, time_s=clock_s + 45.0)
        w.event("finished", step=num_steps - 1, detail={}, time_s=clock_s)


def time_report(path: Path, out_dir: Path, *, read: str, max_points: int | None) -> dict[str, float]:
    """Seconds per phase of one report; ``max_points=None`` skips the plots."""
    from hpcrl.report.plots import plot_run
    from hpcrl.report.run import load_run
    from hpcrl.report.summary import render_markdown, summarize

    t0 = time.perf_counter()
    if read == "pandas":
        frame = read_with_pandas(path)
        t1 = time.perf_counter()
        summarize_with_pandas(frame)
    else:
        run = load_run(path) if read == "hpcrl" else read_per_row(path)
        t1 = time.perf_counter()
        render_markdown(summarize(run), run.attrs)
    t2 = time.perf_counter()
    if max_points is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        assert len(plot_run(run, out_dir, max_points=max_points)) == 8
    t3 = time.perf_counter()
    times = {"read": t1 - t0, "summary": t2 - t1, "plots": t3 - t2, "total": t3 - t0}
    if max_points is None:
        del times["plots"]
    return times


@contextmanager
def constrained_layout() -> Iterator[None]:
    """Makes hpcrl's figures use matplotlib's constrained layout engine, as the baseline does."""
    from hpcrl.report import plots

    fixed = plots._figure

    def with_engine(*args: Any, **kwargs: Any) -> Any:
        fig, axes = fixed(*args, **kwargs)
        fig.set_layout_engine("constrained")
        return fig, axes

    plots._figure = with_engine
    try:
        yield
    finally:
        plots._figure = fixed


def time_constrained(path: Path, out_dir: Path) -> dict[str, float]:
    with constrained_layout():
        return time_report(path, out_dir, read="hpcrl", max_points=1000)


def time_cli(run_dir: Path, out_dir: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "hpcrl.report.cli", "report", str(run_dir), "-o", str(out_dir)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {"total": time.perf_counter() - t0}


def read_with_pandas(path: Path) -> Any:
    from hpcrl.store.metrics import load_events, load_metrics_frame

    load_events(path)
    return load_metrics_frame(path)


def summarize_with_pandas(frame: Any) -> object:
    n = 10
    keys = [
        "rollout/reward_mean",
        "rollout/response_len_mean",
        "rollout/truncated_share",
        "train/train_rollout_logprob_abs_diff",
    ]
    first, last = frame[keys].head(n).mean(), frame[keys].tail(n).mean()
    timing = frame.filter(like="timing/").median()
    jump = frame["rollout/reward_mean"].diff().abs().idxmax()
    return first, last, timing, jump


def read_per_row(path: Path) -> object:
    import h5py

    from hpcrl.report.run import RunData
    from hpcrl.store.metrics import load_events, load_root_attrs

    with h5py.File(path, "r", locking=False) as f:
        names: list[str] = []
        f["metrics"].visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        datasets = [f["metrics"][name] for name in names]
        num_rows = datasets[0].shape[0]
        rows = [[float(ds[i]) for ds in datasets] for i in range(num_rows)]
    columns = {name: np.array(col) for name, col in zip(names, zip(*rows, strict=True), strict=True)}
    return RunData(
        name=path.parent.name, path=path, metrics=columns, events=load_events(path), attrs=load_root_attrs(path)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="write the file and the plots here and keep them")
    ns = ap.parse_args()
    work = ns.keep or Path(tempfile.mkdtemp(prefix="report_speed_"))
    run_dir = work / "synthetic"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.h5"
    path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    synthesize(path, ns.steps)
    print(
        f"synthesized {ns.steps} steps in {time.perf_counter() - t0:.1f} s: {path} ({path.stat().st_size / 1e6:.1f} MB)"
    )

    imports_s = {}
    for module in ("matplotlib.figure", "pandas"):
        t0 = time.perf_counter()
        importlib.import_module(module)  # a one-time cost per process: timed apart from the rounds
        imports_s[module] = time.perf_counter() - t0
    out = work / "plots"
    variants: dict[str, Callable[[], dict[str, float]]] = {
        "hpcrl": lambda: time_report(path, out / "hpcrl", read="hpcrl", max_points=1000),
        "full-res plots": lambda: time_report(path, out / "full-res", read="hpcrl", max_points=ns.steps),
        "constrained layout": lambda: time_constrained(path, out / "constrained"),
        "pandas (read + summary)": lambda: time_report(path, out, read="pandas", max_points=None),
        "per-row h5py (read + summary)": lambda: time_report(path, out, read="rows", max_points=None),
        "`report` command, new process": lambda: time_cli(run_dir, out / "cli"),
    }
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(ns.repeats):
        for name, fn in variants.items():
            rounds[name].append(fn())
    print("imports (once per process): " + ", ".join(f"{m} {s:.2f} s" for m, s in imports_s.items()))
    print(f"median of {ns.repeats} rounds, {ns.steps} steps, 56 columns, 8 plots\n")
    print(f"{'variant':<31} {'read s':>7} {'summary s':>9} {'plots s':>7} {'total s':>7}")
    for name, results in rounds.items():
        median = {k: statistics.median(r[k] for r in results) for k in results[0]}
        cells = [f"{median[k]:.3f}" if k in median else "-" for k in ("read", "summary", "plots")]
        print(f"{name:<31} {cells[0]:>7} {cells[1]:>9} {cells[2]:>7} {median['total']:7.2f}")
    if ns.keep is None:
        shutil.rmtree(work)
    else:
        print(f"\nplots kept in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
