"""The PyTorch trainer: GRPO and SFT steps on hpcrl's model, one process per rank, DDP across ranks.

Every rank holds the full model (DDP); rank r trains on rows r, r+W, r+2W, ... of a step's batch.
Losses are scaled by the global token count (all-reduced) times the world size, so that DDP's gradient
average equals the gradient of the whole batch's token mean.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hpcrl.model import invariant
from hpcrl.model.hf import load_model, parse_dtype, save_model
from hpcrl.model.qwen3 import CausalLM
from hpcrl.store.checkpoint import flatten_state, unflatten_state
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.loss import PolicyLossConfig, policy_loss, sft_loss, token_logprobs
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
        if cfg.onpolicy and (reason := invariant.unsupported_model(self.model.args)) is not None:
            raise ValueError(f"train.onpolicy: {reason}")
        self.ref_model: CausalLM | None = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.ddp: torch.nn.Module = self.model
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(
                self.model, device_ids=None if self.device.type == "cpu" else [self.device]
            )
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
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=lr,
            betas=(self.cfg.adam_beta1, self.cfg.adam_beta2),
            eps=self.cfg.adam_eps,
            weight_decay=self.cfg.weight_decay,
        )

    # ----- steps -----
    def train_grpo(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of a GRPO batch."""
        return self._step(self._shard(batch), mode="grpo", optimizer=self.optimizer)

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

    def _logprobs(self, model: torch.nn.Module, mb: TrainBatch) -> tuple[Tensor, Tensor | None]:
        """Log-probs of every target position [b, T-1] (and entropy)."""
        if self.cfg.onpolicy:
            # The forward the batch-invariant engine sampled from: these are its log-probs bit for bit, so
            # the loss ratio's denominator and the gap compare the trainer with the sampler itself.
            return invariant.token_logprobs(model, mb.input_ids), None
        logits = model(mb.input_ids)
        return token_logprobs(logits[:, :-1], mb.input_ids[:, 1:], with_entropy=True)

    def _step(self, batch: TrainBatch, *, mode: str, optimizer: torch.optim.Optimizer) -> dict[str, float]:
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
                loss, stats = policy_loss(
                    lp,
                    lp.detach(),
                    mb.advantages,
                    mb.loss_mask,
                    self.loss_cfg,
                    ref_logprobs=ref,
                    entropy=entropy,
                    loss_scale_tokens=scale_tokens,
                )
                sums.add_rollout_gap(lp, mb, tokens)
            loss.backward()
            sums.sums["loss"] += float(loss.detach().item()) * self.world_size
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
    def named_weights(self) -> list[tuple[str, Tensor]]:
        return [(k, v.detach()) for k, v in self.model.state_dict().items()]

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Model and optimizer state as tensors + JSON skeleton (no pickle), for checkpoints."""
        tensors = {f"model/{k}": v.detach().cpu() for k, v in self.model.state_dict().items()}
        opt_tensors, skeleton = flatten_state(self.optimizer.state_dict(), prefix="optimizer/")
        tensors.update({k: v.cpu() for k, v in opt_tensors.items()})
        if self.ref_model is not None:
            tensors.update({f"ref_model/{k}": v.detach().cpu() for k, v in self.ref_model.state_dict().items()})
        return tensors, {"optimizer": skeleton, "num_nan_in_a_row": self.nan_guard.in_a_row}

    def load_state(self, tensors: dict[str, Tensor], state: dict[str, Any]) -> None:
        if state.get("backend", "torch") != "torch":
            raise ValueError(
                f"this checkpoint was written by the {state['backend']} trainer backend; resume it with "
                f"train.backend={state['backend']}"
            )
        model_state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        self.model.load_state_dict(model_state, strict=True)
        if self.ref_model is not None:
            ref = {k.removeprefix("ref_model/"): v for k, v in tensors.items() if k.startswith("ref_model/")}
            self.ref_model.load_state_dict(ref, strict=True)
        opt = {k: v for k, v in tensors.items() if k.startswith("optimizer/")}
        self.optimizer.load_state_dict(unflatten_state(opt, state["optimizer"]))
        self.nan_guard.in_a_row = int(state.get("num_nan_in_a_row", 0))

    def export(self, out_dir: str | Path) -> Path:
        return save_model(self.model, out_dir, source_dir=self.model_dir)
