"""How a step's scored groups become the trainer's batch: group-relative advantages with DAPO's overlong shaping
(hpcrl/trainer/advantage.py), then, in a distillation run, the teacher's per-token advantages
(hpcrl/trainer/distill.py)."""

from __future__ import annotations

from hpcrl.rollout.teacher import Teacher
from hpcrl.run_config import RunConfig
from hpcrl.samples.sample import Group
from hpcrl.trainer.advantage import Overlong, batch_from_groups
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.distill import distill_advantages, with_teacher_topk


def step_batch(cfg: RunConfig, groups: list[Group], teacher: Teacher | None) -> tuple[TrainBatch, dict[str, float]]:
    """The batch `groups` train as, and the distill/* figures of the teacher's scoring (none without a teacher)."""
    train = cfg.train
    overlong = Overlong(
        cfg.rollout.max_new_tokens, train.overlong_window_tokens, train.overlong_penalty, train.mask_truncated
    )
    batch = batch_from_groups(groups, normalize_std=bool(train.normalize_advantage_std), overlong=overlong)
    if teacher is None or cfg.distill is None:
        return batch, {}
    scores = teacher.score(groups)
    batch, stats = distill_advantages(batch, scores.logprobs, mode=cfg.distill.mode, coef=cfg.distill.coef)
    if scores.top is not None:
        batch = with_teacher_topk(batch, scores.top, coef=cfg.distill.coef)
    return batch, scores.stats | {f"distill/{k}": v for k, v in stats.items()}
