"""Trainer and SFT warm-start settings."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Literal

from hpcrl.model.invariant_config import InvariantKernelsConfig
from hpcrl.trainer.converters import CONVERTERS

# What each trainer backend does not implement: settings that must keep their defaults under it, and why. Every
# other setting, the PPO step of hpcrl/trainer/step.py with all its loss settings included, every backend runs.
# A new backend is one row here (and one in the `backend` choices).
BACKEND_LIMITS: dict[str, dict[str, str]] = {
    "torch": {
        "tensor_parallel_size": "the torch backend splits no layer: it replicates (ddp) or shards (fsdp2) the model",
        "pipeline_parallel_size": "the torch backend splits no layer: it replicates (ddp) or shards (fsdp2) the model",
        "megatron_optimizer": "it picks the megatron backend's optimizer",
        "expert_parallel_size": (
            "the torch backend splits no layer: every rank holds all experts (ddp) or a shard of each (fsdp2)"
        ),
    },
    "megatron": {
        "parallelism": (
            "the megatron backend shards with tensor_parallel_size, pipeline_parallel_size and its distributed "
            "optimizer (megatron_optimizer), not with the torch backend's FSDP2"
        ),
        "activation_checkpointing": "it checkpoints the torch backend's decoder layers; megatron-core has its own",
        "converters": "model converters change the torch backend's model; the megatron backend builds its own",
        "lora": (
            "LoRA adapters are a model converter of the torch backend; the megatron backend builds megatron-core's "
            "own model, which has no adapter layers"
        ),
        "logprobs": (
            "logprobs: invariant needs the trainer to compute its log-probs with the engine's batch-invariant forward "
            "(hpcrl.model.invariant); the megatron backend runs megatron-core's own kernels, whose GEMMs, "
            "attention and tensor-parallel reductions differ from it"
        ),
    },
}


LORA_ALL_LINEAR = "all-linear"


@dataclass(kw_only=True, frozen=True)
class LoRAConfig:
    """Low-rank adapters (converters: [lora]): each targeted linear layer serves W + (alpha / rank) * B @ A, with W
    frozen as loaded and only A [rank, in] and B [out, rank] trained (docs/lora.md)."""

    rank: int = 8
    """The adapters' rank r: trained parameters per targeted layer are r x (in + out); >= 1."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank (as peft's lora_alpha); > 0."""
    dropout: float = 0.0
    """Dropout on the adapters' input in the training forward only (never when scoring old or reference
    log-probs), in [0, 1). It makes the trained function differ from the served one, so logprobs: invariant
    refuses it."""
    target_modules: tuple[str, ...] | str = LORA_ALL_LINEAR
    """The linear layers of each decoder layer that get adapters, by name (e.g. [q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj]), or `all-linear`: every one of them (never the LM head or the embeddings)."""

    def __post_init__(self) -> None:
        targets = self.target_modules
        if isinstance(targets, str):
            targets = (targets,)
        object.__setattr__(self, "target_modules", tuple(targets))
        if isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1 (the adapters' rank), got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0 (the adapters are scaled by alpha / rank), got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not targets or any(not t or t != t.strip() for t in targets):
            raise ValueError(
                f"lora.target_modules must name linear layers (e.g. [q_proj, v_proj]) or be {LORA_ALL_LINEAR}, got "
                f"{list(targets)}"
            )
        if LORA_ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"lora.target_modules: {LORA_ALL_LINEAR} already names every linear layer; give it alone")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.target_modules)


@dataclass(kw_only=True, frozen=True)
class FSDPConfig:
    """train.parallelism: fsdp2 only: how the torch backend shards its model, gradients and AdamW state over the
    ranks (torch's `fully_shard` on every decoder layer and on the whole model)."""

    param_dtype: Literal["float32", "bfloat16"] | None = None
    """The dtype the forward and backward compute in: each layer's weights are gathered and cast to it, while the
    sharded master weights and AdamW moments stay in train.dtype. Null: bfloat16 on CUDA, train.dtype elsewhere."""
    reduce_dtype: Literal["float32", "bfloat16"] | None = None
    """The dtype gradients are reduce-scattered (summed over ranks) in. Null: float32, whatever param_dtype is, so
    a sum over many ranks loses no precision."""
    offload: bool = False
    """Keep the sharded weights, gradients and AdamW state in host memory (the optimizer steps on the CPU) and copy
    each layer's weights to the GPU only while it runs: trains models whose state does not fit the GPU, at the
    price of host-device copies every step. CUDA only (on device: cpu everything is in host memory already)."""
    shard_group_size: int | None = None
    """Hybrid sharding: shard over groups of this many ranks (e.g. the GPUs of one node) and replicate across the
    groups, so the per-layer gathers stay inside a node and only gradients cross nodes. Must divide num_ranks.
    Null: shard over all ranks."""

    def __post_init__(self) -> None:
        if self.shard_group_size is not None and self.shard_group_size < 1:
            raise ValueError(f"shard_group_size must be >= 1 (null: all ranks), got {self.shard_group_size}")


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """The trainer: backend and parallelism, the optimizer (AdamW), the PPO/GRPO loss, batching and numerics."""

    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "parallel": "it had one value (ddp) and nothing read it; train.parallelism picks ddp or fsdp2",
    }
    RENAMED_KEYS: ClassVar[dict[str, str]] = {"onpolicy": "logprobs: invariant (or plain)"}
    backend: Literal["torch", "megatron"] = "torch"
    """Trainer implementation: `torch` (hpcrl's model, DDP or FSDP2) runs anywhere; `megatron` (megatron-core GPTModel
    with tensor and pipeline parallelism) needs `pip install 'hpcrl[megatron]'`."""
    parallelism: Literal["ddp", "fsdp2"] = "ddp"
    """torch backend: how the ranks share the model. `ddp`: every rank holds the whole model, its gradients and AdamW
    state (16 bytes a parameter in fp32). `fsdp2`: each rank holds 1/num_ranks of them and gathers one decoder layer's
    weights at a time for its forward and backward (a mixture-of-experts layer's experts as a group of their own;
    train.fsdp), for models that do not fit one GPU (docs/fsdp2.md). Same loss and gradients to fp32 rounding;
    checkpoints of either resume under the other."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """parallelism: fsdp2: mixed precision, CPU offload and hybrid sharding."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """torch backend, per decoder layer: trade compute for activation memory. `none`: every layer keeps its
    activations for backward. `full`: a layer keeps only its input and runs its forward again in backward (about
    one more forward of the model per step). `selective`: a layer keeps the outputs of its matrix products and
    attention and recomputes only the cheap element-wise ops (norms, RoPE, SwiGLU) in backward. Same loss and
    gradients either way."""
    tensor_parallel_size: int = 1
    """Megatron only: ranks that split each layer's weights; divides the attention and KV heads."""
    pipeline_parallel_size: int = 1
    """Megatron only: pipeline stages, each a contiguous run of layers; divides the layer count.
    num_ranks / (tensor_parallel_size x pipeline_parallel_size) is the data-parallel size."""
    expert_parallel_size: int = 1
    """Megatron only, mixture-of-experts models: ranks that split each MoE layer's experts (each holds
    num_experts / expert_parallel_size of them; tokens go to their experts' rank and back). It must divide the
    model's num_experts and the data-parallel size: Megatron places each expert-parallel group inside the
    data-parallel ranks, which each train their own rows. A dense model refuses it (docs/moe.md)."""
    megatron_optimizer: Literal["auto", "distributed", "local"] = "auto"
    """Megatron only: `distributed` is Megatron's DDP + distributed optimizer (fp32 master weights, Adam
    state sharded over data-parallel ranks; CUDA only); `local` is torch AdamW on each rank's shards with
    gradients all-reduced by hand (runs on CPU too); `auto` picks distributed on CUDA, local on CPU."""
    lr: float = 1e-5
    """AdamW learning rate of the GRPO steps, constant (no schedule or warm-up); > 0. The warm start has its own
    (`sft.lr`). The main knob of an RL run: too high and the reward collapses or the loss turns NaN
    (`max_nan_steps`), too low and the reward does not move. The CPU quickstart's tiny model uses 5e-4,
    experiments/cluster-example.yaml's 1.7B model 1e-6."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (per optimizer step, scaled by lr), on every trained parameter; >= 0."""
    adam_beta1: float = 0.9
    """AdamW's decay rate of the gradient's running mean, in [0, 1)."""
    adam_beta2: float = 0.999
    """AdamW's decay rate of the squared gradient's running mean, in [0, 1); 0.98-0.99 adapts faster to the
    changing gradient scale of RL."""
    adam_eps: float = 1e-8
    """AdamW's term added to the root of the squared-gradient average, > 0; guards small denominators."""
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""
    micro_batch_size: int | Literal["auto"] = "auto"
    """Sequences per forward/backward; gradients accumulate over a step's micro-batches. `auto`: 16 off CUDA and
    under backend: megatron; torch backend on CUDA: per batch, the largest of 16, 8, 4, 2, 1 whose activation
    estimate for the batch's padded length fits the GPU memory left after the model state (the memory plan),
    agreed by every rank and kept in checkpoints (a resume cuts its batches alike). The run's config.yaml keeps
    `auto` there (the size depends on the GPU and on each batch's length): the "trainer plan:" line names the
    sizes per sequence length, and each step's metrics record the one used (micro_batch_size)."""
    global_batch_size: int | None = None
    """Samples per optimizer step: one rollout batch (prompts_per_step x n_samples_per_prompt) is split, in its
    order, into batch / global_batch_size mini-batches, each one optimizer step and each split over the ranks.
    Null: the whole batch in one step. Must divide the batch and be a multiple of num_ranks."""
    ppo_epochs: int = 1
    """Passes over a rollout batch's mini-batches; optimizer steps per rollout step = epochs x mini-batches."""
    old_logprobs: Literal["trainer", "rollout"] | None = None
    """The old policy of the PPO ratio: `trainer` scores the batch with the trainer's weights before the first
    update (with a single optimizer step that is the training forward itself, detached: no extra pass, and the
    ratio is 1); `rollout` takes the engine's sampled-token log-probs, so the clip bounds how far the update
    moves a token from the policy that sampled it. Null: `rollout` in rollout.mode: async with no
    off_policy_correction (stale groups, docs/async.md), `trainer` otherwise; the resolved config names the one
    chosen."""
    off_policy_correction: Literal["none", "tis", "mis"] = "none"
    """Per-token importance weight on the policy-gradient term for the engine/trainer mismatch, from
    r = exp(trainer old log-prob - engine log-prob) (detached): `tis` weighs by min(r, is_clip) (truncated IS);
    `mis` by r where r <= is_clip and masks the token (weight 0) above (masked IS). Needs old_logprobs: trainer."""
    is_clip: float = 2.0
    """Truncation (tis) or masking (mis) threshold of the importance ratio; > 1."""
    eps_clip: float = 0.2
    """PPO clip below: a token's probability ratio r (new / old policy) counts no lower than 1 - eps_clip for a
    negative advantage, so one update cannot push a token far down; in (0, 1). loss: gspo clips the sequence
    ratio, which stays much closer to 1 (its paper used 3e-4); loss: cispo has no lower bound. Inert (a warning
    says so) when the old policy is the trainer's and a batch makes one optimizer step: the ratio is then 1."""
    eps_clip_high: float = 0.28
    """PPO clip above: the ratio counts no higher than 1 + eps_clip_high for a positive advantage. Wider than
    eps_clip ("clip-higher", DAPO) lets unlikely tokens grow, slowing the collapse of entropy; > 0 (set it to
    eps_clip for the symmetric PPO clip). loss: gspo: on the sequence ratio (its paper: 4e-4); loss: cispo: the
    cap of the importance weight, 1 + eps_clip_high (ScaleRL used 4, a cap of 5)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the initial (reference) policy; > 0 keeps a frozen reference copy."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus subtracted from the loss (per token, the entropy of the policy's next-token
    distribution), >= 0: raise it (e.g. 0.001) when the entropy metric collapses and samples stop differing."""
    loss: Literal["grpo", "gspo", "cispo", "dr_grpo"] = "grpo"
    """The policy-gradient objective (docs/objectives.md). `grpo`: the PPO clip on each token's probability ratio.
    `gspo` (Zheng et al. 2025): the clip on each sample's length-normalised sequence ratio, so a sample is kept or
    clipped whole; sequence aggregation. `cispo` (MiniMax-M1 2025): each token's ratio, capped at 1 + eps_clip_high
    and detached, weighs its log-prob gradient, so no token loses its gradient (eps_clip does not apply). `dr_grpo`
    (Liu et al. 2025): GRPO's clip with advantages only centred and the sum of token losses over a constant
    (samples x constant_normalizer_tokens). It resolves aggregation and normalize_advantage_std when they are
    null."""
    aggregation: Literal["token", "sequence", "constant"] | None = None
    """How per-token losses become the step's loss. `token`: the mean over all response tokens of the batch
    (each token counts the same, so long answers weigh more). `sequence`: each sample's mean over its tokens,
    then the mean over samples (each sample counts the same). `constant`: the sum over all tokens divided by
    samples x constant_normalizer_tokens (no sample's length changes any token's weight; Dr. GRPO). Null: the
    loss's own (`sequence` for gspo, `constant` for dr_grpo, `token` otherwise)."""
    constant_normalizer_tokens: int | None = None
    """aggregation: constant: the tokens per sample of the normaliser (samples x this), >= 1. Null: the run's
    rollout.max_new_tokens, the paper's choice."""
    normalize_advantage_std: bool | None = None
    """true: a sample's advantage is (reward - group mean) / group std (GRPO); false: only centred,
    reward - group mean (Dr. GRPO), so groups with nearly equal rewards do not get amplified. Groups whose
    rewards are all equal get 0 either way. Null: false for loss: dr_grpo, true otherwise."""
    overlong_window_tokens: int = 0
    """DAPO's overlong reward shaping: an answer longer than rollout.max_new_tokens - overlong_window_tokens tokens
    loses reward linearly with its length, down to -overlong_penalty at rollout.max_new_tokens, before the group's
    advantages (the logged rewards stay the task's); 0: off. Longer answers are not made longer by a penalty that
    starts only at the budget, where truncation already hurts."""
    overlong_penalty: float = 1.0
    """The reward an answer of rollout.max_new_tokens tokens loses under overlong_window_tokens; > 0."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: answers cut at rollout.max_new_tokens (finish `length`) are left out of the loss,
    so an unfinished answer is not punished for reasoning it was not allowed to finish (their rewards still
    enter their group's mean)."""
    num_ranks: int = 1
    """Trainer ranks (processes) on this node, joined by torch.distributed (gloo on CPU, nccl on GPU)."""
    device: str = "cpu"
    """Where the trainer's model, gradients and optimizer state live: `cpu`, `cuda` or `cuda:N` (a torch device
    string). On the same device as engine.device, weight pushes can use the same-host handover
    (sync.transport)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The trainer's weights and compute dtype (torch backend: the AdamW moments too). bfloat16 halves the memory
    and is the GPU choice; float32 on a CPU. train.logprobs: invariant needs it equal to engine.dtype."""
    num_threads: int = 1
    """torch CPU threads per rank."""
    logprobs: Literal["plain", "invariant"] = "plain"
    """The forward that computes the log-probs of the loss and of the train/rollout gap: `plain` is the model's
    own forward; `invariant` is the batch-invariant forward (hpcrl.model.invariant) that engines with
    engine.batch_invariant sample from, so the gap is exactly 0.0 in any micro-batch; it needs
    engine.batch_invariant: true on the same kind of device and dtype (CPU or CUDA, float32 or bfloat16;
    docs/numerics.md)."""
    routing_replay: Literal["off", "observe", "rollout"] = "rollout"
    """Mixture-of-experts models (both backends): `rollout` forces, per token and layer, the experts the engine
    routed it to while sampling (rollout routing replay; the gate weights still come from the trainer's router, so
    it keeps its gradient); `observe` asks the engines for those routes and reports moe/route_agreement without
    forcing them; `off` asks for none and lets the trainer's router choose. Metrics: moe/route_agreement (measured
    before replay), moe/expert_load_cv, moe/aux_loss. Dense models have no routes: the setting does nothing there
    (the trainer's log says so). docs/moe.md."""
    invariant_kernels: InvariantKernelsConfig = field(default_factory=InvariantKernelsConfig)
    """The batch-invariant Triton kernels' tiles with logprobs: invariant on CUDA; they must equal the engine's
    engine.kernels.invariant_matmul / invariant_attention (HPCRL_INVARIANT_* overrides apply to both)."""
    logprob_chunk_tokens: int | Literal["auto"] | None = "auto"
    """Compute the log-probs straight from the final hidden states, the LM head and the log-softmax fused over
    chunks of this many tokens (backward recomputes each chunk), so the [tokens x vocab] logits and their gradient
    never exist in full (e.g. 4096). Null: the model's logits, then the log-softmax. `auto`: 4096 on CUDA with
    logprobs: plain, unless the run's rollout replays sampling supports (top-k/top-p: scored from the logits);
    null otherwise (on a CPU the [tokens x vocab] logits are small and the plain head is faster). Same numbers to
    rounding (tests/unit/test_loss_head.py, tests/unit/test_megatron.py). The megatron backend's last stage
    stops at the final norm and each TP rank scores its vocabulary shard of the output layer (or tied
    embedding), with the softmax statistics all-reduced over TP per chunk. Batches with sampling supports
    (top-k/top-p replay) score their supports from the logits instead, so a run config refuses the pair."""
    torch_compile: bool | Literal["auto"] = "auto"
    """`torch.compile` every decoder layer (fused norms, RoPE, SwiGLU and their backward) and, with
    logprob_chunk_tokens, the fused head's per-chunk log-softmax and its gradient. torch backend: hpcrl's decoder
    layers; megatron backend: each megatron-core TransformerLayer of the policy (its vocab-parallel log-probs
    without logprob_chunk_tokens stay eager). The first steps also compile (tens of seconds more train time).
    torch backend, one H200, Qwen3-0.6B shape, bf16, 8 x 2048 tokens: the layers alone ran 1.54x the eager
    tokens/s; with logprob_chunk_tokens (its chunks compiled too) and micro-batches of 8, 2.35x: 46.0% MFU against
    19.5%. megatron backend, the same levers, one H100: 37.3% against 15.2%
    (benchmarks/grpo-step_h200_2026-12.md). Same numbers to rounding (tests/unit/test_torch_compile.py,
    tests/unit/test_megatron.py); on a CPU it needs a C++ compiler. `auto`: true on CUDA with logprobs: plain
    (logprobs: invariant refuses it), false otherwise. The run's config.yaml and the "trainer plan:" line name the
    resolved value."""
    converters: tuple[str, ...] = ()
    """Model converters applied, in this order, when the torch backend builds the model (hpcrl/trainer/converters):
    `freeze` stops the modules of freeze_modules from training; `lora` trains low-rank adapters (the `lora` key)
    instead of the model's weights. A converter decides which parameters the optimizer holds, what a weight push
    sends, what a checkpoint holds and what an export writes (docs/lora.md)."""
    freeze_modules: tuple[str, ...] = ()
    """converters: [freeze]: modules whose parameters do not train, by name (e.g. `model.embed_tokens`,
    `lm_head`, `model.layers.0`; a module freezes all its parts). They leave the optimizer and weight pushes."""
    lora: LoRAConfig | None = None
    """converters: [lora]: the low-rank adapters that train instead of the model's weights (LoRAConfig); the
    optimizer holds only them, a push sends only them, the KL reference is the model with them off."""
    max_nan_steps: int = 3
    """A step with a non-finite loss or gradient is skipped (event `nan_skipped`); the run stops after
    this many in a row."""

    auto_resolved: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    """The keys __post_init__ resolved from `auto` (not part of the config: a run config may resolve them again
    with what it knows about the rollout)."""

    def __post_init__(self) -> None:
        resolve_device_defaults(self)
        check_converters(self)
        resolve_loss(self)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if isinstance(self.micro_batch_size, int) and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables it), got {self.grad_clip}")
        if self.max_nan_steps < 1:
            raise ValueError(f"max_nan_steps must be >= 1, got {self.max_nan_steps}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size must be >= 1, got {self.expert_parallel_size}")
        self._check_backend_limits()
        check_fsdp(self)
        if self.num_ranks % (self.tensor_parallel_size * self.pipeline_parallel_size):
            raise ValueError(
                f"num_ranks ({self.num_ranks}) must be a multiple of tensor_parallel_size x pipeline_parallel_size "
                f"({self.tensor_parallel_size} x {self.pipeline_parallel_size})"
            )
        if self.data_parallel_size % self.expert_parallel_size:
            raise ValueError(
                f"expert_parallel_size ({self.expert_parallel_size}) must divide the data-parallel size, num_ranks / "
                f"(tensor_parallel_size x pipeline_parallel_size) ({self.data_parallel_size}): Megatron places each "
                "expert-parallel group inside the data-parallel ranks; change num_ranks or expert_parallel_size"
            )
        if self.megatron_optimizer == "distributed" and not self.device.startswith("cuda"):
            raise ValueError(
                "megatron_optimizer: distributed needs CUDA (Megatron's DDP and distributed optimizer "
                f"allocate their buffers on the GPU), but device is {self.device!r}; use device: cuda, "
                "or megatron_optimizer: local (or auto) on CPU"
            )
        if self.torch_compile and self.logprobs == "invariant":
            raise ValueError(
                "torch_compile fuses the layers' kernels, but logprobs: invariant needs the trainer's forward to be "
                "the engine's batch-invariant op sequence bit for bit (docs/numerics.md); set torch_compile: false or "
                "logprobs: plain"
            )
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1 (null: the whole batch), got {self.global_batch_size}")
        if self.global_batch_size is not None and self.global_batch_size % self.data_parallel_size:
            replicas = f"num_ranks ({self.num_ranks})"
            if self.data_parallel_size != self.num_ranks:
                replicas = f"the data-parallel size, num_ranks / (TP x PP) ({self.data_parallel_size})"
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of {replicas}: every "
                "data-parallel replica trains on an equal share of each mini-batch"
            )
        if self.ppo_epochs < 1:
            raise ValueError(f"ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if not self.is_clip > 1:
            raise ValueError(f"is_clip must be > 1 (a ratio of 1 is the on-policy case), got {self.is_clip}")
        if self.off_policy_correction != "none" and self.old_logprobs == "rollout":
            raise ValueError(
                f"off_policy_correction: {self.off_policy_correction} weighs by trainer old / engine log-probs, but "
                "old_logprobs: rollout makes the engine's log-probs the old policy already, so the PPO ratio carries "
                "the correction; set old_logprobs: trainer, or off_policy_correction: none"
            )
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError("adam_beta1 and adam_beta2 must be in [0, 1)")
        if not self.adam_eps > 0:
            raise ValueError(f"adam_eps must be > 0, got {self.adam_eps}")
        for name in ("weight_decay", "eps_clip", "eps_clip_high", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if isinstance(self.logprob_chunk_tokens, int):
            if self.logprob_chunk_tokens < 1:
                raise ValueError(
                    f"logprob_chunk_tokens must be >= 1 (or null: the plain head), got {self.logprob_chunk_tokens}"
                )
            if self.logprobs == "invariant":
                raise ValueError(
                    "logprob_chunk_tokens would not be used with logprobs: invariant: the batch-invariant forward has "
                    "its own LM head on fixed row chunks; remove one of them"
                )
        if self.logprobs == "invariant" and not self.device.startswith(("cpu", "cuda")):
            raise ValueError(
                f"logprobs: invariant covers device cpu or cuda, not {self.device!r}; use one of those, or "
                "logprobs: plain (docs/numerics.md)"
            )

    @property
    def compiled(self) -> bool:
        """torch_compile as resolved (`auto` never outlives __post_init__)."""
        return self.torch_compile is True

    @property
    def chunk_tokens(self) -> int | None:
        """logprob_chunk_tokens as resolved: the fused head's chunk, None for the plain head."""
        chunk = self.logprob_chunk_tokens
        return chunk if isinstance(chunk, int) else None

    @property
    def data_parallel_size(self) -> int:
        """Replicas that each train on their share of a batch: num_ranks / (tensor x pipeline parallel size)."""
        return self.num_ranks // (self.tensor_parallel_size * self.pipeline_parallel_size)

    def _check_backend_limits(self) -> None:
        """Refuse a setting the chosen backend does not implement (BACKEND_LIMITS), naming the ones that do."""
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        for key, why in BACKEND_LIMITS[self.backend].items():
            value = getattr(self, key)
            if value != defaults[key]:
                others = " or ".join(b for b, limits in BACKEND_LIMITS.items() if key not in limits)
                raise ValueError(
                    f"{key}: {_yaml(value)} is not implemented by backend: {self.backend} ({why}); set {key}: "
                    f"{_yaml(defaults[key])}, or use backend: {others}"
                )


AUTO_CHUNK_TOKENS = 4096
"""logprob_chunk_tokens: auto on CUDA: chunks of 4096 tokens keep the fused head's [chunk x vocab] workspace small
(2.5 GB in fp32 at a 151,936-token vocabulary) while each chunk's GEMM still fills the GPU."""
FIXED_MICRO_BATCH_SIZE = 16
"""micro_batch_size: auto where no GPU memory is measured: on a CPU, and under backend: megatron."""


def resolve_device_defaults(cfg: TrainConfig) -> None:
    """Resolve the `auto` settings whose best value depends on the device, so the dumped config names what runs:
    on CUDA the fast path (compiled layers, the fused log-prob head), elsewhere the plain one (no compiler needed).
    An explicit value always wins; micro_batch_size stays `auto` on CUDA under the torch backend, where the trainer
    sizes it from the GPU's free memory."""
    cuda, plain = cfg.device.startswith("cuda"), cfg.logprobs == "plain"
    resolved = set()
    if cfg.torch_compile == "auto":
        object.__setattr__(cfg, "torch_compile", cuda and plain)
        resolved.add("torch_compile")
    if cfg.logprob_chunk_tokens == "auto":
        object.__setattr__(cfg, "logprob_chunk_tokens", AUTO_CHUNK_TOKENS if cuda and plain else None)
        resolved.add("logprob_chunk_tokens")
    if cfg.micro_batch_size == "auto" and not (cuda and cfg.backend == "torch"):
        object.__setattr__(cfg, "micro_batch_size", FIXED_MICRO_BATCH_SIZE)
        resolved.add("micro_batch_size")
    object.__setattr__(cfg, "auto_resolved", frozenset(resolved))


def resolve_loss(cfg: TrainConfig) -> None:
    """Fill the loss's own aggregation and advantage normalisation (so the dumped config names them) and refuse
    settings that would make the named objective another one."""
    if cfg.aggregation is None:
        aggregation = {"gspo": "sequence", "dr_grpo": "constant"}.get(cfg.loss, "token")
        object.__setattr__(cfg, "aggregation", aggregation)
    if cfg.normalize_advantage_std is None:
        object.__setattr__(cfg, "normalize_advantage_std", cfg.loss != "dr_grpo")
    if cfg.loss == "dr_grpo" and (cfg.normalize_advantage_std or cfg.aggregation != "constant"):
        raise ValueError(
            "loss: dr_grpo is GRPO without the std normalisation and with a constant normaliser, but "
            f"normalize_advantage_std is {_yaml(cfg.normalize_advantage_std)} and aggregation is "
            f"{cfg.aggregation}; remove those keys (or set them to false and constant), or use loss: grpo "
            "with the settings you want"
        )
    if cfg.loss == "cispo" and cfg.eps_clip != 0.2:
        raise ValueError(
            f"eps_clip: {cfg.eps_clip} does not apply to loss: cispo: its importance weight has only an upper "
            "bound, 1 + eps_clip_high (docs/objectives.md); remove eps_clip"
        )
    if cfg.overlong_window_tokens < 0:
        raise ValueError(f"overlong_window_tokens must be >= 0 (0: off), got {cfg.overlong_window_tokens}")
    if not (math.isfinite(cfg.overlong_penalty) and cfg.overlong_penalty > 0):
        raise ValueError(f"overlong_penalty must be a finite number > 0, got {cfg.overlong_penalty}")
    if cfg.overlong_penalty != 1.0 and cfg.overlong_window_tokens == 0:
        raise ValueError(
            "overlong_penalty applies with overlong_window_tokens > 0; set the window (e.g. a quarter of "
            "rollout.max_new_tokens), or remove overlong_penalty"
        )
    if cfg.constant_normalizer_tokens is not None:
        if cfg.aggregation != "constant":
            raise ValueError(
                f"constant_normalizer_tokens applies to aggregation: constant, not {cfg.aggregation}; remove it, "
                "or set aggregation: constant (or loss: dr_grpo)"
            )
        if cfg.constant_normalizer_tokens < 1:
            raise ValueError(f"constant_normalizer_tokens must be >= 1, got {cfg.constant_normalizer_tokens}")


def check_converters(cfg: TrainConfig) -> None:
    for name in cfg.converters:
        if name not in CONVERTERS:
            raise ValueError(f"converters: unknown model converter {name!r}; valid: {', '.join(CONVERTERS)}")
    if len(set(cfg.converters)) != len(cfg.converters):
        raise ValueError(f"converters lists a converter twice: {list(cfg.converters)}")
    if ("freeze" in cfg.converters) != bool(cfg.freeze_modules):
        raise ValueError(
            "freeze_modules names the modules the freeze converter freezes: set both converters: [freeze] and "
            "freeze_modules (e.g. [model.embed_tokens]), or neither"
        )
    if cfg.lora is not None and cfg.backend == "megatron":
        raise ValueError(
            f"lora is not implemented by backend: megatron ({BACKEND_LIMITS['megatron']['lora']}); remove lora "
            "and converters: [lora], or use backend: torch"
        )
    if ("lora" in cfg.converters) != (cfg.lora is not None):
        raise ValueError(
            "lora holds the settings of the lora converter: set both converters: [lora] and lora (e.g. "
            "{rank: 16, alpha: 32, target_modules: all-linear}), or neither"
        )
    if cfg.lora is not None and cfg.lora.dropout > 0 and cfg.logprobs == "invariant":
        raise ValueError(
            f"lora.dropout {cfg.lora.dropout:g} makes the training forward differ from what the engines serve, "
            "but logprobs: invariant needs it to be the very same function; set lora.dropout: 0, or logprobs: plain"
        )
    if any(not m or m != m.strip() for m in cfg.freeze_modules):
        raise ValueError(f"freeze_modules: module names must be non-empty, without spaces: {cfg.freeze_modules}")


def check_fsdp(cfg: TrainConfig) -> None:
    """train.fsdp settings act under parallelism: fsdp2 only, and must fit the ranks and the device."""
    if cfg.activation_checkpointing != "none" and cfg.logprobs == "invariant":
        raise ValueError(
            "activation_checkpointing checkpoints the decoder layers' forward, which logprobs: invariant does not run "
            "(the batch-invariant forward is its own); set activation_checkpointing: none, or logprobs: plain"
        )
    if cfg.parallelism != "fsdp2":
        if cfg.fsdp != FSDPConfig():
            raise ValueError(
                f"fsdp.* configures parallelism: fsdp2, but parallelism is {cfg.parallelism}: set parallelism: fsdp2, "
                "or remove the fsdp settings"
            )
        return
    size = cfg.fsdp.shard_group_size
    if size is not None and cfg.num_ranks % size:
        raise ValueError(
            f"fsdp.shard_group_size ({size}) must divide num_ranks ({cfg.num_ranks}): the ranks form groups of that "
            f"size that each hold one copy of the model; use a divisor of {cfg.num_ranks} (e.g. the GPUs of a node), "
            "or null to shard over all ranks"
        )
    if cfg.fsdp.offload and not cfg.device.startswith("cuda"):
        raise ValueError(
            f"fsdp.offload moves the sharded state from the GPU to host memory, but device is {cfg.device!r}: the "
            "state is in host memory already; set fsdp.offload: false, or device: cuda"
        )
    if cfg.logprobs == "invariant":
        raise ValueError(
            "logprobs: invariant runs the batch-invariant forward, which reads each layer's weights directly and so "
            "would see FSDP2's shards, not gathered weights; use parallelism: ddp with logprobs: invariant, or "
            "logprobs: plain"
        )


def fsdp_dtypes(cfg: TrainConfig) -> tuple[str, str]:
    """(param_dtype, reduce_dtype) of parallelism: fsdp2, the defaults resolved: bfloat16 compute on CUDA
    (train.dtype elsewhere) and float32 reductions."""
    param = cfg.fsdp.param_dtype or ("bfloat16" if cfg.device.startswith("cuda") else cfg.dtype)
    return param, cfg.fsdp.reduce_dtype or "float32"


def _yaml(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(kw_only=True, frozen=True)
class SFTConfig:
    """An optional supervised warm start on (prompt, answer) pairs before the first GRPO step, so the policy starts
    with a non-zero reward."""

    num_steps: int = 0
    """Supervised steps on (prompt, answer) pairs before GRPO; 0 skips the warm start."""
    batch_size: int = 32
    """(prompt, answer) pairs per SFT step, drawn from data.source in an order of their own (seed + 1);
    rollout.kind=multi_turn: synthetic tool traces per step."""
    lr: float = 1e-3
    """AdamW learning rate of the warm start (an optimizer of its own: GRPO starts with fresh Adam moments and
    train.lr); the other AdamW settings are train's; > 0."""
    log_every_steps: int = 10
    """Print an `sft N/M | loss ...` line every N SFT steps (and after the last); console only."""
    trace_wrong_operand_share: float = 0.0
    """rollout.kind=multi_turn: share of the synthetic tool traces whose calculator call has one operand digit
    wrong (the tool's answer and the final answer follow it), so GRPO has copying left to learn."""
    trace_no_tool_share: float = 0.0
    """rollout.kind=multi_turn: share of the traces that answer at once, without the tool, with a wrong guess."""

    def __post_init__(self) -> None:
        if self.num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {self.num_steps}")
        for key in ("trace_wrong_operand_share", "trace_no_tool_share"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key} must be in [0, 1], got {getattr(self, key)}")
        if self.trace_wrong_operand_share + self.trace_no_tool_share > 1:
            raise ValueError("trace_wrong_operand_share + trace_no_tool_share must be <= 1")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.log_every_steps < 1:
            raise ValueError(f"log_every_steps must be >= 1, got {self.log_every_steps}")
