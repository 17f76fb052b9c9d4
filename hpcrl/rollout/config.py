"""Data, rollout and reward settings."""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Literal

from hpcrl.sessions.config import EpisodeLimits

DEFAULT_MAX_NEW_TOKENS = 16
EPISODE_KEYS = ("max_turns", "max_tokens_per_turn", "max_episode_tokens")


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """The training prompts and their reference answers: where they come from and how many each step takes."""

    source: str = "addition"
    """`addition` (a generated multi-digit addition task); `product` (generated 3-digit x 2-digit products, the
    multi-turn quickstart's); a .jsonl file; a local dataset read through Hugging
    Face `datasets`: a .parquet, .arrow, .json or .csv file or a `save_to_disk` directory; or
    `reasoning_gym:TASK`, a procedural reasoning-gym task such as `reasoning_gym:chain_sum` (score it with
    reward.fn=reasoning_gym, the task's own scorer). Datasets and reasoning-gym need `pip install 'hpcrl[data]'`."""
    prompt_key: str = "prompt"
    """The field (column) holding the prompt, for files and datasets."""
    answer_key: str = "answer"
    """The field (column) holding the reference answer the reward compares against, for files and datasets."""
    num_examples: int = 5000
    """Examples generated for `addition` and for `reasoning_gym:TASK`."""
    digits: int = 2
    """Largest number of digits per operand for `addition`."""
    prompt_template: str = "{prompt}"
    """How a prompt becomes model input; `{prompt}` is replaced. `chat` applies the tokenizer's chat template."""
    add_special_tokens: bool | Literal["auto"] = "auto"
    """Whether prompt ids get the tokenizer's special tokens (a Llama-style `<bos>` first). `auto` follows the
    tokenizer's own convention: plain text is encoded as `tokenizer.encode(text)` does by default, and a chat
    template (`prompt_template: chat`) adds exactly what the template writes. `true` adds them to chat prompts
    too; `false` never adds them. The first step's prompt ids are written to the run's log."""
    prompts_per_step: int = 16
    """Prompts drawn per GRPO step; each becomes a group of rollout.n_samples_per_prompt samples."""
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
        generated = self.source in ("addition", "product") or self.source.startswith("reasoning_gym:")
        if generated and self.num_examples < self.prompts_per_step:
            raise ValueError(
                f"num_examples={self.num_examples} is less than prompts_per_step={self.prompts_per_step}: every "
                f"step would draw some of the {self.num_examples} examples twice; set num_examples >= "
                f"{self.prompts_per_step} (or fewer prompts_per_step)"
            )
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
    """How each step's samples are generated on the engines: groups per prompt, sampling, and sync or async."""

    kind: Literal["single_turn", "multi_turn"] = "single_turn"
    """`single_turn`: one completion per sample, scored by reward.fn. `multi_turn`: one episode per sample through
    the session server (hpcrl/sessions/): the model calls the environment's tools turn after turn, the environment
    gives the reward, and only sampled tokens train (docs/multiturn.md)."""
    mode: Literal["sync", "async"] = "sync"
    """`sync`: every step generates its batch with the current weights, then trains (bitwise reproducible).
    `async`: a producer keeps groups in flight on the engines while the trainer trains, through a bounded
    buffer (the `buffer:` section; docs/async.md)."""
    n_samples_per_prompt: int = 8
    """Samples per prompt: a group, whose rewards give each sample its group-relative advantage."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    """Most tokens generated per sample (single_turn); longer answers are cut and count as truncated."""
    temperature: float = 1.0
    """Sampling temperature, > 0."""
    top_p: float = 1.0
    """Top-p (nucleus) filter; < 1 turns on sampling-support replay and needs a positive top_k."""
    top_k: int = -1
    """Top-k filter; -1 is off (the whole vocabulary), >= 1 turns on sampling-support replay: the trainer
    renormalises over the ids each token was drawn from (docs/sampling-replay.md)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): a group whose rewards are all equal (no advantage, no gradient) is
    dropped and more prompts are drawn until the step has data.prompts_per_step groups with a signal, so every
    step trains on a full batch that teaches. sync: whole extra batches of prompts of a stream of their own, the
    surplus left unused; async: the producer keeps drawing. Counted per step: rollout/dynamic_dropped_groups."""
    dynamic_sampling_max_batches: int = 4
    """dynamic_sampling: the most prompts one step draws, in batches of data.prompts_per_step (the first
    included); a step still short of groups with unequal rewards then stops the run with what to change; >= 1."""
    request_timeout_s: float = 600.0
    """Seconds an engine request (one /generate call, or one multi-turn turn) may take before it fails."""
    model_family: str | None = None
    """multi_turn: the chat template, stop tokens and tool-call parser by name (`qwen3`, `tiny`); required there,
    never detected from the checkpoint."""
    environment: str | None = None
    """multi_turn: the environment, a built-in (`calculator`, the default), `package.module:Class` or
    `file.py:Class`."""
    max_turns: int | None = None
    """multi_turn: generated assistant turns per episode (null: 8); one more ends it (reason `max_turns`)."""
    max_tokens_per_turn: int | None = None
    """multi_turn: tokens one turn may sample (null: 256); a turn cut there ends the episode."""
    max_episode_tokens: int | None = None
    """multi_turn: tokens of the whole episode, prompt and tool results included (null: 4096)."""

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
        if self.dynamic_sampling_max_batches < 1:
            raise ValueError(f"dynamic_sampling_max_batches must be >= 1, got {self.dynamic_sampling_max_batches}")
        if self.dynamic_sampling_max_batches != 4 and not self.dynamic_sampling:
            raise ValueError(
                "dynamic_sampling_max_batches applies with dynamic_sampling: true; set it, or remove the cap"
            )
        if self.dynamic_sampling and self.kind == "multi_turn":
            raise ValueError(
                "rollout.dynamic_sampling draws extra single-turn groups; rollout.kind=multi_turn runs without it"
            )
        self._check_kind()

    @property
    def episode_limits(self) -> EpisodeLimits:
        """multi_turn: the session server's limits for every episode (defaults where a key is null)."""
        given = {k: getattr(self, k) for k in EPISODE_KEYS if getattr(self, k) is not None}
        return EpisodeLimits().replace(given)

    def _check_kind(self) -> None:
        if self.kind == "single_turn":
            given = [k for k in ("model_family", "environment", *EPISODE_KEYS) if getattr(self, k) is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)} apply to rollout.kind=multi_turn only; remove them, or set "
                    "rollout.kind=multi_turn"
                )
            return
        if self.model_family is None:
            raise ValueError(
                "rollout.kind=multi_turn needs rollout.model_family (qwen3 or tiny): the family's chat template, "
                "stop tokens and tool-call parser are chosen by name, never detected from the checkpoint"
            )
        from hpcrl.sessions.families import get_family

        get_family(self.model_family)
        _ = self.episode_limits  # each limit >= 1
        if self.max_new_tokens != DEFAULT_MAX_NEW_TOKENS:
            raise ValueError(
                f"rollout.max_new_tokens={self.max_new_tokens} does not apply to rollout.kind=multi_turn (a turn's "
                "length is bounded by the episode limits); set rollout.max_tokens_per_turn instead"
            )
        if self.mode == "async":
            raise ValueError(
                "rollout.kind=multi_turn runs its episodes synchronously (the async producer drives single "
                "completions); set rollout.mode=sync"
            )


MAX_INFLIGHT_GROUPS = 1024


@dataclass(kw_only=True, frozen=True)
class BufferConfig:
    """The group buffer of `rollout.mode: async` (hpcrl/rollout/buffer.py)."""

    max_inflight_groups: int | None = None
    """Whole groups (all samples of one prompt) generating on the engines at once; null: data.prompts_per_step."""
    capacity_groups: int | None = None
    """Finished groups the buffer holds; when full, the producer submits nothing new (backpressure, never a
    drop). null: 2 x data.prompts_per_step."""
    max_staleness: int | None = None
    """Drop a group, when the trainer collects it, whose oldest token is more than this many weight versions
    behind the policy the step trains, and submit none that would be (the producer waits for a push instead);
    null: no limit. At least sync.every_steps - 1."""
    filter: str | None = None
    """Reject groups on arrival: `zero_std` (all rewards equal: no GRPO signal), a dotted path
    `package.module:function` or a file path `file.py:function` taking a Group and returning bool (true keeps it),
    or null (keep all)."""
    on_drop: Literal["drop", "retry"] = "drop"
    """What becomes of a dropped prompt: `drop` records it in the ledger and moves on; `retry` regenerates it
    from scratch (fresh seeds), up to 3 attempts in all, then it is dropped."""

    def __post_init__(self) -> None:
        for key in ("max_inflight_groups", "capacity_groups"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1 (or null for the default), got {value}")
        if self.max_inflight_groups is not None and self.max_inflight_groups > MAX_INFLIGHT_GROUPS:
            # Each group in flight is a producer thread waiting on its engine request.
            raise ValueError(
                f"max_inflight_groups={self.max_inflight_groups} is more than {MAX_INFLIGHT_GROUPS} groups generating "
                f"at once (each is a thread); set at most {MAX_INFLIGHT_GROUPS} (null: data.prompts_per_step)"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(
                f"max_staleness must be >= 0 weight versions (0: only groups of the step's own policy), or null "
                f"for no limit; got {self.max_staleness}"
            )
        if self.filter is not None and self.filter != "zero_std" and ":" not in self.filter:
            raise ValueError(
                f"filter {self.filter!r} is neither `zero_std` nor a dotted path `package.module:function`"
            )


@dataclass(kw_only=True, frozen=True)
class RewardConfig:
    """The function that scores every sample against its prompt's reference answer, and the limits on it."""

    fn: str = "arithmetic_answer"
    """A built-in (exact_match, arithmetic_answer, gsm8k, math_verify, reasoning_gym), a dotted path
    `package.module:function`, or a file path `file.py:function` (relative to the working directory)."""
    max_failed_share: float = 0.2
    """Stop the run when more than this share of a step's samples fail to score."""
    timeout_s: float = 60.0
    """A reward call running longer fails its sample (and counts toward max_failed_share)."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_failed_share <= 1:
            raise ValueError(f"max_failed_share must be in [0, 1], got {self.max_failed_share}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    """Held-out evaluation during training: greedy accuracy, pass@k and mean@k on fixed prompts (off by default)."""

    every_steps: int = 0
    """Evaluate after every N-th GRPO step (and after the last); 0 turns evaluation off."""
    source: str | None = None
    """Held-out prompts, in data.source's syntax (a file, a dataset, `addition`, `reasoning_gym:TASK`). None:
    the training generator with another seed, minus every prompt the training data holds; a file or dataset
    source must name its held-out file here."""
    num_prompts: int = 64
    """The first N held-out examples, the same ones at every evaluation."""
    num_samples: int = 4
    """k of pass@k and mean@k: samples per prompt at rollout.temperature (besides one greedy answer)."""
    max_new_tokens: int | None = None
    """None: rollout.max_new_tokens."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps must be >= 0 (0 = no evaluation), got {self.every_steps}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples (the k of pass@k) must be >= 1, got {self.num_samples}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or null, got {self.max_new_tokens}")
