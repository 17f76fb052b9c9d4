"""Run the quickstart for several seeds and report the GRPO reward gain (last N steps vs first N).

    python tools/bench/quickstart_rewards.py --seeds 0 1 2 [--window 5] [--out-dir runs/qs-seeds] [--parallel 3]
                                             [--config experiments/X.yaml] [key=value ...]

--parallel N runs N seeds at once (each job one torch thread unless OMP_NUM_THREADS says otherwise): on a machine
with many cores the three seeds take the time of one.

The issue's bar: the mean reward of the last 5 GRPO steps beats the first 5 by >= 0.15 for every seed,
and each whole job (model creation, SFT, GRPO) finishes within 10 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.store import load_metrics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="experiments/quickstart.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--out-dir", default="runs/qs-seeds")
    ap.add_argument("--parallel", type=int, default=1, help="seeds run at once (default 1: one after another)")
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    if ns.parallel < 1:
        ap.error(f"--parallel must be >= 1, got {ns.parallel}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    running: list[tuple[int, Path, float, subprocess.Popen[bytes]]] = []
    rows = []
    failed: list[int] = []

    def reap(proc_entry: tuple[int, Path, float, subprocess.Popen[bytes]]) -> None:
        seed, run_dir, t0, proc = proc_entry
        if proc.wait() != 0:
            failed.append(seed)
            print(
                f"seed {seed}: the run failed (exit {proc.returncode}); see {run_dir.parent}/seed{seed}.log",
                file=sys.stderr,
            )
            return
        wall_s = time.perf_counter() - t0
        r = load_metrics(run_dir / "metrics.h5")["rollout/reward_mean"]
        first, last = float(r[: ns.window].mean()), float(r[-ns.window :].mean())
        rows.append((seed, first, last, last - first, wall_s))

    for seed in ns.seeds:
        run_dir = Path(ns.out_dir) / f"seed{seed}"
        if len(running) >= ns.parallel:
            reap(running.pop(0))
        t0 = time.perf_counter()
        cmd = [
            sys.executable,
            "-m",
            "hpcrl.cli",
            "run",
            ns.config,
            f"seed={seed}",
            *ns.overrides,
            "--run-dir",
            str(run_dir),
        ]
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        out = None if ns.parallel == 1 else (run_dir.parent / f"seed{seed}.log").open("wb")
        running.append((seed, run_dir, t0, subprocess.Popen(cmd, env=env, stdout=out, stderr=out)))
    for entry in running:
        reap(entry)
    rows.sort()
    print(f"\n{ns.config} {' '.join(ns.overrides)}")
    print(f"\n| seed | first {ns.window} | last {ns.window} | gain | wall s |\n|---|---|---|---|---|")
    for seed, first, last, gain, wall_s in rows:
        print(f"| {seed} | {first:.3f} | {last:.3f} | {gain:+.3f} | {wall_s:.0f} |")
    ok = not failed and all(gain >= 0.15 and wall_s <= 600 for _, _, _, gain, wall_s in rows)
    print("meets the bar (gain >= 0.15, <= 600 s): " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
