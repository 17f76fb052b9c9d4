"""The trainer step, written once for every backend: GRPO/PPO updates of a rollout batch, and the SFT step.

A rollout batch makes `ppo_epochs` x (batch / global_batch_size) optimizer updates. Mini-batch j is rows
[j*g, (j+1)*g) of the batch, split over the data-parallel replicas as the whole batch is (replica d holds rows
d, d+DP, ...), and cut into micro-batches of `micro_batch_size` rows. The old policy's log-probs are the
engine's (`old_logprobs: rollout`) or the trainer's, scored once before the first update; a single update takes
them from its own training forward, detached (the ratio is 1 and a second, no-grad pass would only cost time).
The reference policy (KL) is scored once per rollout batch too. Each micro-batch's loss is
`hpcrl.trainer.loss.policy_loss` (or `sft_loss`) scaled by the update's global token count, so the gradients
the backend sums (or averages) over replicas are the gradient of the mini-batch's token mean.

A backend implements `StepBackend` and keeps its own mechanics: how it runs a forward and backward (DDP, a
pipeline schedule), how it scores log-probs (vocab-parallel, the batch-invariant forward), its optimizer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal, Protocol

import torch
from torch import Tensor

from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.distill import sparse_forward_kl
from hpcrl.trainer.loss import PolicyLossConfig, importance_weights, policy_loss, sft_loss
from hpcrl.trainer.step_stats import NanGuard, SteppableOptimizer, StepSums


class MicroLoss(Protocol):
    """`loss(i, logprobs, entropy, topk_logprobs)` of micro-batch i: the scalar to differentiate (the step records
    its statistics). `topk_logprobs` [b, T-1, K]: the policy's log-probs of the teacher's top-k ids (distill.top_k);
    a backend that does not score them leaves it out."""

    def __call__(self, i: int, lp: Tensor, entropy: Tensor | None, topk: Tensor | None = None, /) -> Tensor: ...


SizeRule = Callable[[int], int]

PEAK = "train_rollout_logprob_max_abs_diff"
"""The one statistic that is a maximum over tokens, not a token-weighted mean."""


class StepBackend(Protocol):
    """What a trainer backend gives the step (`TrainStep`); the contract:

    - Every rank of the trainer makes the same calls in the same order (they may be collective).
    - Data parallelism: replica `dp_rank` of `dp_size` trains on rows dp_rank, dp_rank + dp_size, ... of a batch;
      every rank of one replica (tensor and pipeline parallel peers) gets the same rows. `averages_gradients`:
      the replicas' gradients are averaged (DDP), not summed; the step then scales losses up by `dp_size`.
    - Log-probs are float32 [b, T-1] on `device` for a micro-batch of b rows trimmed to T positions: column t
      scores token t+1. Where sampling supports are recorded (top-k/top-p replay) they are scored over them.
    - `computes_loss`: this rank gets log-probs (False: a pipeline stage before the last). `score` returns None
      and `update` never calls the loss on such a rank; `share` hands it the loss ranks' metrics.
    """

    dp_rank: int
    dp_size: int
    averages_gradients: bool
    computes_loss: bool
    device: torch.device

    def score(self, mb: TrainBatch, *, reference: bool) -> Tensor | None:
        """Log-probs of the policy (or of the frozen reference copy, kept when train.kl_coef > 0) without grad."""
        ...

    def update(self, optimizer: SteppableOptimizer, mbs: list[TrainBatch], loss: MicroLoss) -> tuple[float, float]:
        """Zero the gradients, forward and backward every micro-batch (differentiating `loss(i, logprobs, entropy)`
        of micro-batch i, entropy [b, T-1] or None), reduce the gradients over data-parallel replicas and clip
        them to train.grad_clip (0: no clip). Returns (the global gradient norm before clipping, forward seconds).
        The optimizer step itself is the step's (taken or skipped by the NaN guard)."""
        ...

    def all_reduce(self, values: Tensor, op: Literal["sum", "max"]) -> Tensor:
        """float64 `values` reduced over the data-parallel replicas (called on loss ranks only)."""
        ...

    def share(self, metrics: dict[str, float]) -> dict[str, float]:
        """The loss ranks' metrics on every rank (rank 0 logs them; every rank's NaN guard must decide alike)."""
        ...


class TrainStep:
    """The GRPO/PPO and SFT steps of one backend; `nan_guard` is the backend's (its count is checkpointed)."""

    def __init__(
        self, backend: StepBackend, cfg: TrainConfig, nan_guard: NanGuard, *, auto_micro_batch: SizeRule | None = None
    ) -> None:
        self.backend = backend
        self.cfg = cfg
        self.nan_guard = nan_guard
        self.auto_micro_batch = auto_micro_batch
        """micro_batch_size: auto: the backend's rule, sequences per micro-batch for a batch's padded length."""
        if cfg.aggregation == "constant" and cfg.constant_normalizer_tokens is None:
            raise ValueError("train.aggregation: constant needs train.constant_normalizer_tokens (e.g. max_new_tokens)")
        self.loss_cfg = PolicyLossConfig(
            eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, kl_coef=cfg.kl_coef,
            entropy_coef=cfg.entropy_coef, aggregation=cfg.aggregation or "token", objective=cfg.loss,
            tokens_per_sequence=cfg.constant_normalizer_tokens,
        )  # fmt: skip

    def grpo(self, batch: TrainBatch, optimizer: SteppableOptimizer) -> dict[str, float]:
        """The PPO updates of one rollout batch on this replica's share of it: `ppo_epochs` passes over its
        mini-batches of `global_batch_size` samples, one optimizer step each."""
        local = self._shard(batch)
        minis = [self._micro_batches(local, rows) for rows in self._mini_batches(len(batch), len(local))]
        num_updates = len(minis) * self.cfg.ppo_epochs
        t0 = time.perf_counter()
        old = self._old_logprobs(minis, num_updates)
        ref = [self._scores(mbs, reference=True) for mbs in minis] if self.cfg.kl_coef > 0 else None
        scoring_s = time.perf_counter() - t0
        updates = []
        for _ in range(self.cfg.ppo_epochs):
            for j, mbs in enumerate(minis):
                mb_old, mb_ref = (None if old is None else old[j]), (None if ref is None else ref[j])
                updates.append(self._update(mbs, optimizer, old=mb_old, ref=mb_ref))
        return combine_updates(updates, len(minis), scoring_s)

    def sft(self, batch: TrainBatch, optimizer: SteppableOptimizer) -> dict[str, float]:
        """One optimizer step of the negative log-likelihood of the answer tokens over the whole batch."""
        local = self._shard(batch)
        return self._update(self._micro_batches(local, slice(0, len(local))), optimizer, sft=True)

    # ----- rows -----
    def micro_batch_size(self, seq_len: int) -> int:
        """Sequences per micro-batch for a batch padded to `seq_len` tokens: train.micro_batch_size, or under `auto`
        the backend's rule (the same on every rank: each sees the whole batch's padded length)."""
        size = self.cfg.micro_batch_size
        if isinstance(size, int):
            return size
        if self.auto_micro_batch is None:
            raise ValueError("train.micro_batch_size: auto is sized by the torch backend on CUDA; set a number")
        return self.auto_micro_batch(seq_len)

    def _shard(self, batch: TrainBatch) -> TrainBatch:
        b = self.backend
        if b.dp_size > 1:
            batch = batch.select(torch.arange(b.dp_rank, len(batch), b.dp_size))
        return batch.to(b.device)

    def _mini_batches(self, num_samples: int, num_local: int) -> list[slice]:
        """This replica's rows of each mini-batch: mini-batch j is rows [j*g, (j+1)*g) of the rollout batch and
        replica d holds its rows d, d+DP, ...; with the strided shard those are local rows [j*g/DP, (j+1)*g/DP)."""
        gbs = self.cfg.global_batch_size
        if gbs is None:
            return [slice(0, num_local)]
        if num_samples % gbs:
            raise ValueError(
                f"train.global_batch_size={gbs} does not divide this rollout batch of {num_samples} samples"
            )
        per_replica = gbs // self.backend.dp_size
        return [slice(j * per_replica, (j + 1) * per_replica) for j in range(num_samples // gbs)]

    def _micro_batches(self, local: TrainBatch, rows: slice) -> list[TrainBatch]:
        """Micro-batches of `rows`, each trimmed to its longest sequence; an empty share still makes one (empty)
        micro-batch, so that every rank takes part in the update's collectives."""
        start, stop, mbs = rows.start, rows.stop, self.micro_batch_size(local.input_ids.shape[1])
        return [local.select(slice(a, min(a + mbs, stop))) for a in range(start, max(stop, start + 1), mbs)]

    # ----- log-probs of the old and the reference policy -----
    def _old_logprobs(self, minis: list[list[TrainBatch]], num_updates: int) -> list[list[Tensor | None]] | None:
        """The old policy's log-probs of every micro-batch, or None when the first update's own forward gives them."""
        if self.cfg.old_logprobs == "rollout":
            return [[mb.rollout_logprobs for mb in mbs] for mbs in minis]
        if num_updates == 1:
            # Nothing has changed the weights yet: the ratio is 1 by construction and the old log-probs
            # are the training forward detached, so a second (no-grad) forward would only cost time.
            return None
        return [self._scores(mbs, reference=False) for mbs in minis]

    def _scores(self, mbs: list[TrainBatch], *, reference: bool) -> list[Tensor | None]:
        return [self.backend.score(mb, reference=reference) for mb in mbs]

    # ----- one optimizer update -----
    def _update(
        self,
        mbs: list[TrainBatch],
        optimizer: SteppableOptimizer,
        *,
        old: list[Tensor | None] | None = None,
        ref: list[Tensor | None] | None = None,
        sft: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over micro-batches `mbs`; `old` are their old-policy log-probs (None: each training
        forward's own, detached), `ref` the reference policy's."""
        b = self.backend
        local = [float(sum(mb.num_response_tokens for mb in mbs)), float(sum(_num_sequences(mb) for mb in mbs))]
        counts = b.all_reduce(torch.tensor(local, dtype=torch.float64, device=b.device), "sum").tolist()
        global_tokens, global_sequences = counts
        if global_tokens == 0:
            raise ValueError("the batch has no response tokens to train on")
        # The loss's global denominator (tokens, or sequences under the per-sequence aggregations) gives every
        # micro-batch the same normaliser. Averaged gradients (DDP) scaled by the replica count are a sum.
        by_sequence = not sft and self.loss_cfg.aggregation != "token"
        scale = global_sequences if by_sequence else global_tokens
        scale = scale / b.dp_size if b.averages_gradients else scale
        scales = {"loss_scale_sequences": scale} if by_sequence else {"loss_scale_tokens": scale}
        sums = StepSums()

        def loss(i: int, lp: Tensor, entropy: Tensor | None, topk: Tensor | None = None, /) -> Tensor:
            mb, tokens = mbs[i], float(mbs[i].num_response_tokens)
            if sft:
                out, stats = sft_loss(lp, mb.loss_mask, loss_scale_tokens=scale)
            else:
                mb_old = old[i] if old is not None else None
                mb_old = lp.detach() if mb_old is None else mb_old[:, : lp.shape[1]]
                weights = None
                if self.cfg.off_policy_correction != "none":
                    weights, is_stats = importance_weights(
                        mb_old, mb.rollout_logprobs, mb.loss_mask,
                        mode=self.cfg.off_policy_correction, is_clip=self.cfg.is_clip,
                    )  # fmt: skip
                    sums.add(is_stats, tokens)
                out, stats = policy_loss(
                    lp, mb_old, mb.advantages, mb.loss_mask, self.loss_cfg,
                    ref_logprobs=None if ref is None else ref[i], entropy=entropy, token_weights=weights, **scales,
                )  # fmt: skip
                sums.add_rollout_gap(lp, mb, tokens)
                if by_sequence and tokens:
                    # pg_loss is this micro-batch's per-sequence figure and the step's sums weigh by tokens: weigh
                    # it by its sequences instead, so the step's value does not depend on how rows were split.
                    stats["pg_loss"] *= _num_sequences(mb) / tokens * global_tokens / global_sequences
            if not sft and mb.teacher_topk_weights is not None and mb.teacher_topk_logprobs is not None:
                if topk is None:
                    raise ValueError("distill.top_k: this trainer backend does not score the teacher's top-k ids")
                # A token mean over the update's response tokens, whatever train.aggregation (docs/distillation.md).
                per_token = sparse_forward_kl(topk, mb.teacher_topk_logprobs, mb.teacher_topk_weights)
                token_scale = global_tokens / b.dp_size if b.averages_gradients else global_tokens
                out = out + per_token.sum() / token_scale
                stats["distill_forward_kl_topk"] = float(per_token.detach().sum().item()) / max(tokens, 1.0)
            sums.sums["loss"] += float(out.detach().item())
            sums.add(stats, tokens)
            return out

        grad_norm, forward_s = b.update(optimizer, mbs, loss)
        metrics = b.share(self._reduce(sums, global_tokens) if b.computes_loss else {})
        metrics.update(grad_norm=grad_norm, num_tokens=global_tokens, forward_s=forward_s)
        return self.nan_guard.step(optimizer, metrics)

    def _reduce(self, step_sums: StepSums, global_tokens: float) -> dict[str, float]:
        """Token means over all replicas; `loss` is the sum of the scaled micro-batch losses (the batch's mean)."""
        b, sums = self.backend, step_sums.sums
        keys = sorted(k for k in sums if k != PEAK)
        totals = b.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=b.device), "sum")
        metrics = {k: v if k == "loss" else v / global_tokens for k, v in zip(keys, totals.tolist(), strict=True)}
        if b.averages_gradients:  # each replica's losses were scaled up by the replica count (above)
            metrics["loss"] /= b.dp_size
        if PEAK in sums:
            peak = torch.tensor([sums[PEAK]], dtype=torch.float64, device=b.device)
            metrics[PEAK] = float(b.all_reduce(peak, "max").item())
        return metrics


def _num_sequences(mb: TrainBatch) -> int:
    """Rows with at least one response token: the count of the per-sequence aggregations."""
    return int((mb.loss_mask.sum(dim=-1) > 0).sum().item())


def combine_updates(steps: list[dict[str, float]], num_minis: int, scoring_s: float) -> dict[str, float]:
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
        out[PEAK] = max(m[PEAK] for m in first)
        out["num_tokens"] = sum(tokens)
        out["forward_s"] = sum(m["forward_s"] for m in steps)
        out["nan_skipped"] = sum(m["nan_skipped"] for m in steps)
    out["forward_s"] += scoring_s
    out["num_optimizer_steps"] = float(len(steps))
    return out


_MEAN_OVER_UPDATES = (
    "loss", "grad_norm", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl", "is_weight_mean", "is_clipped_share",
)  # fmt: skip
