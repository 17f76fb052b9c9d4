"""The PyTorch trainer: GRPO and SFT steps on hpcrl's model, one process per rank, DDP or FSDP2 across ranks.

Rank r trains on rows r, r+W, r+2W, ... of a step's batch. The step itself (mini-batches, epochs, old log-probs,
the loss, the NaN guard) is hpcrl/trainer/step.py; this backend gives it log-probs from hpcrl's model and an
update: forward and backward under the parallelism (train.parallelism, hpcrl/trainer/parallel.py), which averages
the gradients over the ranks (the step scales the losses by the world size to make that a sum), then the clip.
Under DDP every rank holds the whole model and rank 0 answers weight and state requests alone; under FSDP2 the
ranks hold shards and gather them together (hpcrl/trainer/sharded_state.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from hpcrl.model import invariant
from hpcrl.model.hf import load_model, parse_dtype, save_state_dict
from hpcrl.model.qwen3 import CausalLM, ModelArgs
from hpcrl.store.shards import ShardReader
from hpcrl.store.state_tree import flatten_state, unflatten_state
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.converters.base import ServesReference, build_converters
from hpcrl.trainer.logprobs import hidden_token_logprobs, support_token_logprobs, token_logprobs
from hpcrl.trainer.memory_plan import (
    activation_budget,
    auto_micro_batch_line,
    fit_problem,
    micro_batch_for,
    plan_memory,
    settings_line,
)
from hpcrl.trainer.moe_routing import MoeRouting
from hpcrl.trainer.parallel import ParallelPlan, apply_activation_checkpointing, apply_compile, parallelize
from hpcrl.trainer.sharded_state import (
    GatheredWeights,
    export_gathered,
    gather_full,
    host_state,
    load_full,
    local_pieces,
    read_pieces,
    shard_likes,
    shard_optimizer_state,
    write_rank_shard,
)
from hpcrl.trainer.step import MicroLoss, TrainStep
from hpcrl.trainer.step_stats import NanGuard


class LogProbs(nn.Module):
    """The model and its log-prob head as one module call: the forward a parallelism wraps. Under FSDP2 the LM
    head's weight is gathered only inside a module's forward, so the fused head (train.logprob_chunk_tokens) must
    run inside one too."""

    def __init__(self, model: CausalLM, cfg: TrainConfig) -> None:
        super().__init__()
        self.lm = model
        self.cfg = cfg

    def forward(
        self,
        input_ids: Tensor,
        supports: tuple[Tensor, Tensor] | None,
        with_entropy: bool,
        topk_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Log-probs of every target position [b, T-1] (and entropy; and with `topk_ids` [b, T-1, K] the log-probs
        of those ids at each position, the distillation teacher's top-k), as tensors of their own: FSDP2 hooks its
        backward onto a module's outputs, which must not be views ([b, T-1] floats: the copy costs nothing)."""
        lp, ent, top = self._logprobs(input_ids, supports, with_entropy, topk_ids)
        return lp.clone(), (ent.clone() if ent is not None else None), (top.clone() if top is not None else None)

    def _logprobs(
        self, input_ids: Tensor, supports: tuple[Tensor, Tensor] | None, with_entropy: bool, topk_ids: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if self.cfg.logprobs == "invariant":
            if topk_ids is not None:
                raise ValueError("distill.top_k needs train.logprobs=plain (the invariant forward scores one id)")
            # The forward the batch-invariant engine sampled from: these are its log-probs bit for bit, so
            # the loss ratio's denominator and the gap compare the trainer with the sampler itself; under
            # top-k/top-p replay, renormalised over each token's support as the engine did.
            if supports is not None:
                return invariant.support_token_logprobs(self.lm, input_ids, *supports), None, None
            return invariant.token_logprobs(self.lm, input_ids), None, None
        chunk = self.cfg.chunk_tokens
        if chunk is not None and supports is None:
            # The fused head: log-probs straight from the hidden states, no [tokens x vocab] logits in memory.
            hidden = self.lm(input_ids, hidden=True)[:, :-1]
            b, t = hidden.shape[:2]
            flat = hidden.reshape(b * t, -1)

            def head(targets: Tensor, entropy: bool) -> tuple[Tensor, Tensor | None]:
                return hidden_token_logprobs(
                    flat, self.lm.output_weight, targets.reshape(-1), chunk_tokens=chunk, with_entropy=entropy,
                    compiled=self.cfg.compiled,
                )  # fmt: skip

            lp, ent = head(input_ids[:, 1:], with_entropy)
            # The teacher's top-k: one more pass of the fused head per slot, still no [tokens x vocab] in memory.
            top = None if topk_ids is None else torch.stack([head(ids, False)[0] for ids in topk_ids.unbind(-1)], -1)
            return (
                lp.view(b, t),
                (ent.view(b, t) if ent is not None else None),
                (top.view(b, t, -1) if top is not None else None),
            )
        logits = self.lm(input_ids)
        top = None
        if topk_ids is not None:
            scores = logits[:, :-1].float()
            top = scores.gather(-1, topk_ids) - torch.logsumexp(scores, dim=-1, keepdim=True)
        if supports is not None:  # top-k/top-p: score over the ids each token was drawn from
            lp, ent = support_token_logprobs(logits[:, :-1], input_ids[:, 1:], *supports, with_entropy=with_entropy)
            return lp, ent, top
        # Score all T positions of the contiguous logits (the last one against a dummy target) and drop
        # the last: token_logprobs walks a [:, :-1] slice one sequence at a time (it has no flat view),
        # i.e. a few kernels per sequence in forward and backward, which on CPU costs more than the
        # extra row of softmax.
        targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
        lp, ent = token_logprobs(logits, targets, with_entropy=with_entropy)
        return lp[:, :-1], (ent[:, :-1] if ent is not None else None), top


class TorchTrainer:
    # The step's backend (hpcrl/trainer/step.py): DDP averages gradients; every rank computes the loss.
    averages_gradients = True
    computes_loss = True

    def __init__(
        self, cfg: TrainConfig, model_dir: str | Path, *, rank: int = 0, world_size: int = 1, sft_lr: float = 1e-3
    ) -> None:
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.rank = rank
        self.world_size = world_size
        # DDP: every rank holds the whole model, so rank 0 answers weight and state requests alone; FSDP2: every
        # rank holds a shard, and they gather together.
        self.collective = cfg.parallelism == "fsdp2"
        torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device)
        args = ModelArgs.from_dir(model_dir)
        plan = plan_memory(cfg, args)
        problem = fit_problem(plan, cfg, self.device)
        if problem is not None:
            raise ValueError(problem)
        auto_micro_batch = None
        micro_batch = f"micro_batch_size {cfg.micro_batch_size}"
        self.activation_budget: int | None = None
        """micro_batch_size: auto: the bytes activations may use, the same on every rank (checkpointed: a resume
        cuts its batches as the run did)."""
        if cfg.micro_batch_size == "auto":  # CUDA (TrainConfig resolves it elsewhere): measured before the model loads
            self.activation_budget = activation_budget(plan, cfg, self.device)
            auto_micro_batch = functools.partial(self._micro_batch_for, args)
            micro_batch = auto_micro_batch_line(cfg, args, self.activation_budget)
        if rank == 0:
            print(f"{plan.line(cfg.parallelism)}; {settings_line(cfg)}; {micro_batch}", flush=True)
        self.model: CausalLM = load_model(model_dir, dtype=parse_dtype(cfg.dtype), device=self.device)
        self.model.train()
        self.moe = MoeRouting(self.model, self.model.args.moe, cfg.routing_replay)
        if cfg.logprobs == "invariant":
            reason = invariant.supported_reason(self.device, cfg.dtype) or invariant.unsupported_model(self.model.args)
            if reason is not None:
                raise ValueError(f"train.logprobs: invariant: {reason}")
            invariant.pin_backend_numerics(self.device)
            invariant.use_kernel_tiles(cfg.invariant_kernels)
        self.converters = build_converters(cfg)
        # The KL term's reference is the policy as loaded: a copy taken before the converters run, unless one of
        # them gives it back in the model itself (LoRA: the adapters off).
        self._reference_in_model = [c for c in self.converters if isinstance(c, ServesReference)]
        self.ref_model: CausalLM | None = None
        if cfg.kl_coef > 0 and not self._reference_in_model:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        for converter in self.converters:
            converter.convert(self.model)
        apply_activation_checkpointing(self.model, cfg.activation_checkpointing)
        if cfg.torch_compile:
            apply_compile(self.model)
        # The modules the training forward (train_forward) and the scoring passes (scorer, ref_scorer) run through;
        # the weight and state calls read self.model.
        self.scorer: nn.Module = LogProbs(self.model, cfg)
        self.train_forward = parallelize(
            self.scorer, self.model, cfg.parallelism, ParallelPlan(cfg, self.device, world_size)
        )
        self.ref_scorer: nn.Module | None = None
        if self.ref_model is not None:
            ref_plan = ParallelPlan(cfg, self.device, world_size, trains=False)
            self.ref_scorer = parallelize(LogProbs(self.ref_model, cfg), self.ref_model, cfg.parallelism, ref_plan)
        self.optimizer = self._make_optimizer(cfg.lr)
        # The warm start gets an optimizer of its own, so GRPO starts from fresh Adam moments.
        self.sft_lr = sft_lr
        self._sft_optimizer: torch.optim.Optimizer | None = None
        self.dp_rank, self.dp_size = rank, world_size
        self.nan_guard = NanGuard(cfg.max_nan_steps)
        self.step = TrainStep(self, cfg, self.nan_guard, auto_micro_batch=auto_micro_batch)

    def _micro_batch_for(self, args: ModelArgs, seq_len: int) -> int:
        assert self.activation_budget is not None
        return micro_batch_for(self.cfg, args, self.activation_budget, seq_len)

    def _make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # a converter may have frozen some
            lr=lr,
            betas=(self.cfg.adam_beta1, self.cfg.adam_beta2),
            eps=self.cfg.adam_eps,
            weight_decay=self.cfg.weight_decay,
        )
        if self.converters:
            # After every step the optimizer takes (one the NaN guard skips calls no hook).
            optimizer.register_step_post_hook(lambda *_: self._post_optimizer_step())
        return optimizer

    def _post_optimizer_step(self) -> None:
        for converter in self.converters:
            converter.post_optimizer_hook(self.model)

    # ----- steps (the algorithm: hpcrl/trainer/step.py) -----
    def train_grpo(self, batch: TrainBatch) -> dict[str, float]:
        metrics = self.step.grpo(batch, self.optimizer) | self.moe.metrics()
        if self.cfg.micro_batch_size == "auto":  # the size this batch's length got, recorded with the step
            metrics["micro_batch_size"] = float(self.step.micro_batch_size(batch.input_ids.shape[1]))
        return metrics

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        if self._sft_optimizer is None:
            self._sft_optimizer = self._make_optimizer(self.sft_lr)
        return self.step.sft(batch, self._sft_optimizer)

    def score(self, mb: TrainBatch, *, reference: bool) -> Tensor:
        if reference and self._reference_in_model:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for converter in self._reference_in_model:
                    stack.enter_context(converter.reference(self.model))
                self.moe.before(self.model, mb)
                return self.scorer(mb.input_ids, mb.padded_supports(), False)[0]
        scorer = self.ref_scorer if reference else self.scorer
        assert scorer is not None, "reference log-probs need train.kl_coef > 0"
        model = self.ref_model if reference else self.model
        assert model is not None
        self.moe.before(model, mb)
        with torch.no_grad():
            return scorer(mb.input_ids, mb.padded_supports(), False)[0]

    def update(self, optimizer: Any, mbs: list[TrainBatch], loss: MicroLoss) -> tuple[float, float]:
        optimizer.zero_grad(set_to_none=True)
        forward_s = 0.0
        for i, mb in enumerate(mbs):
            t0 = time.perf_counter()
            self.moe.before(self.model, mb)
            lp, entropy, top = self.train_forward(mb.input_ids, mb.padded_supports(), True, mb.teacher_topk_ids)
            forward_s += time.perf_counter() - t0
            out = loss(i, lp, entropy, top)
            aux = self.moe.after(self.model, mb)
            # The load-balancing term once per optimizer step, as the loss's micro-batch parts add up to one.
            (out if aux is None else out + aux / len(mbs)).backward()
        clip = self.cfg.grad_clip or float("inf")
        if not self.collective:
            return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip).item()), forward_s
        # Sharded gradients: each rank's norm is a partial one, summed over the ranks before the clip.
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = gather_full(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        return float(norm.item()), forward_s

    def all_reduce(self, values: Tensor, op: str) -> Tensor:
        if self.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return values

    def share(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics  # every rank computed them

    # ----- weights and state -----
    def push_weights(self, *, full: bool = False) -> list[tuple[str, Tensor]]:
        """What a weight push sends: the tensors a step can change, as the converters decide (every weight
        without converters); `full`: every weight, for engines that dropped theirs."""
        state = self._weights()
        for converter in reversed(self.converters):
            state = converter.export_state(self.model, state) if full else converter.push_state(self.model, state)
        if self.collective:
            # Shards: gathered one at a time as the push's bucket loop reads them, on every rank at once.
            return GatheredWeights(state.items())
        return list(state.items())

    def export_weights(self) -> list[tuple[str, Tensor]]:
        """The whole model in Hugging Face names: what an export writes (sharded: gathered one tensor at a time
        into rank 0's host memory, [] on the other ranks, which must call it too)."""
        state = self._weights()
        for converter in reversed(self.converters):
            state = converter.export_state(self.model, state)
        if self.collective:
            for converter in self.converters:
                converter.gather_for_export(self.model)
            return list(host_state(state, keep=self.rank == 0).items())
        return list(state.items())

    def _weights(self) -> dict[str, Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def state(self, *, shards_to: Path | None = None) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Model and optimizer state as tensors + JSON skeleton (no pickle), for checkpoints.

        Host copies (on a CPU run too: the checkpoint is written from them while training goes on). Sharded, with
        `shards_to` (the run's checkpoints folder; every rank calls it): each rank writes its pieces of the sharded
        tensors there for the next checkpoint (hpcrl/store/shards.py) and the rest is returned; without it every
        tensor is gathered whole in turn, kept by rank 0 alone, as a DDP run's.
        """
        named = {f"model/{k}": v for k, v in self._checkpointed(self.model.state_dict()).items()}
        opt_tensors, skeleton = flatten_state(self.optimizer.state_dict(), prefix="optimizer/")
        named.update(opt_tensors)
        if self.ref_model is not None:
            named.update({f"ref_model/{k}": v for k, v in self.ref_model.state_dict().items()})
        if self.collective and shards_to is not None:
            pieces = local_pieces(named)
            named = {k: v for k, v in named.items() if not isinstance(v, DTensor)}
            write_rank_shard(shards_to, self.rank, self.world_size, pieces)
        tensors = host_state(named, keep=not self.collective or self.rank == 0)
        state: dict[str, Any] = {"optimizer": skeleton, "num_nan_in_a_row": self.nan_guard.in_a_row}
        if self.activation_budget is not None:
            state["activation_budget_bytes"] = self.activation_budget
        metas = {c.name: c.checkpoint_meta(self.model) for c in self.converters}
        if any(metas.values()):
            state["converters"] = {name: meta for name, meta in metas.items() if meta}
        return tensors, state

    def _checkpointed(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        for converter in reversed(self.converters):
            state = converter.checkpoint_state(self.model, state)
        return state

    def load_state(self, tensors: dict[str, Tensor], state: dict[str, Any], *, shards: Path | None = None) -> None:
        """Load a checkpoint's state; `shards`: its shard files' folder, whose pieces this rank reads (the box of
        each tensor it holds, on any rank count)."""
        if state.get("backend", "torch") != "torch":
            raise ValueError(
                f"this checkpoint was written by the {state['backend']} trainer backend; resume it with "
                f"train.backend={state['backend']}"
            )
        if shards is not None:
            likes = shard_likes(self.model, self.ref_model, self.optimizer)
            tensors = {**tensors, **read_pieces(ShardReader(shards), likes)}
        model_state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        metas = state.get("converters", {})
        for converter in self.converters:
            converter.check_resume(self.model, metas.get(converter.name))
        unknown = sorted(set(metas) - {c.name for c in self.converters})
        if unknown:
            raise ValueError(
                f"this checkpoint was written with the model converters {unknown}, which this run does not apply; "
                "resume with the train.converters (and their settings) the run was started with"
            )
        self._check_frozen(model_state)
        expected = set(self._checkpointed(self.model.state_dict()))
        if set(model_state) != expected:
            odd = sorted(set(model_state) ^ expected)[:3]
            raise ValueError(
                f"this checkpoint's model tensors do not fit this run's model (e.g. {odd}); resume with the "
                "model.path, train.converters and their settings the run was started with"
            )
        ref = {k.removeprefix("ref_model/"): v for k, v in tensors.items() if k.startswith("ref_model/")}
        opt = {k: v for k, v in tensors.items() if k.startswith("optimizer/")}
        opt_state = unflatten_state(opt, state["optimizer"])
        if self.collective:  # whole tensors, each cut into this rank's shard
            load_full(self.model, model_state, "model", only=expected)
            if self.ref_model is not None:
                load_full(self.ref_model, ref, "reference model")
            opt_state = shard_optimizer_state(opt_state, self.optimizer)
        else:
            # Tensors a checkpoint leaves out are ones no step changes: they stay as loaded from model.path.
            self.model.load_state_dict(model_state, strict=False)
            if self.ref_model is not None:
                self.ref_model.load_state_dict(ref, strict=True)
        try:
            self.optimizer.load_state_dict(opt_state)
        except ValueError as exc:  # torch's words: a parameter group of another size
            raise ValueError(
                f"this checkpoint's optimizer state does not fit this run's trainable parameters ({exc}); resume "
                "with the train.converters and train.freeze_modules the run was started with"
            ) from exc
        self.nan_guard.in_a_row = int(state.get("num_nan_in_a_row", 0))
        saved = state.get("activation_budget_bytes")
        if self.activation_budget is not None and saved is not None:
            # The run's own budget, so its batches get the same micro-batches (bitwise resumes), unless this
            # machine has less room than the one that wrote the checkpoint.
            self.activation_budget = min(int(saved), self.activation_budget)

    def _check_frozen(self, model_state: dict[str, Tensor]) -> None:
        """A parameter that does not train is left out of pushes, so engines serve the copy they loaded from
        model.path: a checkpoint must hold that same copy."""
        for name, p in self.model.named_parameters():
            if not p.requires_grad and name in model_state and not _same(model_state[name], p):
                raise ValueError(
                    f"this checkpoint's {name} differs from model.path's, but this run does not train it "
                    f"(train.converters {list(self.cfg.converters)}), so engines would serve model.path's; resume "
                    "with the model.path, train.converters and train.freeze_modules the run was started with"
                )

    def export(self, out_dir: str | Path, *, max_file_bytes: int = 2 << 30) -> Path:
        """The whole model as a Hugging Face directory (sharded: rank 0 writes a safetensors file of about
        `max_file_bytes` at a time, gathered one tensor at a time; the other ranks call `export_weights`)."""
        if self.collective:
            state = self._weights()
            for converter in reversed(self.converters):
                state = converter.export_state(self.model, state)
            for converter in self.converters:  # as export_weights does on the other ranks, in the same order
                converter.gather_for_export(self.model)
            out = export_gathered(
                state, Path(out_dir), self.model_dir, keep=self.rank == 0, max_file_bytes=max_file_bytes
            )
        else:
            out = save_state_dict(dict(self.export_weights()), out_dir, source_dir=self.model_dir)
        for converter in self.converters:
            converter.export_files(self.model, out, base_dir=self.model_dir)
        return out


def _same(saved: Tensor, param: Tensor) -> bool:
    """Whether a checkpoint's whole tensor equals a parameter (a shard: gathered, so every rank must ask)."""
    whole = gather_full(param.detach())
    return torch.equal(gather_full(saved).to(whole.device), whole)
