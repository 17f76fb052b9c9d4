"""Pure-torch losses for the trainer: the policy-gradient objectives (GRPO, GSPO, CISPO, Dr. GRPO), the SFT loss and
numerics checks (token log-probs: logprobs.py). docs/objectives.md says what each objective does to the gradient.

Shapes: ``B`` sequences, ``T`` positions, ``V`` vocabulary. ``mask`` marks the response tokens that
count; every other position may hold any value (padding, prompt) and never leaks into a loss, a
gradient or a statistic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "OBJECTIVES",
    "PolicyLossConfig",
    "importance_weights",
    "logprob_mismatch",
    "policy_loss",
    "sft_loss",
]

Aggregation = Literal["token", "sequence", "constant"]
_AGGREGATIONS = ("token", "sequence", "constant")
Objective = Literal["grpo", "gspo", "cispo", "dr_grpo"]
OBJECTIVES: tuple[Objective, ...] = ("grpo", "gspo", "cispo", "dr_grpo")
Correction = Literal["tis", "mis"]


# --------------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossConfig:
    """Policy-gradient loss settings.

    ``objective`` picks the surrogate (``policy_loss``); ``eps_clip`` bounds the ratio from below
    (``1 - eps_clip``) and ``eps_clip_high`` from above (``1 + eps_clip_high``); a wider upper bound
    ("clip-higher", DAPO) lets low-probability tokens grow and slows entropy collapse. ``cispo`` caps its
    importance weight at ``1 + eps_clip_high`` and has no lower bound. ``aggregation='constant'`` divides
    the sum of token losses by sequences x ``tokens_per_sequence``.
    """

    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    aggregation: Aggregation = "token"
    objective: Objective = "grpo"
    tokens_per_sequence: int | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if (self.aggregation == "constant") != (self.tokens_per_sequence is not None):
            raise ValueError(
                "tokens_per_sequence is the constant normaliser of aggregation='constant': set both or neither, "
                f"got aggregation={self.aggregation!r}, tokens_per_sequence={self.tokens_per_sequence}"
            )
        if self.tokens_per_sequence is not None and self.tokens_per_sequence < 1:
            raise ValueError(f"tokens_per_sequence must be >= 1, got {self.tokens_per_sequence}")
        if not (0.0 < self.eps_clip < 1.0):
            raise ValueError(f"eps_clip must be in (0, 1), got {self.eps_clip}")
        if not (math.isfinite(self.eps_clip_high) and self.eps_clip_high > 0.0):
            raise ValueError(f"eps_clip_high must be a finite number > 0, got {self.eps_clip_high}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0.0):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if not (math.isfinite(self.entropy_coef) and self.entropy_coef >= 0.0):
            raise ValueError(f"entropy_coef must be a finite number >= 0, got {self.entropy_coef}")
        if self.aggregation not in _AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {self.aggregation!r}")


def _check_bt(name: str, x: Tensor, shape: torch.Size) -> None:
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    # where, not multiply: padding may hold inf/NaN (e.g. -inf log-probs) and 0 * inf is NaN.
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _k3(log_ratio: Tensor) -> Tensor:
    """k3 estimator of KL(p || q) from samples of p with ``log_ratio = log q - log p``: unbiased, >= 0."""
    return torch.expm1(log_ratio) - log_ratio


def _aggregate(
    per_token: Tensor,
    mask: Tensor,
    aggregation: str,
    loss_scale_tokens: float | None,
    loss_scale_sequences: float | None,
    tokens_per_sequence: int | None = None,
) -> Tensor:
    """Reduce a masked ``[B, T]`` loss to a scalar; see ``policy_loss`` for the micro-batch scales."""
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "token":
        if loss_scale_sequences is not None:
            raise ValueError("loss_scale_sequences only applies to aggregation='sequence'")
        total = _masked(per_token, mask).sum()
        if loss_scale_tokens is not None:
            if not loss_scale_tokens > 0:
                raise ValueError(f"loss_scale_tokens must be > 0, got {loss_scale_tokens}")
            return total / loss_scale_tokens
        return total / mask.sum().clamp_min(1)
    if loss_scale_tokens is not None:
        raise ValueError("loss_scale_tokens only applies to aggregation='token'")
    lengths = mask.sum(dim=-1)
    if aggregation == "constant":
        if tokens_per_sequence is None:
            raise ValueError("aggregation='constant' needs tokens_per_sequence")
        # Dr. GRPO: a sum over tokens with a normaliser that depends on no sample's length, so a long wrong
        # answer is not penalised less per token than a short one.
        total = _masked(per_token, mask).sum()
        if loss_scale_sequences is not None:
            if not loss_scale_sequences > 0:
                raise ValueError(f"loss_scale_sequences must be > 0, got {loss_scale_sequences}")
            return total / (loss_scale_sequences * tokens_per_sequence)
        return total / ((lengths > 0).sum().clamp_min(1) * tokens_per_sequence)
    per_seq = _masked(per_token, mask).sum(dim=-1) / lengths.clamp_min(1)
    # Sequences without a single response token have no mean; they are left out of the count too.
    if loss_scale_sequences is not None:
        if not loss_scale_sequences > 0:
            raise ValueError(f"loss_scale_sequences must be > 0, got {loss_scale_sequences}")
        return per_seq.sum() / loss_scale_sequences
    return per_seq.sum() / (lengths > 0).sum().clamp_min(1)


def _as_bool_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    token_weights: Tensor | None = None,
    loss_scale_tokens: float | None = None,
    loss_scale_sequences: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The policy-gradient objective ``cfg.objective``, optional k3 KL to a reference and entropy bonus.

    Per masked token: ``pg + kl_coef * k3 - entropy_coef * H``, where ``pg`` is the objective's surrogate
    (``_surrogate``: the PPO clip on the token ratio for grpo and dr_grpo, on the sequence ratio for gspo, a
    capped stop-gradient weight on the log-prob for cispo). ``old_logprobs`` and ``ref_logprobs`` are treated
    as constants.

    Args:
        logprobs: ``[B, T]`` current-policy log-probs (differentiable).
        old_logprobs: ``[B, T]`` behaviour-policy log-probs (the rollout's or recomputed).
        advantages: ``[B]`` per sample (broadcast over its tokens) or ``[B, T]`` per token.
        mask: ``[B, T]`` bool (or 0/1) marking response tokens.
        cfg: the loss settings.
        ref_logprobs: ``[B, T]`` reference-policy log-probs; the KL term needs them and ``kl_coef > 0``.
        entropy: ``[B, T]`` per-token entropy (differentiable for the bonus to act).
        token_weights: ``[B, T]`` constants multiplying each token's policy-gradient term (importance
            weights, ``importance_weights``); the KL and entropy terms are not weighted.
        loss_scale_tokens: 'token' aggregation only. By default the sum is divided by this call's masked
            token count, so micro-batches of a step each get their own mean and tokens in short
            micro-batches weigh more. Passing the step's global masked token count instead makes the
            micro-batch losses (and gradients) sum exactly to the full-batch token mean.
        loss_scale_sequences: the same for 'sequence' and 'constant' aggregation: the step's global count
            of sequences with at least one masked token.

    Returns:
        ``(loss, stats)``. Stats are python floats over this call's masked tokens: ``pg_loss`` (the
        policy-gradient term under ``cfg.aggregation``, local normalisation), ``pg_clipfrac`` (share of
        tokens where the clip is active: the gradient is cut; for cispo, the weight is capped and the
        gradient kept), ``ppo_kl`` (mean of
        ``old - new`` log-probs), ``entropy`` and ``kl`` when given, and ``num_tokens``.
    """
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(shape)}")
    _check_bt("old_logprobs", old_logprobs, shape)
    _check_bt("mask", mask, shape)
    if advantages.dim() == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"advantages must be [B] = [{shape[0]}] or [B, T], got {tuple(advantages.shape)}")
        advantages = advantages[:, None]
    else:
        _check_bt("advantages", advantages, shape)
    mask = _as_bool_mask(mask)
    # Masked like everything else: per-token advantages may be NaN on padding, and NaN * 0 poisons grads.
    advantages = _masked(advantages.detach().to(logprobs.dtype).expand(shape), mask)
    old_logprobs = old_logprobs.detach()

    log_ratio = _masked(logprobs - old_logprobs, mask)
    pg, clipped = _surrogate(_masked(logprobs, mask), log_ratio, advantages, mask, cfg)
    if token_weights is not None:
        _check_bt("token_weights", token_weights, shape)
        pg = pg * _masked(token_weights.detach().to(pg.dtype), mask)

    per_token = pg
    kl: Tensor | None = None
    if ref_logprobs is not None:
        _check_bt("ref_logprobs", ref_logprobs, shape)
        # k3 of KL(pi || ref) with samples from pi: log(ref / pi) = ref - lp.
        kl = _k3(_masked(ref_logprobs.detach() - logprobs, mask))
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    if entropy is not None:
        _check_bt("entropy", entropy, shape)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * _masked(entropy, mask)

    loss = _aggregate(
        per_token, mask, cfg.aggregation, loss_scale_tokens, loss_scale_sequences, cfg.tokens_per_sequence
    )

    with torch.no_grad():
        n = mask.sum()
        denom = n.clamp_min(1).to(logprobs.dtype)
        names = ["pg_loss", "pg_clipfrac", "ppo_kl"]
        values = [
            _aggregate(pg, mask, cfg.aggregation, None, None, cfg.tokens_per_sequence),
            clipped.sum() / denom,
            -_masked(log_ratio, mask).sum() / denom,
        ]
        if entropy is not None:
            names.append("entropy")
            values.append(_masked(entropy.detach(), mask).sum().to(logprobs.dtype) / denom)
        if kl is not None:
            names.append("kl")
            values.append(_masked(kl, mask).sum() / denom)
        names.append("num_tokens")
        values.append(n.to(logprobs.dtype))
        # One device sync for all stats instead of one per .item(); double so python floats lose nothing.
        stats = dict(zip(names, torch.stack([v.detach().double() for v in values]).tolist(), strict=True))
    return loss, stats


def _surrogate(
    logprobs: Tensor, log_ratio: Tensor, advantages: Tensor, mask: Tensor, cfg: PolicyLossConfig
) -> tuple[Tensor, Tensor]:
    """The per-token policy-gradient term of ``cfg.objective`` and where its clip acts (inputs masked).

    - ``grpo``, ``dr_grpo``: the PPO clipped surrogate on the token ratio ``r_t = exp(lp_t - old_t)``:
      ``max(-A r_t, -A clip(r_t, 1 - eps_clip, 1 + eps_clip_high))`` (Shao et al. 2024, "DeepSeekMath";
      Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training", differs only in the advantage and
      the aggregation, chosen by the config).
    - ``gspo``: the same clip on the sequence ratio ``s = exp(mean_t(lp_t - old_t))``, the geometric mean of
      the token ratios, so a whole sample is clipped or kept (Zheng et al. 2025, "Group Sequence Policy
      Optimization"). Written in the paper's GSPO-token form, ``sg(s) * exp(lp_t - sg(lp_t))``: the value
      is ``s`` on every token and, with per-sample advantages and 'sequence' aggregation, the gradient is
      GSPO's exactly; per-token advantages (a dense signal) then also reach their own tokens.
    - ``cispo``: ``-sg(min(r_t, 1 + eps_clip_high)) A lp_t``: the importance weight is capped and
      detached instead of the token being clipped, so every token keeps its gradient, the rare
      high-ratio "fork" tokens included (MiniMax 2025, "MiniMax-M1", CISPO; no lower bound, as there).
    """
    lo, hi = 1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high
    if cfg.objective == "cispo":
        ratio = torch.exp(log_ratio).detach()
        weight = ratio.clamp(max=hi)
        return -advantages * weight * logprobs, (ratio > hi) & mask
    if cfg.objective == "gspo":
        lengths = mask.sum(dim=-1, keepdim=True).clamp_min(1)
        seq_log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / lengths).detach()
        log_ratio = _masked(seq_log_ratio + logprobs - logprobs.detach(), mask)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, lo, hi)
    return torch.maximum(pg_unclipped, pg_clipped), (pg_clipped > pg_unclipped) & mask


@torch.no_grad()
def importance_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, mode: Correction, is_clip: float
) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights correcting for the engine sampling from a slightly different policy than the trainer's.

    ``r = exp(old_logprobs - rollout_logprobs)``: the trainer's old-policy probability of the sampled token over
    the engine's. ``tis`` (truncated IS) gives ``min(r, is_clip)``; ``mis`` (masked IS, IcePop-style) gives
    ``r`` where ``r <= is_clip`` and 0 above, so a token the engine sampled far more readily than the trainer
    would is left out instead of trained on at a capped weight. Weights are 0 off the mask.

    Returns ``(weights [B, T], stats)``: ``is_weight_mean`` (mean weight over masked tokens) and
    ``is_clipped_share`` (share of masked tokens with ``r > is_clip``: truncated or masked).
    """
    _check_bt("rollout_logprobs", rollout_logprobs, old_logprobs.shape)
    _check_bt("mask", mask, old_logprobs.shape)
    if mode not in ("tis", "mis"):
        raise ValueError(f"mode must be 'tis' or 'mis', got {mode!r}")
    if not is_clip > 1:
        raise ValueError(f"is_clip must be > 1, got {is_clip}")
    mask = _as_bool_mask(mask)
    ratio = torch.exp(_masked(old_logprobs.float() - rollout_logprobs.float(), mask))
    over = (ratio > is_clip) & mask
    if mode == "tis":
        weights = ratio.clamp(max=is_clip)
    else:
        weights = torch.where(over, torch.zeros_like(ratio), ratio)
    weights = _masked(weights, mask)
    denom = mask.sum().clamp_min(1)
    values = torch.stack([weights.sum() / denom, over.sum() / denom]).double().tolist()
    return weights, dict(zip(["is_weight_mean", "is_clipped_share"], values, strict=True))


def sft_loss(
    logprobs: Tensor,
    mask: Tensor,
    *,
    aggregation: Aggregation = "token",
    loss_scale_tokens: float | None = None,
    loss_scale_sequences: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Negative log-likelihood of the answer tokens (``mask``), aggregated like ``policy_loss``.

    Stats: ``sft_nll`` (mean NLL per masked token in this call) and ``num_tokens``.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    _check_bt("mask", mask, logprobs.shape)
    mask = _as_bool_mask(mask)
    loss = _aggregate(-logprobs, mask, aggregation, loss_scale_tokens, loss_scale_sequences)
    with torch.no_grad():
        n = mask.sum()
        nll = -_masked(logprobs.detach(), mask).sum() / n.clamp_min(1)
        stats = dict(zip(["sft_nll", "num_tokens"], torch.stack([nll.double(), n.double()]).tolist(), strict=True))
    return loss, stats


@torch.no_grad()
def logprob_mismatch(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the trainer's log-probs are from the engine's on the same tokens (DESIGN §8).

    Returns ``train_rollout_logprob_abs_diff`` (mean ``|train - rollout|``),
    ``train_rollout_logprob_max_abs_diff`` and ``train_rollout_kl``: the k3 estimate of
    KL(rollout || train). The tokens were sampled from the rollout policy, so k3 with
    ``log(train / rollout)`` is unbiased for that direction and, unlike the plain mean of
    ``rollout - train``, never negative, so a small value cannot hide cancelling errors. All are 0.0
    when no token is masked.
    """
    _check_bt("rollout_logprobs", rollout_logprobs, train_logprobs.shape)
    _check_bt("mask", mask, train_logprobs.shape)
    mask = _as_bool_mask(mask)
    diff = _masked(train_logprobs.detach().double() - rollout_logprobs.detach().double(), mask)
    denom = mask.sum().clamp_min(1)
    values = torch.stack(
        [
            diff.abs().sum() / denom,
            diff.abs().max() if diff.numel() else diff.new_zeros(()),
            _masked(_k3(diff), mask).sum() / denom,
        ]
    )
    keys = ["train_rollout_logprob_abs_diff", "train_rollout_logprob_max_abs_diff", "train_rollout_kl"]
    return dict(zip(keys, values.tolist(), strict=True))
