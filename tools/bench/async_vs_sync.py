"""Sync vs async GRPO in one invocation, on CPU: two embedded engines and the trainer, long-tail answers.

    python tools/bench/async_vs_sync.py [--workload long-tail|quickstart] [--steps 30] [--max-new-tokens 96]
        [--out-dir runs/async-vs-sync] [k=v ...] [--async-set buffer.K=V ...]

Workload `long-tail` (the default): a task whose answers are a letter repeated N times (`c*N=` -> `ccc...`),
written to OUT_DIR/long_tail.jsonl; 85% of the prompts ask for 1-4 letters and 15% for 40-90. After its SFT
warm start the model writes answers of about the asked length, so a few groups of every batch decode for 40-90
tokens while the others stop after a few: a long tail of response lengths (printed per mode). The
synchronous step waits for its longest group; in async mode the engines keep generating while the trainer
trains, and each step takes the groups that are ready. Workload `quickstart`: the addition quickstart, whose
answers all stop within a few tokens (no tail: what is left is the overlap of generation and training).

Both modes use the same config, seed and SFT; printed per mode: trained samples/s over the GRPO steps, the
trainer's wait for rollouts, the response lengths, the staleness of the trained groups, the groups generated
and then dropped as stale, and the time the producer held a submission that would have been too stale (async).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


SHORT_LETTERS, LONG_LETTERS, LONG_SHARE = (1, 4), (40, 90), 0.15


def write_long_tail_task(path: Path, num_examples: int = 4000, seed: int = 0) -> list[str]:
    """The long-tail task's JSONL; returns the run overrides that train on it."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        lo, hi = LONG_LETTERS if rng.random() < LONG_SHARE else SHORT_LETTERS
        letter, n = rng.choice("abcdefghij"), rng.randint(lo, hi)
        rows.append(json.dumps({"prompt": f"{letter}*{n}=", "answer": letter * n}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")
    return [f"data.source={path}", "reward.fn=exact_match"]


def run(mode: str, ns: argparse.Namespace, workload: list[str]) -> dict[str, np.ndarray]:
    run_dir = Path(ns.out_dir) / mode
    extra = ["rollout.mode=async", f"buffer.max_staleness={ns.max_staleness}", *ns.async_set] if mode == "async" else []
    cmd = [
        sys.executable, "-m", "hpcrl.cli", "run", ns.config, f"num_steps={ns.steps}",
        f"rollout.max_new_tokens={ns.max_new_tokens}", *COMMON, *workload, *extra, *ns.overrides,
        "--run-dir", str(run_dir), "--restart",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return load_metrics(run_dir / "metrics.h5")


def _total(m: dict[str, np.ndarray], key: str, digits: int) -> str:
    """The sum over the steps; `-` where the run does not log the key (sync mode, or code from before it)."""
    return f"{float(np.sum(m[key])):.{digits}f}" if key in m else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="experiments/quickstart.yaml")
    ap.add_argument("--workload", choices=("long-tail", "quickstart"), default="long-tail")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--out-dir", default="runs/async-vs-sync")
    ap.add_argument(
        "--async-set", nargs="+", default=[], metavar="K=V", help="overrides of the async run only (buffer.*)"
    )
    ap.add_argument("overrides", nargs="*")
    ns = ap.parse_args()
    workload = write_long_tail_task(Path(ns.out_dir) / "long_tail.jsonl") if ns.workload == "long-tail" else []
    rows = {}
    for mode in ("sync", "async"):
        m = run(mode, ns, workload)
        samples = float(np.sum(m["rollout/num_samples"]))
        wall_s = float(np.sum(m["timing/total_s"]))
        wait = m["buffer/trainer_wait_s"] if mode == "async" else m["timing/rollout_s"]
        staleness = m.get("buffer/staleness_mean", np.zeros(len(m["step"])))
        lengths = (float(np.mean(m["rollout/response_len_median"])), float(np.mean(m["rollout/response_len_max"])))
        rows[mode] = (samples / wall_s, float(np.sum(wait)), wall_s, staleness, lengths, m)
    print(
        "\n| mode | trained samples/s | trainer wait s (total) | GRPO wall s | response tokens: median / max "
        "(mean of steps) | staleness mean (p50 / max of steps) | groups dropped stale | producer stale wait s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, (rate, wait_s, wall_s, st, (median, longest), m) in rows.items():
        dropped = _total(m, "buffer/dropped_stale", 0)
        held_s = _total(m, "buffer/producer_stale_wait_s", 1)
        print(
            f"| {mode} | {rate:.1f} | {wait_s:.1f} | {wall_s:.1f} | {median:.1f} / {longest:.1f} "
            f"| {np.median(st):.2f} / {np.max(st):.2f} | {dropped} | {held_s} |"
        )
    m = rows["async"][5]
    values, counts = np.unique(m["buffer/staleness_max"], return_counts=True)
    print("async: steps by staleness_max: " + ", ".join(f"{v:.0f}: {c}" for v, c in zip(values, counts, strict=True)))
    speedup = rows["async"][0] / rows["sync"][0]
    print(f"async / sync trained samples/s: {speedup:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
