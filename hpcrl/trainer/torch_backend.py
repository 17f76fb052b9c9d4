"""The PyTorch trainer: GRPO and SFT steps on hpcrl's model, one process per rank, DDP across ranks.

Every rank holds the full model (DDP); rank r trains on rows r, r+W, r+2W, ... of a step's batch.
Losses are scaled by the global token count (all-reduced) times the world size, so that DDP's gradient
average equals the gradient of the whole batch's token mean.

A rollout batch makes `ppo_epochs` x (batch / global_batch_size) optimizer steps, each on one mini-batch
split over the ranks like the whole batch is; the old policy's log-probs are scored once, before the first
step, unless that single step's own forward gives them (the default: one step, no extra pass).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from hpcrl.model import invariant
from hpcrl.model.hf import load_model, parse_dtype, save_state_dict
from hpcrl.model.qwen3 import CausalLM
from hpcrl.store.checkpoint import flatten_state, unflatten_state
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.converters.base import build_converters
from hpcrl.trainer.loss import (
    PolicyLossConfig,
    hidden_token_logprobs,
    importance_weights,
    policy_loss,
    sft_loss,
    support_token_logprobs,
    token_logprobs,
)
from hpcrl.trainer.parallel import apply_compile, parallelize
from hpcrl.trainer.step_stats import NanGuard, StepSums


class TorchTrainer:
    # Every rank holds the whole model: rank 0 answers weight and state requests alone.
    collective = False

    def __init__(
        self, cfg: TrainConfig, model_dir: str | Path, *, rank: int = 0, world_size: int = 1, sft_lr: float = 1e-3
    ) -> None:
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.rank = rank
        self.world_size = world_size
        torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device)
        self.model: CausalLM = load_model(model_dir, dtype=parse_dtype(cfg.dtype), device=self.device)
        self.model.train()
        if cfg.onpolicy:
            reason = invariant.supported_reason(self.device, cfg.dtype) or invariant.unsupported_model(self.model.args)
            if reason is not None:
                raise ValueError(f"train.onpolicy: {reason}")
            invariant.pin_backend_numerics(self.device)
        self.ref_model: CausalLM | None = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        # After the reference copy: the KL term's reference is the policy as loaded.
        self.converters = build_converters(cfg)
        for converter in self.converters:
            converter.convert(self.model)
        if cfg.torch_compile:
            apply_compile(self.model)
        # The module the training forward runs through; the weight and state calls read self.model.
        self.ddp: torch.nn.Module = parallelize(self.model, "ddp", device=self.device, world_size=world_size)
        self.optimizer = self._make_optimizer(cfg.lr)
        # The warm start gets an optimizer of its own, so GRPO starts from fresh Adam moments.
        self.sft_lr = sft_lr
        self._sft_optimizer: torch.optim.Optimizer | None = None
        self.loss_cfg = PolicyLossConfig(
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip_high,
            kl_coef=cfg.kl_coef,
            entropy_coef=cfg.entropy_coef,
            aggregation=cfg.aggregation,
        )
        self.nan_guard = NanGuard(cfg.max_nan_steps)

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

    # ----- steps -----
    def train_grpo(self, batch: TrainBatch) -> dict[str, float]:
        """The PPO updates of one rollout batch on this rank's share of it: `ppo_epochs` passes over its
        mini-batches of `global_batch_size` samples, one optimizer step each."""
        local = self._shard(batch).to(self.device)
        minis = self._mini_batches(len(batch), len(local))
        num_updates = len(minis) * self.cfg.ppo_epochs
        t0 = time.perf_counter()
        old = self._old_logprobs(local, num_updates)
        old_s = time.perf_counter() - t0
        steps = []
        for _ in range(self.cfg.ppo_epochs):
            for rows in minis:
                mb_old = None if old is None else old[rows]
                steps.append(self._step(local.select(rows), mode="grpo", optimizer=self.optimizer, old=mb_old))
        return _combine_updates(steps, len(minis), old_s)

    def _mini_batches(self, num_samples: int, num_local: int) -> list[slice]:
        """This rank's rows of each mini-batch: mini-batch j is rows [j*g, (j+1)*g) of the rollout batch and
        rank r holds its rows r, r+W, ...; with the strided shard those are local rows [j*g/W, (j+1)*g/W)."""
        gbs = self.cfg.global_batch_size
        if gbs is None:
            return [slice(0, num_local)]
        if num_samples % gbs:
            raise ValueError(
                f"train.global_batch_size={gbs} does not divide this rollout batch of {num_samples} samples"
            )
        per_rank = gbs // self.world_size
        return [slice(j * per_rank, (j + 1) * per_rank) for j in range(num_samples // gbs)]

    def _old_logprobs(self, local: TrainBatch, num_updates: int) -> Tensor | None:
        """The old policy's log-probs [n, T-1], or None when the first update's own forward gives them."""
        if self.cfg.old_logprobs == "rollout":
            return local.rollout_logprobs
        if num_updates == 1:
            # Nothing has changed the weights yet: the ratio is 1 by construction and the old log-probs
            # are the training forward detached, so a second (no-grad) forward would only cost time.
            return None
        out = torch.zeros(local.loss_mask.shape, dtype=torch.float32, device=self.device)
        mbs = self.cfg.micro_batch_size
        with torch.no_grad():
            for start in range(0, len(local), mbs):
                mb = local.select(slice(start, min(start + mbs, len(local))))
                lp, _ = self._logprobs(self.model, mb, with_entropy=False)
                out[start : start + len(mb), : lp.shape[1]] = lp
        return out

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        if self._sft_optimizer is None:
            self._sft_optimizer = self._make_optimizer(self.sft_lr)
        return self._step(self._shard(batch), mode="sft", optimizer=self._sft_optimizer)

    def _shard(self, batch: TrainBatch) -> TrainBatch:
        if self.world_size == 1:
            return batch
        return batch.select(torch.arange(self.rank, len(batch), self.world_size))

    def _global_sum(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def _logprobs(
        self, model: torch.nn.Module, mb: TrainBatch, *, with_entropy: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs of every target position [b, T-1] (and entropy)."""
        supports = mb.padded_supports()
        if self.cfg.onpolicy:
            # The forward the batch-invariant engine sampled from: these are its log-probs bit for bit, so
            # the loss ratio's denominator and the gap compare the trainer with the sampler itself; under
            # top-k/top-p replay, renormalised over each token's support as the engine did.
            if supports is not None:
                return invariant.support_token_logprobs(model, mb.input_ids, *supports), None
            return invariant.token_logprobs(model, mb.input_ids), None
        chunk = self.cfg.logprob_chunk_tokens
        if chunk is not None and supports is None:
            # The fused head: log-probs straight from the hidden states, no [tokens x vocab] logits in memory.
            hidden = model(mb.input_ids, hidden=True)[:, :-1]
            head = cast(CausalLM, model.module if isinstance(model, DistributedDataParallel) else model)
            b, t = hidden.shape[:2]
            lp, ent = hidden_token_logprobs(
                hidden.reshape(b * t, -1),
                head.output_weight,
                mb.input_ids[:, 1:].reshape(-1),
                chunk_tokens=chunk,
                with_entropy=with_entropy,
                compiled=self.cfg.torch_compile,
            )
            return lp.view(b, t), (ent.view(b, t) if ent is not None else None)
        logits = model(mb.input_ids)
        if supports is not None:  # top-k/top-p: score over the ids each token was drawn from
            return support_token_logprobs(logits[:, :-1], mb.input_ids[:, 1:], *supports, with_entropy=with_entropy)
        # Score all T positions of the contiguous logits (the last one against a dummy target) and drop
        # the last: token_logprobs walks a [:, :-1] slice one sequence at a time (it has no flat view),
        # i.e. a few kernels per sequence in forward and backward, which on CPU costs more than the
        # extra row of softmax.
        targets = torch.cat([mb.input_ids[:, 1:], mb.input_ids[:, :1]], dim=1)
        lp, ent = token_logprobs(logits, targets, with_entropy=with_entropy)
        return lp[:, :-1], (ent[:, :-1] if ent is not None else None)

    def _step(
        self, batch: TrainBatch, *, mode: str, optimizer: torch.optim.Optimizer, old: Tensor | None = None
    ) -> dict[str, float]:
        """One optimizer step; `old` [n, >= T-1] are the old-policy log-probs (None: this forward's, detached)."""
        batch = batch.to(self.device)
        optimizer.zero_grad(set_to_none=True)
        forward_s = 0.0
        global_tokens = self._global_sum(float(batch.num_response_tokens))
        if global_tokens == 0:
            raise ValueError("the batch has no response tokens to train on")
        # DDP averages gradients over ranks; scaling by the world size turns that into a sum.
        scale_tokens = global_tokens / self.world_size
        sums = StepSums()
        n = len(batch)
        mbs = self.cfg.micro_batch_size
        for start in range(0, max(n, 1), mbs):
            mb = batch.select(slice(start, min(start + mbs, n)))
            tokens = float(mb.num_response_tokens)
            t0 = time.perf_counter()
            lp, entropy = self._logprobs(self.ddp, mb)
            forward_s += time.perf_counter() - t0
            if mode == "sft":
                loss, stats = sft_loss(lp, mb.loss_mask, loss_scale_tokens=scale_tokens)
            else:
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref, _ = self._logprobs(self.ref_model, mb)
                mb_old = lp.detach() if old is None else old[start : start + len(mb), : lp.shape[1]]
                weights = None
                if self.cfg.off_policy_correction != "none":
                    weights, is_stats = importance_weights(
                        mb_old, mb.rollout_logprobs, mb.loss_mask,
                        mode=self.cfg.off_policy_correction, is_clip=self.cfg.is_clip,
                    )  # fmt: skip
                    sums.add(is_stats, tokens)
                loss, stats = policy_loss(
                    lp,
                    mb_old,
                    mb.advantages,
                    mb.loss_mask,
                    self.loss_cfg,
                    ref_logprobs=ref,
                    entropy=entropy,
                    token_weights=weights,
                    loss_scale_tokens=scale_tokens,
                )
                sums.add_rollout_gap(lp, mb, tokens)
            loss.backward()
            # Each rank's loss is scaled by the world size already (above): their sum is W x the batch mean.
            sums.sums["loss"] += float(loss.detach().item())
            sums.add(stats, tokens)
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip or float("inf")).item()
        )
        totals = sums.sums
        metrics = {k: self._global_sum(v) / global_tokens for k, v in totals.items() if k not in ("loss",)}
        if "train_rollout_logprob_max_abs_diff" in totals:
            metrics["train_rollout_logprob_max_abs_diff"] = totals["train_rollout_logprob_max_abs_diff"]
        metrics["loss"] = self._global_sum(totals["loss"]) / self.world_size
        metrics["grad_norm"] = grad_norm
        metrics["num_tokens"] = global_tokens
        metrics["forward_s"] = forward_s
        return self.nan_guard.step(optimizer, metrics)

    # ----- weights and state -----
    def push_weights(self, *, full: bool = False) -> list[tuple[str, Tensor]]:
        """What a weight push sends: the tensors a step can change, as the converters decide (every weight
        without converters); `full`: every weight, for engines that dropped theirs."""
        if full:
            return self.export_weights()
        state = self._weights()
        for converter in reversed(self.converters):
            state = converter.push_state(self.model, state)
        return list(state.items())

    def export_weights(self) -> list[tuple[str, Tensor]]:
        """The whole model in Hugging Face names: what an export writes."""
        state = self._weights()
        for converter in reversed(self.converters):
            state = converter.export_state(self.model, state)
        return list(state.items())

    def _weights(self) -> dict[str, Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Model and optimizer state as tensors + JSON skeleton (no pickle), for checkpoints.

        Host copies (on a CPU run too: the checkpoint is written from them while training goes on).
        """
        tensors = {f"model/{k}": _host_copy(v) for k, v in self.model.state_dict().items()}
        opt_tensors, skeleton = flatten_state(self.optimizer.state_dict(), prefix="optimizer/")
        tensors.update({k: _host_copy(v) for k, v in opt_tensors.items()})
        if self.ref_model is not None:
            tensors.update({f"ref_model/{k}": _host_copy(v) for k, v in self.ref_model.state_dict().items()})
        return tensors, {"optimizer": skeleton, "num_nan_in_a_row": self.nan_guard.in_a_row}

    def load_state(self, tensors: dict[str, Tensor], state: dict[str, Any]) -> None:
        if state.get("backend", "torch") != "torch":
            raise ValueError(
                f"this checkpoint was written by the {state['backend']} trainer backend; resume it with "
                f"train.backend={state['backend']}"
            )
        model_state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        self._check_frozen(model_state)
        self.model.load_state_dict(model_state, strict=True)
        if self.ref_model is not None:
            ref = {k.removeprefix("ref_model/"): v for k, v in tensors.items() if k.startswith("ref_model/")}
            self.ref_model.load_state_dict(ref, strict=True)
        opt = {k: v for k, v in tensors.items() if k.startswith("optimizer/")}
        try:
            self.optimizer.load_state_dict(unflatten_state(opt, state["optimizer"]))
        except ValueError as exc:  # torch's words: a parameter group of another size
            raise ValueError(
                f"this checkpoint's optimizer state does not fit this run's trainable parameters ({exc}); resume "
                "with the train.converters and train.freeze_modules the run was started with"
            ) from exc
        self.nan_guard.in_a_row = int(state.get("num_nan_in_a_row", 0))

    def _check_frozen(self, model_state: dict[str, Tensor]) -> None:
        """A parameter that does not train is left out of pushes, so engines serve the copy they loaded from
        model.path: a checkpoint must hold that same copy."""
        for name, p in self.model.named_parameters():
            if not p.requires_grad and name in model_state and not torch.equal(model_state[name].to(p.device), p):
                raise ValueError(
                    f"this checkpoint's {name} differs from model.path's, but this run does not train it "
                    f"(train.converters {list(self.cfg.converters)}), so engines would serve model.path's; resume "
                    "with the model.path, train.converters and train.freeze_modules the run was started with"
                )

    def export(self, out_dir: str | Path) -> Path:
        return save_state_dict(dict(self.export_weights()), out_dir, source_dir=self.model_dir)


def _host_copy(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu", copy=True)


def _combine_updates(steps: list[dict[str, float]], num_minis: int, old_logprob_s: float) -> dict[str, float]:
    """One row for a rollout batch's updates: statistics averaged over the updates; the trainer/engine gap
    and the token count over the first epoch (each sample once; mini-batch j measured after j updates)."""
    if len(steps) == 1:
        out = dict(steps[0])
    else:
        first = steps[:num_minis]
        tokens = [m["num_tokens"] for m in first]
        out = {k: sum(m[k] for m in steps) / len(steps) for k in steps[0] if k in _MEAN_OVER_UPDATES}
        for k in ("train_rollout_logprob_abs_diff", "train_rollout_kl"):
            out[k] = sum(m[k] * t for m, t in zip(first, tokens, strict=True)) / sum(tokens)
        out["train_rollout_logprob_max_abs_diff"] = max(m["train_rollout_logprob_max_abs_diff"] for m in first)
        out["num_tokens"] = sum(tokens)
        out["forward_s"] = sum(m["forward_s"] for m in steps)
        out["nan_skipped"] = sum(m["nan_skipped"] for m in steps)
    out["forward_s"] += old_logprob_s
    out["num_optimizer_steps"] = float(len(steps))
    return out


_MEAN_OVER_UPDATES = (
    "loss", "grad_norm", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl", "is_weight_mean", "is_clipped_share",
)  # fmt: skip
