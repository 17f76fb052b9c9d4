"""RunConfig: the whole run, composed of the component configs (each defined next to its component)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from hpcrl.config import dump_yaml, load_config
from hpcrl.engine.config import EngineConfig
from hpcrl.guard.config import GuardConfig
from hpcrl.model.tiny import TinyModelSpec
from hpcrl.rollout.config import BufferConfig, DataConfig, EvalConfig, RewardConfig, RolloutConfig
from hpcrl.rollout.distill_config import DistillConfig
from hpcrl.slurm.config import SlurmConfig
from hpcrl.store.sinks.config import LoggingConfig
from hpcrl.sync.config import SyncConfig
from hpcrl.trainer.config import SFTConfig, TrainConfig

TRACE_KEYS = ("trace_wrong_operand_share", "trace_no_tool_share")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """The policy model: the Hugging Face directory the trainer and the engines load at the start."""

    path: str
    """Hugging Face model directory (relative paths are relative to the current directory)."""
    init_tiny: TinyModelSpec | None = None
    """When set and `path` does not exist, write a tiny random Qwen3-architecture model there first."""


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Checkpoints in `<run dir>/checkpoints/`, named by the steps done (`step_00000025.h5` after 25 steps), from
    which a preempted or stopped run resumes exactly."""

    every_steps: int = 10
    """Write a checkpoint after every N-th GRPO step (and after the last)."""
    keep_last: int = 2
    """How many of the newest checkpoints stay on disk; older ones are deleted as each new one is written. Each
    holds the model weights and the Adam moments (about 3x the weights; more with a KL reference copy): raise it
    to keep earlier steps to go back to, if the disk allows."""

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")


MAX_STEPS = 1_000_000_000  # far beyond any run; a larger count is a typo (it overflows the step counters)


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    name: str = "run"
    """The run's name: without --run-dir, the run directory is `runs/<name>` (letters, digits, `.`, `_`, `-`), and
    the logging sinks name their run (and an MLflow experiment without `logging.mlflow.experiment`) after it.
    Give each experiment its own, or a second run resumes (or refuses) the first one's directory."""
    seed: int = 0
    """The one seed of the run's draws: the prompt order, every sample's sampling seed (derived from the seed, the
    step, the prompt and the sample index), the engines' seeds, the SFT batches and the generated held-out eval
    prompts; the same config and seed regenerate the same run. The tiny model's initial weights have their own
    (`model.init_tiny.seed`). Change it to repeat an experiment with other draws; >= 0."""
    num_steps: int = 20
    """GRPO steps, one rollout batch each (train.global_batch_size and train.ppo_epochs say how many optimizer
    steps a rollout batch makes; one by default)."""
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """rollout.mode: async only."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distill: DistillConfig | None = None
    """On-policy distillation from a teacher model (docs/distillation.md); None: off."""

    def __post_init__(self) -> None:
        if not 0 <= self.num_steps <= MAX_STEPS:
            raise ValueError(f"num_steps must be between 0 and {MAX_STEPS:,}, got {self.num_steps}")
        if self.rollout.replays_support and "logprob_chunk_tokens" in self.train.auto_resolved:
            # The supports are scored from the logits: the fused head's `auto` is the plain head here (first: a
            # replaced train section has lost which keys were `auto`).
            object.__setattr__(self, "train", replace(self.train, logprob_chunk_tokens=None))
        if self.train.old_logprobs is None:
            # Resolved here, so the dumped config (and a resume's comparison with it) names the choice.
            object.__setattr__(self, "train", replace(self.train, old_logprobs=_default_old_logprobs(self)))
        if self.train.aggregation == "constant" and self.train.constant_normalizer_tokens is None:
            tokens = self.rollout.max_new_tokens
            object.__setattr__(self, "train", replace(self.train, constant_normalizer_tokens=tokens))
        generated = self.data.source in ("addition", "product") or self.data.source.startswith("reasoning_gym:")
        if self.eval.every_steps and self.eval.source is None and not generated:
            raise ValueError(
                f"eval.every_steps={self.eval.every_steps} needs held-out prompts: data.source "
                f"{self.data.source!r} is a file, so set eval.source to a held-out file of the same format (only "
                "generated sources, addition and reasoning_gym:TASK, can draw held-out prompts themselves)"
            )
        if self.reward.fn == "reasoning_gym" and not self.data.source.startswith("reasoning_gym:"):
            raise ValueError(
                f"reward.fn=reasoning_gym scores with a reasoning-gym task's own scorer, but data.source is "
                f"{self.data.source!r}: set data.source=reasoning_gym:TASK (e.g. reasoning_gym:chain_sum), or pick "
                "another reward.fn"
            )
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        batch = self.data.prompts_per_step * self.rollout.n_samples_per_prompt
        gbs = self.train.global_batch_size
        if gbs is not None and (gbs > batch or batch % gbs):
            raise ValueError(
                f"train.global_batch_size={gbs} must divide the rollout batch, data.prompts_per_step x "
                f"rollout.n_samples_per_prompt = {self.data.prompts_per_step} x {self.rollout.n_samples_per_prompt} "
                f"= {batch}; use one of {_divisors(batch, self.train.data_parallel_size)} (or null: the whole batch)"
            )
        clip_set = (self.train.eps_clip, self.train.eps_clip_high) != (TrainConfig.eps_clip, TrainConfig.eps_clip_high)
        if clip_set and self.train.old_logprobs == "trainer" and self.train.ppo_epochs == 1 and gbs in (None, batch):
            # Only a clip the user set is named: at the defaults an inert clip is the plain policy gradient, which
            # docs/objectives.md explains, and a warning on every default run would be noise.
            warnings.warn(
                "train.eps_clip and train.eps_clip_high are inert: with train.old_logprobs=trainer, one PPO epoch "
                "and one mini-batch, each batch makes one optimizer step from the weights that scored it, so the "
                "ratio is 1 and never clipped (cispo: never capped). For them to act, set train.global_batch_size "
                "to a divisor of the batch or train.ppo_epochs > 1 (or train.old_logprobs=rollout)",
                stacklevel=3,
            )
        if self.train.overlong_window_tokens and (
            self.rollout.kind == "multi_turn" or self.train.overlong_window_tokens > self.rollout.max_new_tokens
        ):
            raise ValueError(
                f"train.overlong_window_tokens={self.train.overlong_window_tokens} must be at most "
                f"rollout.max_new_tokens={self.rollout.max_new_tokens}, the budget it ends at (and single-turn: a "
                "turn's budget is not an episode's)"
            )
        if self.train.logprobs == "invariant" and not self.engine.batch_invariant:
            raise ValueError(
                "train.logprobs=invariant needs engine.batch_invariant: true: the trainer's batch-invariant log-probs "
                "equal the engine's only when the engine samples from the same forward; set "
                "engine.batch_invariant=true (CPU or CUDA, float32 or bfloat16), or train.logprobs=plain"
            )
        if self.train.logprobs == "invariant" and self.train.invariant_kernels != self.engine.kernels.invariant():
            tiles, kernels = self.train.invariant_kernels, self.engine.kernels
            raise ValueError(
                "train.logprobs=invariant needs the trainer to launch the engine's batch-invariant kernel tiles: "
                f"train.invariant_kernels.matmul {tiles.matmul} and .attention {tiles.attention} against "
                f"engine.kernels.invariant_matmul {kernels.invariant_matmul} and invariant_attention "
                f"{kernels.invariant_attention}; set them alike (other tiles sum in another order: other bits)"
            )
        if self.train.logprobs == "invariant" and (
            self.engine.device.split(":")[0] != self.train.device.split(":")[0] or self.engine.dtype != self.train.dtype
        ):
            raise ValueError(
                "train.logprobs=invariant needs the engine and the trainer on the same kind of device with the same "
                f"dtype (engine {self.engine.device} {self.engine.dtype}, train {self.train.device} "
                f"{self.train.dtype}): "
                "the batch-invariant forward gives the same bits only with the same GEMM library and dtype; set "
                "engine.device/engine.dtype and train.device/train.dtype alike"
            )
        if (
            self.engine.device.startswith("cuda") != self.train.device.startswith("cuda")
            and self.sync.transport == "tensor"
        ):
            raise ValueError("sync.transport=tensor needs the engines and the trainer on the same kind of device")
        if self.rollout.replays_support:
            _check_replayable(self)
        self._check_async()
        if self.rollout.kind == "multi_turn":
            _check_multi_turn(self)
        elif traces := [k for k in TRACE_KEYS if getattr(self.sft, k)]:
            raise ValueError(
                f"sft.{', sft.'.join(traces)} shape the multi-turn warm start's tool traces; remove them, or set "
                "rollout.kind=multi_turn"
            )
        if self.distill is not None:
            _check_distill(self)
        if self.guard.mode != "off":
            # A thermal pause holds collectives and engine calls up to max_pause_s (hpcrl/guard/guard.py).
            for key, timeout_s in (
                ("sync.group_timeout_s", self.sync.group_timeout_s),
                ("rollout.request_timeout_s", self.rollout.request_timeout_s),
            ):
                if timeout_s <= self.guard.max_pause_s:
                    raise ValueError(
                        f"{key}={timeout_s:g} must be longer than guard.max_pause_s={self.guard.max_pause_s:g}, or "
                        f"a thermal pause could make it time out: raise {key} or lower guard.max_pause_s"
                    )

    @property
    def inflight_groups(self) -> int:
        return self.buffer.max_inflight_groups or self.data.prompts_per_step

    @property
    def capacity_groups(self) -> int:
        return self.buffer.capacity_groups or 2 * self.data.prompts_per_step

    def _check_async(self) -> None:
        if self.rollout.mode == "sync":
            if self.buffer != BufferConfig():
                raise ValueError(
                    "the buffer section applies to rollout.mode=async; remove it, or set rollout.mode=async"
                )
            if self.sync.every_steps != 1:
                raise ValueError(
                    "sync.every_steps applies to rollout.mode=async (the synchronous loop pushes after every step); "
                    "remove it, or set rollout.mode=async"
                )
            return
        if self.engine.offload_during_train:
            raise ValueError(
                "rollout.mode=async cannot rent the engines' memory to the trainer (engine.offload_during_train): "
                "in async mode both stages must hold their GPUs at once, since the engines keep generating while "
                "the trainer trains; give them separate GPUs (disaggregated, or separate Slurm het groups), run "
                "them as CPU processes, or set engine.offload_during_train=false"
            )
        if self.sync.pause_mode == "abort":
            raise ValueError(
                "rollout.mode=async cannot use sync.pause_mode=abort: generation is always in flight, so every "
                "weight push would abort it and throw the work away; use sync.pause_mode=retract (or in_place)"
            )
        if self.capacity_groups < self.data.prompts_per_step:
            raise ValueError(
                f"buffer.capacity_groups={self.capacity_groups} is smaller than one step's batch "
                f"(data.prompts_per_step={self.data.prompts_per_step} groups): the trainer could never collect a "
                f"step; set buffer.capacity_groups >= {self.data.prompts_per_step} (or null: twice the batch)"
            )
        staleness, every = self.buffer.max_staleness, self.sync.every_steps
        if staleness is not None and staleness < every - 1:
            # Step s collects while the engines serve the version pushed after step every * (s // every) - 1,
            # up to every - 1 behind s: every group would be dropped as stale, and held from submission.
            raise ValueError(
                f"buffer.max_staleness={staleness} with sync.every_steps={every}: the steps between two pushes "
                f"collect groups up to {every - 1} versions old, so they could never be collected; set "
                f"buffer.max_staleness >= {every - 1}, or sync.every_steps <= {staleness + 1}"
            )
        if self.train.off_policy_correction == "none" and self.train.old_logprobs == "trainer":
            warnings.warn(
                "rollout.mode=async without an off-policy correction: groups generated by older weights are "
                "trained as if on-policy; set train.old_logprobs=rollout (the PPO clip then bounds the update "
                "around the policy that sampled them), or train.off_policy_correction=tis (or mis), or keep "
                "buffer.max_staleness small",
                stacklevel=3,
            )


def _default_old_logprobs(cfg: RunConfig) -> Literal["trainer", "rollout"]:
    """train.old_logprobs when the config leaves it null.

    In async mode every group is up to buffer.max_staleness versions behind the trainer. With the trainer's own
    old log-probs the single update's ratio is 1, so the clip never acts and a stale group pushes on a token
    however far the policy has already moved it; on the quickstart that stops the learning at staleness 2.
    Against the engine's log-probs the clip stops pushing a token once it has moved past eps_clip from the
    sampling policy (docs/async.md, "Learning"). An explicit off_policy_correction needs the trainer's log-probs."""
    async_mode = cfg.rollout.mode == "async"
    return "rollout" if async_mode and cfg.train.off_policy_correction == "none" else "trainer"


def _divisors(n: int, multiple_of: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d % multiple_of == 0)


def _check_replayable(cfg: RunConfig) -> None:
    """Refuse what sampling-support replay cannot reproduce faithfully (docs/sampling-replay.md).

    The trainer scores softmax(z) restricted to each token's support. That equals the engine's sampling
    distribution only if the engine drew from softmax(z / T) over the same ids with T = 1 (the trainer has no
    temperature of its own), and every term of the loss must be a score over that support.
    """
    filters = f"rollout.top_k={cfg.rollout.top_k} / rollout.top_p={cfg.rollout.top_p:g}"
    off = "or turn replay off with rollout.top_k=-1 rollout.top_p=1"
    if cfg.rollout.temperature != 1.0:
        raise ValueError(
            f"{filters} replays the sampling support, but rollout.temperature={cfg.rollout.temperature:g} differs "
            f"from the trainer's temperature (1: it scores softmax(logits)), so the trainer would renormalise a "
            f"different distribution than the engine sampled; set rollout.temperature=1, {off}"
        )
    if cfg.train.kl_coef > 0:
        raise ValueError(
            f"{filters} replays the sampling support, but train.kl_coef={cfg.train.kl_coef:g} adds a KL to the "
            f"reference policy, which needs a full-vocabulary score; set train.kl_coef=0, {off}"
        )
    if cfg.engine.logprobs == "recompute":
        raise ValueError(
            f"{filters} replays the sampling support, but engine.logprobs=recompute re-scores sequences over the "
            f"full vocabulary; set engine.logprobs=sampled (train.logprobs=invariant with engine.batch_invariant "
            f"replays the support bit for bit), {off}"
        )
    if cfg.train.logprob_chunk_tokens is not None:
        raise ValueError(
            f"{filters} replays the sampling support, which scores the logits of each token's support; "
            f"train.logprob_chunk_tokens (the fused full-vocabulary head) would not be used; set it to null, {off}"
        )


def _check_distill(cfg: RunConfig) -> None:
    """Refuse what would make the teacher's log-probs and the student's describe different distributions."""
    if cfg.rollout.replays_support:
        raise ValueError(
            f"distill compares the student's and the teacher's full-vocabulary log-probs of each sampled token, but "
            f"rollout.top_k={cfg.rollout.top_k} / rollout.top_p={cfg.rollout.top_p:g} make the engine report "
            "log-probs renormalised over the sampling support; set rollout.top_k=-1 and rollout.top_p=1"
        )
    top_k = cfg.distill.top_k if cfg.distill is not None else None
    if top_k is not None and cfg.train.backend != "torch":
        raise ValueError(
            f"distill.top_k={top_k}: the sparse forward KL scores the teacher's top-k ids with the torch trainer "
            f"backend's head; train.backend={cfg.train.backend} does not; set train.backend=torch or distill.top_k=null"
        )
    if top_k is not None and cfg.train.logprobs != "plain":
        raise ValueError(
            f"distill.top_k={top_k}: train.logprobs={cfg.train.logprobs} scores only the sampled id of each position; "
            "set train.logprobs=plain or distill.top_k=null"
        )


def _check_multi_turn(cfg: RunConfig) -> None:
    """Refuse, with the fix, what multi-turn episodes do not do rather than let the setting silently do nothing."""
    if cfg.engine.batch_invariant:
        raise ValueError(
            "engine.batch_invariant does not apply to rollout.kind=multi_turn: the session server's turns go through "
            "the engine's ordinary /generate, not the batch-invariant forward; set engine.batch_invariant=false"
        )
    if cfg.engine.logprobs == "recompute":
        raise ValueError(
            "engine.logprobs=recompute is not built for rollout.kind=multi_turn (the session server records the "
            "log-probs each turn sampled with); set engine.logprobs to its default"
        )
    if cfg.reward.fn != RewardConfig().fn:
        raise ValueError(
            f"reward.fn={cfg.reward.fn!r} is not used by rollout.kind=multi_turn: the environment gives the reward "
            "(rollout.environment, its reward method); remove reward.fn"
        )
    if cfg.eval.every_steps:
        raise ValueError(
            "eval.every_steps is not built for rollout.kind=multi_turn (evaluation draws single completions); set "
            "eval.every_steps=0"
        )
    if cfg.sft.num_steps and cfg.rollout.environment not in (None, "calculator"):
        raise ValueError(
            f"sft.num_steps={cfg.sft.num_steps}: the multi-turn warm start trains on synthetic calculator traces, "
            f"which do not fit rollout.environment={cfg.rollout.environment!r}; set sft.num_steps=0, or use the "
            "calculator environment"
        )
    if cfg.sft.num_steps and cfg.data.source != "product":
        raise ValueError(
            f"sft.num_steps={cfg.sft.num_steps}: the multi-turn warm start writes calculator traces for "
            f"data.source=product (3-digit x 2-digit products), not {cfg.data.source!r}; set data.source=product, "
            "or sft.num_steps=0"
        )


def load_run_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    return load_config(RunConfig, path, list(overrides))


def run_config_yaml(cfg: RunConfig) -> str:
    return dump_yaml(cfg)
