"""Sync vs async GRPO in one invocation, on CPU: two embedded engines and the trainer, long-tail answers.

    python tools/bench/async_vs_sync.py [--steps 30] [--max-new-tokens 96] [--out-dir runs/async-vs-sync] [k=v ...]

The workload is the quickstart after its SFT warm start: most answers stop after a few tokens, while a few
samples of each batch (temperature 1) run on to max_new_tokens. The synchronous step waits for the longest
of them; in async mode the engines keep generating while the trainer trains, and each step takes the groups
that are ready. Both runs use the same config, seed and SFT; printed per mode: trained samples/s over the
GRPO steps, the trainer's wait for rollouts, and the staleness of the trained groups (async).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from hpcrl.store import load_metrics

COMMON = [
    "engine.num_engines=2",
    "sft.num_steps=300",
    "data.prompts_per_step=8",
    "rollout.n_samples_per_prompt=8",
    "checkpoint.every_steps=1000",
]


def run(mode: str, ns: argparse.Namespace) -> dict[str, np.ndarray]:
    run_dir = Path(ns.out_dir) / mode
    extra = ["rollout.mode=async", f"buffer.max_staleness={ns.max_staleness}"] if mode == "async" else []
    cmd = [
        sys.executable, "-m", "hpcrl.cli", "run", ns.config, f"num_steps={ns.steps}",
        f"rollout.max_new_tokens={ns.max_new_tokens}", *COMMON, *extra, *ns.overrides, "--run-dir", str(run_dir),
        "--restart",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return load_metrics(run_dir / "metrics.h5")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="experiments/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--out-dir", default="runs/async-vs-sync")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    rows = {}
    for mode in ("sync", "async"):
        m = run(mode, ns)
        samples = float(np.sum(m["rollout/num_samples"]))
        wall_s = float(np.sum(m["timing/total_s"]))
        wait = m["buffer/trainer_wait_s"] if mode == "async" else m["timing/rollout_s"]
        staleness = m.get("buffer/staleness_mean", np.zeros(len(m["step"])))
        rows[mode] = (samples / wall_s, float(np.sum(wait)), wall_s, staleness, m)
    print("\n| mode | trained samples/s | trainer wait s (total) | GRPO wall s | staleness mean (p50 / max of steps) |")
    print("|---|---|---|---|---|")
    for mode, (rate, wait_s, wall_s, st, _) in rows.items():
        print(f"| {mode} | {rate:.1f} | {wait_s:.1f} | {wall_s:.1f} | {np.median(st):.2f} / {np.max(st):.2f} |")
    m = rows["async"][4]
    values, counts = np.unique(m["buffer/staleness_max"], return_counts=True)
    print("async: steps by staleness_max: " + ", ".join(f"{v:.0f}: {c}" for v, c in zip(values, counts, strict=True)))
    speedup = rows["async"][0] / rows["sync"][0]
    print(f"async / sync trained samples/s: {speedup:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
