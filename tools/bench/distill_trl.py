"""On-policy distillation step time: hpcrl (`distill.mode: reverse_kl`, the teacher on an engine of its own) against
TRL 1.16's GKDTrainer (`lmbda=1`, `beta=1`: on-policy samples, reverse KL) on the same student, teacher and prompts.

    python tools/bench/distill_trl.py [--rounds 3] [--steps 10] [--threads 2]

Workload: the distillation quickstart's shapes, a student of 2 layers, width 64 and a teacher of 4 layers, width
128, both random with the character tokenizer; the prompts of hpcrl's steps under experiments/quickstart.yaml
(16 a step), 8 samples each (TRL gets every prompt 8 times in its batch of 128: the same 128 sequences a step),
<= 8 new tokens at temperature 1, one AdamW step per batch, lr 1e-5, float32, `--threads` torch threads each.

hpcrl's step includes everything: the rollout on its engine, the teacher's scoring request on the teacher's engine
(a prefill returning the log-prob of each sampled token), the trainer's forward/backward, the weight push and HDF5
logging. TRL's step: transformers `generate` with the student, a student and a teacher forward over the whole
sequence (the teacher's full next-token distribution at each position), the full-vocabulary reverse KL, backward and
AdamW. The two run alternately, round by round, each in its own process; the first 3 steps of each are dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The distillation quickstart's shapes (experiments/distill-quickstart.yaml, experiments/quickstart.yaml).
STUDENT_SHAPE = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
TEACHER_SHAPE = dict(num_layers=4, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)
SAMPLES = 8
WARM = 3  # as step_time.py: the first steps pay one-time costs


def trl_gkd_step_times(ns: argparse.Namespace) -> list[float]:
    """Run in its own process (`--trl-peer`): TRL's GKDTrainer for `ns.steps` steps; seconds per step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    torch.set_num_threads(ns.threads)
    data = json.loads(Path(ns.prompts).read_text())
    prompts = [p for p in data["prompts"] for _ in range(SAMPLES)]  # every prompt 8 times, in hpcrl's order
    tok = AutoTokenizer.from_pretrained(ns.student)
    student = AutoModelForCausalLM.from_pretrained(ns.student, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(ns.teacher, dtype=torch.float32)

    def collate(rows: list[dict[str, str]]) -> dict[str, torch.Tensor]:
        # lmbda=1: training_step replaces input_ids/attention_mask/labels by the student's own samples of the
        # left-padded prompts. The Trainer still counts the collated labels as the loss's token normaliser
        # (num_items_in_batch): all -100 would divide by 0 and turn the weights to NaN, so they count the prompt's
        # tokens (a constant scale of the loss; the step's work is the same).
        ids = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
        width = max(map(len, ids))
        padded = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        return {
            "prompts": padded, "prompt_attention_mask": mask, "input_ids": padded, "attention_mask": mask,
            "labels": padded.masked_fill(mask == 0, -100),
        }  # fmt: skip

    ends: list[float] = []

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: object, **kwargs: object) -> None:
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory(prefix="trl-gkd-") as out:
        cfg = GKDConfig(
            output_dir=out, use_cpu=True, per_device_train_batch_size=16 * SAMPLES, gradient_accumulation_steps=1,
            lmbda=1.0, beta=1.0, temperature=1.0, max_new_tokens=8, learning_rate=1e-5, max_steps=ns.steps,
            logging_steps=10**9, save_strategy="no", report_to=[], dataloader_num_workers=0, disable_tqdm=True,
            seed=0, shuffle_dataset=False,
            # As hpcrl's step: float32, no recomputation (GKDConfig's defaults are bf16 and gradient checkpointing).
            bf16=False, gradient_checkpointing=False,
        )  # fmt: skip
        trainer = GKDTrainer(
            model=student, teacher_model=teacher, args=cfg, data_collator=collate, processing_class=tok,
            train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[StepClock()],
        )  # fmt: skip
        # Sequential batches in hpcrl's prompt order (the Trainer would otherwise shuffle them).
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
        start = time.perf_counter()
        trainer.train()
    return [b - a for a, b in zip([start, *ends[:-1]], ends, strict=True)]


def hpcrl_distill_step_times(student: Path, teacher: Path, run_dir: Path, ns: argparse.Namespace) -> dict[str, float]:
    from step_time import hpcrl_step_times

    from hpcrl.store import load_metrics

    run = argparse.Namespace(
        steps=ns.steps, threads=ns.threads, device="cpu", dtype="float32", backend="torch", colocate=False, quiet=True,
        set=[
            f"distill.teacher.model={teacher}", "distill.mode=reverse_kl", "distill.coef=1.0",
            f"distill.teacher.engine.num_threads={ns.threads}", "train.lr=1e-5",
        ],
    )  # fmt: skip
    times = hpcrl_step_times(student, run_dir, run)
    m = load_metrics(run_dir / "metrics.h5")
    return {
        "total": statistics.median(times["total"]),
        "teacher": statistics.median(m["distill/teacher_s"][WARM:].tolist()),
        "reverse_kl": float(m["distill/reverse_kl"][-1]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trl-peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--student", help=argparse.SUPPRESS)
    ap.add_argument("--teacher", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.trl_peer:
        print(json.dumps({"total": trl_gkd_step_times(ns)}))
        return 0
    if ns.steps <= WARM:
        raise SystemExit(f"--steps {ns.steps}: the first {WARM} steps are dropped; pass at least {WARM + 1}")

    from step_time import step_prompts

    from hpcrl.model.tiny import TinyModelSpec, init_tiny_model

    here = Path(__file__).resolve()
    env = {**os.environ, "OMP_NUM_THREADS": str(ns.threads), "PYTHONPATH": str(here.parents[2])}
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpcrl-distill-bench-") as tmp:
        student = init_tiny_model(Path(tmp) / "student", TinyModelSpec(**STUDENT_SHAPE, max_position_embeddings=256))
        teacher = init_tiny_model(
            Path(tmp) / "teacher", TinyModelSpec(**TEACHER_SHAPE, max_position_embeddings=256, seed=1)
        )
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps(step_prompts(ns.steps)))
        peer = [sys.executable, str(here), "--trl-peer", "--student", str(student), "--teacher", str(teacher)]
        peer += ["--prompts", str(prompts), "--steps", str(ns.steps), "--threads", str(ns.threads)]
        for r in range(ns.rounds):
            ours = hpcrl_distill_step_times(student, teacher, Path(tmp) / f"run{r}", ns)
            out = subprocess.run(peer, env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"the TRL GKD peer exited with {out.returncode}:\n{out.stderr[-4000:]}")
            trl = statistics.median(json.loads(out.stdout.strip().splitlines()[-1])["total"][WARM:])
            rows.append((r + 1, ours, trl))
            print(
                f"round {r + 1}: hpcrl {ours['total']:.3f} s/step (teacher scoring {ours['teacher']:.3f} s), "
                f"TRL GKD {trl:.3f} s/step",
                flush=True,
            )
    print(
        f"\nOn-policy distillation step, student 2 layers x width 64, teacher 4 layers x width 128, "
        f"threads={ns.threads}, 16 prompts x {SAMPLES} samples x <=8 tokens, median over {ns.steps - WARM} steps "
        f"(first {WARM} dropped), hpcrl and TRL GKDTrainer (lmbda=1, beta=1) alternating"
    )
    print("| round | hpcrl (s/step) | of which teacher scoring (s) | TRL GKDTrainer (s/step) | hpcrl / TRL |")
    print("|---|---|---|---|---|")
    for r, ours, trl in rows:
        print(f"| {r} | {ours['total']:.3f} | {ours['teacher']:.3f} | {trl:.3f} | {ours['total'] / trl:.2f} |")
    ratio = statistics.median(ours["total"] / trl for _, ours, trl in rows)
    print(f"median hpcrl / TRL: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
