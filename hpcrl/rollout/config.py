"""Data, rollout and reward settings."""

from __future__ import annotations

import string
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    source: str = "addition"
    """A .jsonl file with prompt/answer fields, or `addition` (a generated multi-digit addition task)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    num_examples: int = 5000
    """Examples generated for `addition`."""
    digits: int = 2
    """Largest number of digits per operand for `addition`."""
    prompt_template: str = "{prompt}"
    """How a prompt becomes model input; `{prompt}` is replaced. `chat` applies the tokenizer's chat template."""
    prompts_per_step: int = 16
    shuffle: bool = True
    """Visit the examples in a fresh seeded permutation every epoch (GRPO and SFT batches alike); false keeps
    the dataset's order (a curriculum file), epoch after epoch."""

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.prompt_template != "chat":
            _check_template(self.prompt_template)
        if self.num_examples < 1:
            raise ValueError(f"num_examples must be >= 1, got {self.num_examples}")
        if self.digits < 1:
            raise ValueError(f"digits must be >= 1, got {self.digits}")


def _check_template(template: str) -> None:
    # str.format would raise KeyError or IndexError on the first prompt; say so at load time.
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(
            f"prompt_template {template!r} is not a valid template ({exc}); write a literal brace as {{{{ or }}}}"
        ) from None
    if "prompt" not in fields:
        raise ValueError("prompt_template must contain {prompt}, or be 'chat'")
    others = sorted({name for name in fields if name != "prompt"})
    if others:
        raise ValueError(
            f"prompt_template has the placeholder(s) {', '.join('{' + n + '}' for n in others)}, but only {{prompt}} "
            "is filled in; remove them, or write literal braces as {{ and }}"
        )


@dataclass(kw_only=True, frozen=True)
class RolloutConfig:
    n_samples_per_prompt: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    """Top-p (nucleus) filter; < 1 turns on sampling-support replay and needs a positive top_k."""
    top_k: int = -1
    """Top-k filter; -1 is off (the whole vocabulary), >= 1 turns on sampling-support replay: the trainer
    renormalises over the ids each token was drawn from (docs/sampling-replay.md)."""
    request_timeout_s: float = 600.0

    @property
    def replays_support(self) -> bool:
        """True when top-k/top-p filtering shrinks the sampling support, so the trainer must score over it."""
        return self.top_p < 1 or self.top_k > 0

    def __post_init__(self) -> None:
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 for GRPO (greedy groups have no variance to learn from)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (no top-k filter) or >= 1, got {self.top_k}")
        if self.top_p < 1 and self.top_k < 1:
            # The support travels with every token to the trainer; top-p alone can keep most of the vocabulary
            # in a flat tail (SGLang 0.5.16 refuses return_sampling_mask without a finite top_k for that reason).
            raise ValueError(
                f"top_p={self.top_p:g} needs a positive top_k to bound the sampling support that replay sends to "
                "the trainer; set rollout.top_k (e.g. rollout.top_k=64), or rollout.top_p=1"
            )
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


@dataclass(kw_only=True, frozen=True)
class RewardConfig:
    fn: str = "arithmetic_answer"
    """A built-in (exact_match, arithmetic_answer, gsm8k) or a dotted path `package.module:function`."""
    max_failed_share: float = 0.2
    """Stop the run when more than this share of a step's samples fail to score."""
    timeout_s: float = 60.0
    """A reward call running longer fails its sample (and counts toward max_failed_share)."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_failed_share <= 1:
            raise ValueError(f"max_failed_share must be in [0, 1], got {self.max_failed_share}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
