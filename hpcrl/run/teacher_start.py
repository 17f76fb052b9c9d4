"""The distillation teacher's part in building a run: its checks before anything starts, and its engines started in
a thread beside the trainer's and the student engines' (hpcrl/rollout/teacher.py holds the teacher itself)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hpcrl.model.hf import check_model_dir
from hpcrl.rollout.distill_config import DistillConfig
from hpcrl.rollout.teacher import Teacher, check_same_vocabulary, start_teacher
from hpcrl.run.errors import RunError


def check_teacher(
    d: DistillConfig, model_dir: Path, engines_here: bool, reward_fn: str, say: Callable[[str], None]
) -> None:
    """Refuse a teacher that cannot run here or cannot score the student's tokens, before anything starts."""
    if not engines_here:
        raise RunError(
            "distill: the teacher's engines start on the trainer's node, in a local run (`hpcrl run`); under "
            "Slurm or MPI they are not placed yet: run the distillation locally, or remove the distill section"
        )
    teacher_dir = Path(d.teacher.model)
    if not (teacher_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"distill.teacher.model {teacher_dir} is not a Hugging Face model directory (no config.json): point "
            "it at the teacher's directory, e.g. the policy a run exported to runs/NAME/model"
        )
    check_model_dir(teacher_dir)
    check_same_vocabulary(model_dir, teacher_dir)
    if d.top_k is not None:
        # The sparse forward KL looks the teacher's top-k ids up in the student's output head.
        sizes = [json.loads((m / "config.json").read_text()).get("vocab_size") for m in (model_dir, teacher_dir)]
        if sizes[0] != sizes[1]:
            raise RunError(
                f"distill.top_k={d.top_k}: the teacher's output has {sizes[1]} entries and the student's {sizes[0]}: "
                "its top-k ids must index the student's vocabulary; pick a teacher of the same vocab_size or set "
                "distill.top_k=null"
            )
    if d.mode == "reverse_kl":
        say(
            f"distill.mode=reverse_kl trains on the teacher's log-probs alone: reward.fn={reward_fn} is "
            "scored and logged (rollout/reward_mean), not trained on; distill.mode=mixed adds it to the "
            "advantage"
        )


def start_teacher_aside(
    d: DistillConfig,
    run_dir: Path,
    *,
    seed: int,
    timeout_s: float,
    say: Callable[[str], None],
    on_event: Callable[[str, dict[str, Any]], None],
    closers: list[Callable[[], None]],
) -> Future[Teacher]:
    """Start the teacher's engines in a thread (loading a model takes seconds to minutes each); the closer added to
    `closers` waits for that start and stops them, however the build ends."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcrl-teacher-start")
    future = pool.submit(
        start_teacher, d, Path(d.teacher.model), run_dir, seed=seed, timeout_s=timeout_s, say=say, on_event=on_event
    )
    pool.shutdown(wait=False)
    closers.append(lambda: _close_teacher(future))
    return future


def _close_teacher(start: Future[Teacher]) -> None:
    if start.exception() is None:  # a start that failed stopped its engines itself
        start.result().close()
