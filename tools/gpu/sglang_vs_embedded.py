"""The Qwen3-0.6B shape (random weights, bf16), colocated on one GPU, GRPO with memory rented every step: stock
SGLang against hpcrl's embedded engine, one after the other in one call.

  python3 tools/gpu/sglang_vs_embedded.py --steps 12 --out $OUT     # after `source .sglang/activate.sh ...`

Per engine kind and step: the step's phases, release/resume seconds and bytes freed, the weight version the
engines serve after the push, and the log-prob gap of the torch trainer against the engine.
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
SGLANG_ARGS = '["--attention-backend","triton","--sampling-backend","pytorch","--grammar-backend","none"]'
COLUMNS = ("rollout", "reward", "logprob", "train", "sync", "checkpoint", "total")


def run(kind: str, model_dir: Path, run_dir: Path, steps: int, log: Path) -> float:
    overrides = [
        f"model.path={model_dir}", f"num_steps={steps}", "sft.num_steps=0", "data.prompts_per_step=16",
        "rollout.n_samples_per_prompt=8", "rollout.max_new_tokens=8", "train.micro_batch_size=128",
        "engine.device=cuda", "train.device=cuda", "engine.dtype=bfloat16", "train.dtype=bfloat16",
        "engine.offload_during_train=true", "checkpoint.every_steps=1000000", f"engine.kind={kind}",
    ]  # fmt: skip
    if kind == "sglang":
        overrides += [
            "engine.enable_memory_saver=true",
            "engine.mem_fraction_static=0.5",
            f"engine.sglang_args={SGLANG_ARGS}",
        ]
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
        print(f"{kind}: hpcrl run exited {code}; last lines:\n" + "\n".join(log.read_text().splitlines()[-30:]))
        engine_log = run_dir / "logs" / "engine-0.log"
        if engine_log.exists():
            print("engine log:\n" + "\n".join(engine_log.read_text(errors="replace").splitlines()[-30:]))
        raise SystemExit(1)
    return time.perf_counter() - t0


def table(kind: str, run_dir: Path) -> dict[str, object]:
    from hpcrl.store import load_metrics

    m = load_metrics(run_dir / "metrics.h5")
    n = len(m["train/train_rollout_logprob_abs_diff"])
    rows = []
    for i in range(n):
        row = {p: float(m[f"timing/{p}_s"][i]) for p in COLUMNS if f"timing/{p}_s" in m}
        for key in ("fleet/release_s", "fleet/resume_s", "fleet/released_bytes", "sync/weight_version"):
            row[key] = float(m[key][i]) if key in m else float("nan")
        row["gap"] = float(m["train/train_rollout_logprob_abs_diff"][i])
        rows.append(row)
    print(f"\n{kind}: step | " + " | ".join(COLUMNS) + " | release s | resume s | freed MiB | version | gap")
    for i, r in enumerate(rows):
        cells = [f"{r.get(p, float('nan')):.3f}" for p in COLUMNS]
        print(
            f"{kind} {i + 1:>3} | " + " | ".join(cells) + f" | {r['fleet/release_s']:.4f} | {r['fleet/resume_s']:.4f}"
            f" | {r['fleet/released_bytes'] / 2**20:.0f} | {r['sync/weight_version']:.0f} | {r['gap']:.3e}"
        )
    warm = rows[3:]
    summary = {p: statistics.median(r[p] for r in warm) for p in COLUMNS if p in warm[0]}
    summary |= {k: statistics.median(r[k] for r in warm) for k in ("fleet/release_s", "fleet/resume_s")}
    summary["freed_mib_median"] = statistics.median(r["fleet/released_bytes"] for r in warm) / 2**20
    summary["gap_mean"] = statistics.fmean(r["gap"] for r in rows)
    summary["versions"] = [r["sync/weight_version"] for r in rows]
    print(f"{kind} median of steps 4..{n}: " + ", ".join(f"{k} {v}" for k, v in summary.items() if k != "versions"))
    return {"rows": rows, "summary": summary}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/sve"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kinds", default="sglang,embedded")
    args = p.parse_args()
    from hpcrl.model.tiny import TinyModelSpec, init_tiny_model

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.workdir / "qwen3-0.6b-shape"
    if not (model_dir / "config.json").exists():
        init_tiny_model(model_dir, TinyModelSpec(**SHAPE, max_position_embeddings=512))
    report: dict[str, object] = {}
    for kind in args.kinds.split(","):
        run_dir = args.workdir / f"run-{kind}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        wall_s = run(kind, model_dir, run_dir, args.steps, args.out / f"{kind}.log")
        report[kind] = table(kind, run_dir) | {"wall_s": wall_s}
    (args.out / "sglang_vs_embedded.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
