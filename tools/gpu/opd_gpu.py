"""On-policy distillation on one GPU: the student's embedded engine, the teacher's embedded engine and the trainer
as separate processes sharing the GPU, through the real `hpcrl run` loop; then GRPO alone on the same student.

  python3 tools/gpu/opd_gpu.py --out $OUT [--steps 6] [--top-k 8]

Student: the Qwen3-0.6B shape; teacher: the Qwen3-1.7B shape (hpcrl.model.tiny's shaped-model init, random bf16
weights, the character tokenizer, the same 151,936-entry vocabulary). Each step samples --prompts x --samples answers
of up to --max-new-tokens, the teacher scores them (distill.mode=reverse_kl, distill.top_k=--top-k: a top-k sparse
forward KL too) and the trainer takes one step. Printed and written to $OUT/opd_gpu.json: the teacher's scoring
seconds per step (distill/teacher_s), the student's step time (timing/total_s, its train part timing/train_s), the
same for GRPO alone (distill=null), and the distillation figures (reverse KL, top-k forward KL). With random weights
the reward is 0: this measures time, not learning. About 4-5 minutes on one H100 (two model inits, two runs of
--steps steps, each starting two or one engines).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {
    "student": dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8),  # 0.6B
    "teacher": dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8),  # 1.7B
}


def make(model_dir: Path, which: str) -> None:
    from hpcrl.model.tiny import ModelShape, init_shaped_model

    if not (model_dir / "config.json").exists():
        shape = ModelShape(vocab_size=151936, head_dim=128, max_position_embeddings=512, **SHAPES[which])
        init_shaped_model(model_dir, shape, dtype="bfloat16", device="cuda", overwrite=True)


def run(name: str, student: Path, teacher: Path | None, ns: argparse.Namespace) -> Path:
    run_dir = ns.workdir / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        f"model.path={student}", f"num_steps={ns.steps}", "sft.num_steps=0",
        f"data.prompts_per_step={ns.prompts}", f"rollout.n_samples_per_prompt={ns.samples}",
        f"rollout.max_new_tokens={ns.max_new_tokens}", "train.micro_batch_size=32", "train.lr=1e-6",
        "engine.device=cuda", "train.device=cuda", "engine.dtype=bfloat16", "train.dtype=bfloat16",
        "engine.offload_during_train=false", "checkpoint.every_steps=1000000", "engine.kind=embedded",
        f"engine.max_running_requests={ns.prompts * ns.samples}",
    ]  # fmt: skip
    if teacher is None:
        overrides.append("distill=null")
    else:
        overrides += [
            f"distill.teacher.model={teacher}", "distill.mode=reverse_kl", f"distill.top_k={ns.top_k}",
            "distill.teacher.engine.device=cuda", "distill.teacher.engine.dtype=bfloat16",
            "distill.teacher.engine.kind=embedded",
            f"distill.teacher.engine.max_running_requests={ns.prompts * ns.samples}",
        ]  # fmt: skip
    cmd = [sys.executable, "-m", "hpcrl.cli", "run", "experiments/distill-quickstart.yaml", *overrides,
           "--run-dir", str(run_dir)]  # fmt: skip
    log = ns.out / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=ns.timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = -1
    print(f"{name}: hpcrl run took {time.perf_counter() - t0:.0f} s (exit {code})", flush=True)
    if code:
        print(f"{name}: hpcrl run failed; last lines of {log}:\n" + "\n".join(log.read_text().splitlines()[-30:]))
        raise SystemExit(1)
    return run_dir


def summary(run_dir: Path) -> dict[str, object]:
    from hpcrl.store import load_metrics

    m = load_metrics(run_dir / "metrics.h5")
    out: dict[str, object] = {}
    for key in ("timing/total_s", "timing/train_s", "timing/rollout_s", "distill/teacher_s", "distill/reverse_kl",
                "train/distill_forward_kl_topk", "train/loss"):  # fmt: skip
        if key in m:
            values = [float(x) for x in m[key]]
            out[key] = values
            out[key + ":median_after_first"] = statistics.median(values[1:] or values)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=190.0, help="per hpcrl run")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/opd-gpu"))
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    ns.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    student, teacher = ns.workdir / "qwen3-0.6b-shape", ns.workdir / "qwen3-1.7b-shape"
    make(student, "student")
    make(teacher, "teacher")
    print(f"models written in {time.perf_counter() - t0:.0f} s", flush=True)
    report = {
        "opd": summary(run("opd", student, teacher, ns)),
        "grpo": summary(run("grpo", student, None, ns)),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
    }
    (ns.out / "opd_gpu.json").write_text(json.dumps(report, indent=1))

    def med(run: str, key: str) -> str:
        value = report[run].get(key + ":median_after_first")  # type: ignore[attr-defined]
        return "-" if value is None else f"{value:.3f}"

    print(f"\n{ns.prompts} x {ns.samples} samples, <= {ns.max_new_tokens} new tokens, steps 2..{ns.steps} (median)")
    print("| run | step s | train s | rollout s | teacher s | reverse KL | top-k forward KL |")
    print("|---|---|---|---|---|---|---|")
    for name in ("opd", "grpo"):
        cols = [med(name, k) for k in ("timing/total_s", "timing/train_s", "timing/rollout_s", "distill/teacher_s",
                                        "distill/reverse_kl", "train/distill_forward_kl_topk")]  # fmt: skip
        print(f"| {name} | " + " | ".join(cols) + " |")
    print(f"total {time.perf_counter() - t0:.0f} s; JSON in {ns.out / 'opd_gpu.json'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
