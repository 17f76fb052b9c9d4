"""Sync against async GRPO on one H200, the engine and the trainer as separate processes sharing the GPU
(no memory rental), the Qwen3-0.6B shape in bf16 with random weights, one after the other in one call.

  python3 tools/gpu/async_vs_sync_gpu.py --steps 12 --out $OUT

Per mode: trained samples per second over the steps after the first 3 (warm-up), the median step, the
trainer's wait on the buffer, and the staleness of the groups trained. Answers are capped at
--max-new-tokens; with random weights few stop early, so the lengths vary little: the gain measured here is
the overlap of generation with training, not a long tail.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPE = dict(num_layers=28, hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8, head_dim=128)


def run(mode: str, model_dir: Path, run_dir: Path, ns: argparse.Namespace, log: Path) -> float:
    overrides = [
        f"model.path={model_dir}", f"num_steps={ns.steps}", "sft.num_steps=0",
        f"data.prompts_per_step={ns.prompts}", f"rollout.n_samples_per_prompt={ns.samples}",
        f"rollout.max_new_tokens={ns.max_new_tokens}", "train.micro_batch_size=64",
        "engine.device=cuda", "train.device=cuda", "engine.dtype=bfloat16", "train.dtype=bfloat16",
        "engine.offload_during_train=false", "checkpoint.every_steps=1000000", "engine.kind=embedded",
        f"rollout.mode={mode}",
    ]  # fmt: skip
    if mode == "async":
        overrides += [f"buffer.max_staleness={ns.max_staleness}", "train.off_policy_correction=tis"]
    cmd = [
        sys.executable,
        "-m",
        "hpcrl.cli",
        "run",
        "experiments/quickstart.yaml",
        *overrides,
        "--run-dir",
        str(run_dir),
    ]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        print(f"{mode}: hpcrl run exited {code}; last lines:\n" + "\n".join(log.read_text().splitlines()[-30:]))
        raise SystemExit(1)
    return time.perf_counter() - t0


def summary(mode: str, run_dir: Path, samples_per_step: int) -> dict[str, object]:
    from hpcrl.store import load_metrics

    m = load_metrics(run_dir / "metrics.h5")
    total = [float(x) for x in m["timing/total_s"]]
    warm = total[3:]
    out: dict[str, object] = {
        "steps": len(total),
        "trained_samples_per_s": samples_per_step * len(warm) / sum(warm),
        "step_s_median": statistics.median(warm),
        "step_s": total,
        "reward_mean": [float(x) for x in m["rollout/reward_mean"]],
    }
    for key in ("buffer/trainer_wait_s", "buffer/staleness_mean", "buffer/staleness_max", "timing/train_s",
                "timing/sync_s"):  # fmt: skip
        if key in m:
            out[key] = [float(x) for x in m[key]]
    print(
        f"{mode}: {out['trained_samples_per_s']:.1f} trained samples/s (steps 4..{len(total)}), median step "
        f"{out['step_s_median']:.3f} s"
        + (
            f", trainer wait median {statistics.median(out['buffer/trainer_wait_s'][3:]):.3f} s, staleness max "
            f"{max(out['buffer/staleness_max']):.0f}"
            if "buffer/trainer_wait_s" in out
            else ""
        ),
        flush=True,
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/avs"))
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args()
    from hpcrl.model.tiny import TinyModelSpec, init_tiny_model

    ns.out.mkdir(parents=True, exist_ok=True)
    model_dir = ns.workdir / "qwen3-0.6b-shape"
    if not (model_dir / "config.json").exists():
        init_tiny_model(model_dir, TinyModelSpec(**SHAPE, max_position_embeddings=512))
    report: dict[str, object] = {}
    for mode in ("sync", "async"):
        run_dir = ns.workdir / f"run-{mode}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        wall_s = run(mode, model_dir, run_dir, ns, ns.out / f"{mode}.log")
        report[mode] = summary(mode, run_dir, ns.prompts * ns.samples) | {"wall_s": wall_s}
    ratio = report["async"]["trained_samples_per_s"] / report["sync"]["trained_samples_per_s"]  # type: ignore[index]
    print(f"async / sync trained samples/s: {ratio:.2f}x", flush=True)
    (ns.out / "async_vs_sync.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
