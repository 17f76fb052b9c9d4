"""On-policy distillation settings: the teacher model, its engines, and how its scores enter the advantage."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from hpcrl.engine.config import EngineConfig


@dataclass(kw_only=True, frozen=True)
class TeacherConfig:
    """The frozen teacher: a model with the student's tokenizer, served by engines of its own."""

    model: str
    """Hugging Face model directory of the teacher (relative paths are relative to the current directory). It must
    use the student's tokenizer: the same vocabulary with the same token ids."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The teacher's engines, started, watched and restarted like the student's (the same keys as the top-level
    `engine` section). They only score: no weights are ever pushed to them."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("teacher.model is empty; set it to the teacher's Hugging Face model directory")
        if self.engine.offload_during_train:
            raise ValueError(
                "teacher.engine.offload_during_train: the teacher's engines are never paused for the trainer (they "
                "receive no weights); set it to false"
            )


@dataclass(kw_only=True, frozen=True)
class DistillConfig:
    """On-policy distillation: the teacher scores every token the student sampled, and the per-token reverse KL
    estimate `log p_student - log p_teacher` (the student's rollout log-prob) becomes the advantage: a dense
    signal toward the tokens the teacher prefers (docs/distillation.md)."""

    teacher: TeacherConfig
    mode: Literal["reverse_kl", "mixed"] = "reverse_kl"
    """`reverse_kl`: each model token's advantage is `-coef * (log p_student - log p_teacher)`, the reward is
    scored and logged but not trained on; `mixed`: that term is added to the sample's GRPO advantage."""
    coef: float = 1.0
    """Weight of the reverse-KL term in the advantage (> 0), and of the sparse forward-KL term (`top_k`)."""
    top_k: int | None = None
    """Also ask the teacher for its `top_k` most likely ids at every response position and add a sparse forward KL
    `coef * sum_{v in top-k} p_T(v) (log p_T(v) - log p_S(v))` per model token to the loss (a token mean, added
    to the policy loss in both modes; the teacher's mass outside its top-k is dropped). null: off. Needs the torch
    trainer backend and train.logprobs=plain."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coef) and self.coef > 0):
            raise ValueError(f"coef must be a finite number > 0, got {self.coef}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)):
            raise ValueError(f"top_k must be an integer >= 1 or null, got {self.top_k!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(
                f"top_k must be >= 1 (the teacher ids per position of the sparse forward KL) or null for none, got "
                f"{self.top_k}"
            )
