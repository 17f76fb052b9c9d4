"""TRL's GRPOTrainer on the step_time.py workload: seconds per step, one JSON line on stdout.

Run by tools/bench/step_time.py --peer trl with the python of a venv that has trl (never imported by hpcrl):

    TRL_PYTHON tools/bench/trl_peer.py --model DIR --prompts FILE --steps N --threads 2 [--lr 5e-4]
        [--lora-rank 16 --lora-alpha 32 --lora-targets all-linear]

FILE is JSON: {"prompts": [...], "answers": [...]}, the prompts of hpcrl's steps in order (16 per step).
The step is TRL's own training step: transformers `generate` for 16 prompts x 8 samples (<= 8 new tokens,
temperature 1), the reward, one forward/backward and AdamW step; no reference model (beta 0, as hpcrl's
kl_coef 0), logging off so only the step is timed; float32 on both sides (GRPOConfig's own default is bf16). With
--lora-rank, peft adapters (a LoraConfig of that rank, alpha and targets, no dropout) train instead of the model.
The JSON also holds each step's mean reward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--lora-rank", type=int, help="train peft LoRA adapters of this rank instead of the model")
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--lora-targets", default="all-linear", help="all-linear, or comma-separated module names")
    ns = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpcrl.rollout.rewards import arithmetic_answer

    torch.set_num_threads(ns.threads)
    data = json.loads(Path(ns.prompts).read_text())
    dataset = Dataset.from_dict({"prompt": data["prompts"], "answer": data["answers"]})

    step_rewards: list[float] = []  # one call per step: a step generates its 128 completions at once

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        out = [arithmetic_answer(c, a) for c, a in zip(completions, answer, strict=True)]
        step_rewards.append(sum(out) / len(out))
        return out

    ends: list[float] = []

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: object, **kwargs: object) -> None:
            ends.append(time.perf_counter())

    tok = AutoTokenizer.from_pretrained(ns.model)
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="trl-peer-") as out:
        cfg = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,  # GRPOConfig's default is bf16 autocast; hpcrl's side computes in float32
            per_device_train_batch_size=128,
            num_generations=8,
            gradient_accumulation_steps=1,
            max_completion_length=8,
            temperature=1.0,
            top_p=1.0,
            learning_rate=ns.lr,
            beta=0.0,
            max_steps=ns.steps,
            shuffle_dataset=False,
            logging_steps=10**9,
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=cfg,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[StepClock()],
            peft_config=lora_config(ns),
        )
        start = time.perf_counter()
        trainer.train()
    steps_s = [b - a for a, b in zip([start, *ends[:-1]], ends, strict=True)]
    warm = steps_s[3:]  # as step_time.py: the first steps pay one-time costs
    if len(step_rewards) != ns.steps:
        raise SystemExit(f"expected one reward call per step, got {len(step_rewards)} for {ns.steps} steps")
    print(json.dumps({"total": warm, "median_s": statistics.median(warm), "reward_mean": step_rewards}))
    return 0


def lora_config(ns: argparse.Namespace) -> object | None:
    if ns.lora_rank is None:
        return None
    from peft import LoraConfig

    targets = ns.lora_targets if ns.lora_targets == "all-linear" else ns.lora_targets.split(",")
    return LoraConfig(
        r=ns.lora_rank, lora_alpha=ns.lora_alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
    )


if __name__ == "__main__":
    sys.exit(main())
