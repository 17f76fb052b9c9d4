"""Unit tests for hpcrl.trainer.loss, hpcrl.trainer.logprobs and hpcrl.trainer.advantage (CPU, hand-computed cases)."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.trainer.advantage import group_advantages, zero_std_group_share
from hpcrl.trainer.logprobs import support_mask_from_ids, token_logprobs
from hpcrl.trainer.loss import PolicyLossConfig, logprob_mismatch, policy_loss, sft_loss

# The CI box has two shared cores; intra-op threading only adds contention for tensors this small.
torch.set_num_threads(1)

F64 = torch.float64


def _t(x: object, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def _reference_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, support: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Straightforward full-tensor autograd implementation to compare the chunked one against."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if support is not None:
        allowed = support | ~support.any(dim=-1, keepdim=True)
        x = x.masked_fill(~allowed, -math.inf)
    logp = x.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), entropy


# --------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------


def test_group_advantages_hand_computed() -> None:
    rewards = _t([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards, eps=0.0)
    assert torch.allclose(adv[0], _t([1.0, -1.0, 1.0, -1.0]))
    # Population std: mean 0.25, var = (3 * 0.0625 + 0.5625) / 4 = 0.1875.
    std = math.sqrt(0.1875)
    assert torch.allclose(adv[1], _t([-0.25, -0.25, -0.25, 0.75]) / std)
    assert torch.allclose(adv.mean(dim=1), torch.zeros(2, dtype=F64), atol=1e-12)


def test_group_advantages_eps_and_centering_only() -> None:
    rewards = _t([[2.0, 0.0]])
    assert torch.allclose(group_advantages(rewards, eps=1.0), _t([[0.5, -0.5]]))
    assert torch.allclose(group_advantages(rewards, normalize_std=False), _t([[1.0, -1.0]]))


@pytest.mark.parametrize("normalize_std", [True, False])
def test_zero_std_groups_get_exact_zero(normalize_std: bool) -> None:
    # 0.1 is not exactly representable, so mean() can differ from the rewards by an ulp.
    rewards = torch.tensor([[0.1] * 7, [1.0] * 7, [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]], dtype=torch.float32)
    adv = group_advantages(rewards, normalize_std=normalize_std)
    assert torch.equal(adv[:2], torch.zeros(2, 7))
    assert not torch.isnan(adv).any()
    assert (adv[2] != 0).all()
    adv_no_eps = group_advantages(rewards, eps=0.0, normalize_std=normalize_std)
    assert torch.equal(adv_no_eps[:2], torch.zeros(2, 7))


def test_zero_std_group_share() -> None:
    rewards = _t([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.25]])
    assert zero_std_group_share(rewards) == 0.5
    assert zero_std_group_share(torch.zeros(0, 4)) == 0.0


def test_group_advantages_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="floating"):
        group_advantages(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(2, 2), eps=-1.0)


# --------------------------------------------------------------------------------------------------
# Token log-probs
# --------------------------------------------------------------------------------------------------


def test_token_logprobs_hand_computed_with_temperature() -> None:
    logits = _t([[[0.0, math.log(3.0)]]])
    targets = torch.tensor([[1]])
    lp, ent = token_logprobs(logits, targets)
    assert ent is None
    assert lp.shape == (1, 1)
    assert math.isclose(lp.item(), math.log(0.75), rel_tol=1e-12)
    # At temperature 2 the logits halve: p = sqrt(3) / (1 + sqrt(3)).
    lp_t2, _ = token_logprobs(logits, targets, temperature=2.0)
    assert math.isclose(lp_t2.item(), math.log(math.sqrt(3.0) / (1.0 + math.sqrt(3.0))), rel_tol=1e-12)


def test_token_logprobs_output_dtype_is_float32_for_low_precision() -> None:
    logits = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    lp, ent = token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), with_entropy=True)
    assert lp.dtype == torch.float32
    assert ent is not None and ent.dtype == torch.float32


def test_entropy_hand_computed() -> None:
    # Uniform over V has entropy log V; uniform over a support of k ids has log k.
    logits = torch.zeros(1, 2, 8, dtype=F64)
    support = torch.zeros(1, 2, 8, dtype=torch.bool)
    support[0, 1, :3] = True
    targets = torch.tensor([[5, 2]])
    lp, ent = token_logprobs(logits, targets, support_mask=support, with_entropy=True)
    assert ent is not None
    # Row 0 has no recorded support, so it stays the full distribution.
    assert torch.allclose(ent[0], _t([math.log(8.0), math.log(3.0)]))
    assert torch.allclose(lp[0], _t([-math.log(8.0), -math.log(3.0)]))
    # Two-way distribution p = (0.25, 0.75).
    _, ent2 = token_logprobs(_t([[[0.0, math.log(3.0)]]]), torch.tensor([[0]]), with_entropy=True)
    assert ent2 is not None
    assert math.isclose(ent2.item(), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), rel_tol=1e-12)


def test_support_mask_renormalises_over_the_support() -> None:
    torch.manual_seed(0)
    vocab = 10
    logits = torch.randn(1, 1, vocab, dtype=F64)
    ids = [1, 4, 7]
    support = support_mask_from_ids([ids], vocab).view(1, 1, vocab)
    total = 0.0
    for i in ids:
        lp, _ = token_logprobs(logits, torch.tensor([[i]]), support_mask=support)
        manual = logits[0, 0, i] - torch.logsumexp(logits[0, 0, ids], dim=0)
        assert math.isclose(lp.item(), manual.item(), rel_tol=1e-12)
        total += math.exp(lp.item())
    assert math.isclose(total, 1.0, rel_tol=1e-12)


def test_support_mask_from_ids() -> None:
    mask = support_mask_from_ids([[0, 2], [], [3]], 4)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]], dtype=torch.bool))
    with pytest.raises(ValueError, match="support ids"):
        support_mask_from_ids([[4]], 4)


def test_target_outside_support_raises() -> None:
    support = torch.zeros(1, 1, 4, dtype=torch.bool)
    support[0, 0, 0] = True
    with pytest.raises(ValueError, match="excludes the target"):
        token_logprobs(torch.zeros(1, 1, 4), torch.tensor([[2]]), support_mask=support)


def test_token_logprobs_rejects_bad_input() -> None:
    logits = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="targets must lie"):
        token_logprobs(logits, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="support_mask"):
        token_logprobs(logits, torch.zeros(1, 2, dtype=torch.long), support_mask=torch.ones(1, 2, 4))
    with pytest.raises(ValueError, match="B, T, V"):
        token_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("with_support", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_reference_forward_and_backward(with_support: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    b, t, v = 3, 5, 17
    full = torch.randn(b, t + 1, v, dtype=dtype)
    targets = torch.randint(0, v, (b, t))
    support = None
    if with_support:
        support = torch.rand(b, t, v) < 0.4
        support.scatter_(-1, targets[..., None], True)
        support[1, 2] = False  # a position without recorded support
    w_lp, w_ent = torch.randn(b, t), torch.randn(b, t)

    leaf = full.clone().requires_grad_()
    # logits[:, :-1] cannot be viewed as [B*T, V]; it exercises the per-sequence block path.
    lp, ent = token_logprobs(
        leaf[:, :-1], targets, temperature=0.7, support_mask=support, with_entropy=True, chunk_rows=4
    )
    assert ent is not None
    (lp * w_lp + ent * w_ent).sum().backward()

    ref_leaf = full.clone().requires_grad_()
    ref_lp, ref_ent = _reference_logprobs(ref_leaf[:, :-1], targets, 0.7, support)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()

    assert torch.allclose(lp, ref_lp, atol=1e-5)
    assert torch.allclose(ent, ref_ent, atol=1e-5)
    assert leaf.grad is not None and ref_leaf.grad is not None
    assert leaf.grad.dtype == dtype
    assert torch.allclose(leaf.grad.float(), ref_leaf.grad.float(), atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(leaf.grad[:, -1], torch.zeros(b, v, dtype=dtype))


def test_gradcheck_float64() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 6, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 6, (2, 4))
    support = torch.rand(2, 4, 6) < 0.5
    support.scatter_(-1, targets[..., None], True)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = token_logprobs(x, targets, temperature=1.3, support_mask=support, with_entropy=True, chunk_rows=3)
        assert ent is not None
        return lp, ent

    assert torch.autograd.gradcheck(fn, (logits,))


def test_chunk_size_and_grad_mode_do_not_change_results() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 6, 9)
    targets = torch.randint(0, 9, (4, 6))
    before = logits.clone()
    results = [token_logprobs(logits, targets, with_entropy=True, chunk_rows=c) for c in (1, 5, 1024)]
    with torch.no_grad():
        results.append(token_logprobs(logits.requires_grad_(), targets, with_entropy=True))
    for lp, ent in results[1:]:
        assert torch.allclose(lp, results[0][0]) and ent is not None
        assert torch.allclose(ent, results[0][1])
    # fp32 logits must not be scaled or masked in place by the chunk loop.
    assert torch.equal(logits.detach(), before)


def test_entropy_only_backward() -> None:
    logits = torch.randn(1, 3, 5, dtype=F64, requires_grad=True)
    targets = torch.zeros(1, 3, dtype=torch.long)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, with_entropy=True)[1], (logits,))


# --------------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"eps_clip": 0.0}, "eps_clip"),
        ({"eps_clip": 1.0}, "eps_clip"),
        ({"eps_clip_high": 0.0}, "eps_clip_high"),
        ({"eps_clip_high": math.inf}, "eps_clip_high"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"entropy_coef": -0.1}, "entropy_coef"),
        ({"entropy_coef": math.nan}, "entropy_coef"),
        ({"aggregation": "seq"}, "aggregation"),
    ],
)
def test_config_validation(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        PolicyLossConfig(**kwargs)  # type: ignore[arg-type]


def test_config_defaults_and_frozen() -> None:
    cfg = PolicyLossConfig()
    assert (cfg.eps_clip, cfg.eps_clip_high, cfg.kl_coef, cfg.entropy_coef, cfg.aggregation) == (
        0.2,
        0.28,
        0.0,
        0.0,
        "token",
    )
    with pytest.raises(AttributeError):
        cfg.eps_clip = 0.3  # type: ignore[misc]


def test_clip_region_hand_computed() -> None:
    # One token per case: (advantage, ratio) -> per-token loss, clipped?
    #   A=+1, r=1.1  -> -1.1   inside the clip range
    #   A=+1, r=1.5  -> -1.28  clipped at 1 + eps_clip_high (gradient cut)
    #   A=-1, r=1.5  -> +1.5   unclipped: max(1.5, 1.28)
    #   A=-1, r=0.5  -> +0.8   clipped at 1 - eps_clip
    #   A=+1, r=0.5  -> -0.5   unclipped: max(-0.5, -0.8)
    ratios = _t([[1.1, 1.5, 1.5, 0.5, 0.5]])
    adv = _t([[1.0, 1.0, -1.0, -1.0, 1.0]])
    old = _t([[-1.0, -2.0, -0.5, -3.0, -1.5]])
    lp = (old + ratios.log()).requires_grad_()
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, stats = policy_loss(lp, old, adv, mask, PolicyLossConfig())
    expected = [-1.1, -1.28, 1.5, 0.8, -0.5]
    assert math.isclose(loss.item(), sum(expected) / 5, rel_tol=1e-9)
    assert math.isclose(stats["pg_loss"], sum(expected) / 5, rel_tol=1e-9)
    assert stats["pg_clipfrac"] == pytest.approx(2 / 5)
    assert stats["ppo_kl"] == pytest.approx(-ratios.log().mean().item())
    assert stats["num_tokens"] == 5
    loss.backward()
    assert lp.grad is not None
    # d/dlp of -A * r / N is -A * r / N where unclipped; 0 where clipped.
    expected_grad = _t([[-1.1, 0.0, 1.5, 0.0, -0.5]]) / 5
    assert torch.allclose(lp.grad, expected_grad)


def test_gradient_sign_follows_advantage() -> None:
    old = torch.zeros(2, 3, dtype=F64)
    lp = old.clone().requires_grad_()
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, _ = policy_loss(lp, old, _t([1.0, -1.0]), mask, PolicyLossConfig())
    loss.backward()
    assert lp.grad is not None
    # Gradient descent raises the log-prob of positively rewarded tokens and lowers the others.
    assert (lp.grad[0] < 0).all()
    assert (lp.grad[1] > 0).all()


def test_zero_advantages_give_zero_gradient() -> None:
    torch.manual_seed(4)
    old = torch.randn(3, 4, dtype=F64)
    lp = (old + 0.3 * torch.randn(3, 4, dtype=F64)).requires_grad_()
    loss, stats = policy_loss(lp, old, torch.zeros(3, dtype=F64), torch.ones(3, 4), PolicyLossConfig())
    loss.backward()
    assert loss.item() == 0.0 and stats["pg_loss"] == 0.0
    assert lp.grad is not None and torch.equal(lp.grad, torch.zeros_like(lp))


def test_identical_logprobs_ratio_one() -> None:
    torch.manual_seed(5)
    old = torch.randn(2, 4, dtype=F64)
    adv = _t([0.5, -2.0])
    mask = torch.ones(2, 4)
    loss, stats = policy_loss(old.clone(), old, adv, mask, PolicyLossConfig())
    assert stats["ppo_kl"] == 0.0
    assert stats["pg_clipfrac"] == 0.0
    # With r = 1 the loss is just -mean(A) over tokens.
    assert math.isclose(loss.item(), -adv.mean().item(), rel_tol=1e-12)


def test_token_and_sequence_aggregation_differ_on_unequal_lengths() -> None:
    # Sequence 0 has one response token, sequence 1 has three; r = 1 so each token's loss is -A.
    old = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    adv = _t([2.0, 1.0])
    tok, _ = policy_loss(old, old, adv, mask, PolicyLossConfig(aggregation="token"))
    seq, seq_stats = policy_loss(old, old, adv, mask, PolicyLossConfig(aggregation="sequence"))
    assert math.isclose(tok.item(), -(2.0 + 3 * 1.0) / 4)
    assert math.isclose(seq.item(), -(2.0 + 1.0) / 2)
    assert math.isclose(seq_stats["pg_loss"], seq.item())


def test_sequence_aggregation_skips_empty_sequences() -> None:
    old = torch.zeros(2, 2, dtype=F64)
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    loss, _ = policy_loss(old, old, _t([1.0, 5.0]), mask, PolicyLossConfig(aggregation="sequence"))
    assert loss.item() == -1.0


def _random_batch(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 7
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    lp = old + 0.4 * torch.randn(b, t, generator=g, dtype=F64)
    ref = old + 0.2 * torch.randn(b, t, generator=g, dtype=F64)
    ent = torch.rand(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    lengths = torch.tensor([1, 7, 3, 5, 2, 6])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return lp, old, ref, ent, adv, mask


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_sum_to_full_batch(aggregation: str) -> None:
    lp, old, ref, ent, adv, mask = _random_batch(6)
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01, aggregation=aggregation)  # type: ignore[arg-type]

    full_lp, full_ent = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    full_loss, _ = policy_loss(full_lp, old, adv, mask, cfg, ref_logprobs=ref, entropy=full_ent)
    full_loss.backward()

    micro_lp, micro_ent = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    scale = {"loss_scale_tokens": float(mask.sum())}
    if aggregation == "sequence":
        scale = {"loss_scale_sequences": float((mask.sum(dim=1) > 0).sum())}
    total = torch.zeros((), dtype=F64)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part, _ = policy_loss(
            micro_lp[rows],
            old[rows],
            adv[rows],
            mask[rows],
            cfg,
            ref_logprobs=ref[rows],
            entropy=micro_ent[rows],
            **scale,
        )
        part.backward()
        total += part.detach()

    assert torch.allclose(total, full_loss.detach(), atol=1e-12)
    assert micro_lp.grad is not None and full_lp.grad is not None
    assert torch.allclose(micro_lp.grad, full_lp.grad, atol=1e-12)
    assert micro_ent.grad is not None and full_ent.grad is not None
    assert torch.allclose(micro_ent.grad, full_ent.grad, atol=1e-12)

    # Without the global scale each micro-batch is its own mean, which weighs tokens differently.
    unscaled = sum(
        policy_loss(lp[r], old[r], adv[r], mask[r], cfg, ref_logprobs=ref[r], entropy=ent[r])[0].item()
        for r in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    assert not math.isclose(unscaled, full_loss.item())


def test_loss_scale_must_match_aggregation() -> None:
    lp, old, _, _, adv, mask = _random_batch(7)
    with pytest.raises(ValueError, match="loss_scale_tokens"):
        policy_loss(lp, old, adv, mask, PolicyLossConfig(aggregation="sequence"), loss_scale_tokens=10.0)
    with pytest.raises(ValueError, match="loss_scale_sequences"):
        policy_loss(lp, old, adv, mask, PolicyLossConfig(), loss_scale_sequences=3.0)
    with pytest.raises(ValueError, match="loss_scale_tokens"):
        policy_loss(lp, old, adv, mask, PolicyLossConfig(), loss_scale_tokens=0.0)


def test_kl_term_k3() -> None:
    old = _t([[-1.0, -2.0]])
    lp = old.clone().requires_grad_()
    ref = _t([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.zeros(1, dtype=F64)
    log_r = ref - old
    k3 = torch.exp(log_r) - log_r - 1
    loss, stats = policy_loss(lp, old, adv, mask, PolicyLossConfig(kl_coef=0.5), ref_logprobs=ref)
    assert math.isclose(stats["kl"], k3.mean().item(), rel_tol=1e-12)
    assert math.isclose(loss.item(), 0.5 * k3.mean().item(), rel_tol=1e-12)
    loss.backward()
    # d k3 / d lp = 1 - exp(ref - lp): pulls lp toward ref.
    assert lp.grad is not None
    assert torch.allclose(lp.grad, 0.5 * (1 - torch.exp(log_r)) / 2)
    # kl_coef = 0 still reports the KL but leaves the loss alone.
    loss0, stats0 = policy_loss(old, old, adv, mask, PolicyLossConfig(), ref_logprobs=ref)
    assert loss0.item() == 0.0 and math.isclose(stats0["kl"], stats["kl"])
    _, same = policy_loss(old, old, adv, mask, PolicyLossConfig(kl_coef=0.5), ref_logprobs=old)
    assert same["kl"] == 0.0


def test_entropy_bonus() -> None:
    old = torch.zeros(1, 3, dtype=F64)
    ent = _t([[1.0, 2.0, 100.0]]).requires_grad_()
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, stats = policy_loss(
        old, old, torch.zeros(1, dtype=F64), mask, PolicyLossConfig(entropy_coef=0.1), entropy=ent
    )
    assert math.isclose(loss.item(), -0.1 * 1.5)
    assert math.isclose(stats["entropy"], 1.5)
    loss.backward()
    assert ent.grad is not None
    assert torch.allclose(ent.grad, _t([[-0.05, -0.05, 0.0]]))
    assert "kl" not in stats


def test_per_token_advantages_and_padding_do_not_leak() -> None:
    # Padding holds -inf log-probs and NaN advantages; neither may reach the loss or the gradient.
    old = _t([[-1.0, -math.inf], [-0.5, -0.7]])
    lp = _t([[-0.9, -math.inf], [-0.5, math.nan]]).requires_grad_()
    adv = _t([[1.0, math.nan], [2.0, math.nan]])
    mask = torch.tensor([[1, 0], [1, 0]], dtype=torch.bool)
    ref = _t([[-1.0, math.nan], [-0.5, -math.inf]])
    ent = _t([[0.3, math.nan], [0.2, math.inf]])
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.1)
    loss, stats = policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent)
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(math.isfinite(v) for v in stats.values())
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1] == 0.0 and lp.grad[1, 1] == 0.0
    # Per-token advantages equal to the broadcast ones give the same loss on the masked tokens.
    lp2 = _t([[-0.9, -1.0], [-0.5, -1.0]])
    old2 = _t([[-1.0, -1.0], [-0.5, -1.0]])
    per_tok, _ = policy_loss(lp2, old2, _t([[1.0, 1.0], [2.0, 2.0]]), mask, PolicyLossConfig())
    per_seq, _ = policy_loss(lp2, old2, _t([1.0, 2.0]), mask, PolicyLossConfig())
    assert math.isclose(per_tok.item(), per_seq.item())


def test_policy_loss_shape_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(3), x, PolicyLossConfig())
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), x, PolicyLossConfig())
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, x, torch.zeros(2), x, PolicyLossConfig(), ref_logprobs=torch.zeros(3, 2))


def test_empty_mask_gives_zero_loss() -> None:
    lp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, stats = policy_loss(lp, lp.detach(), torch.ones(2, dtype=F64), torch.zeros(2, 3), PolicyLossConfig())
    loss.backward()
    assert loss.item() == 0.0 and stats["num_tokens"] == 0.0
    assert lp.grad is not None and torch.equal(lp.grad, torch.zeros_like(lp))


# --------------------------------------------------------------------------------------------------
# SFT loss and log-prob mismatch
# --------------------------------------------------------------------------------------------------


def test_sft_loss() -> None:
    lp = _t([[-1.0, -3.0, -math.inf], [-2.0, -0.5, -0.5]]).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss, stats = sft_loss(lp, mask)
    assert math.isclose(loss.item(), (1.0 + 3.0 + 2.0) / 3)
    assert math.isclose(stats["sft_nll"], 2.0) and stats["num_tokens"] == 3
    loss.backward()
    assert lp.grad is not None
    assert torch.allclose(lp.grad, _t([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]]) / 3)
    seq, _ = sft_loss(lp.detach(), mask, aggregation="sequence")
    assert math.isclose(seq.item(), (2.0 + 2.0) / 2)
    half, _ = sft_loss(lp.detach(), mask, loss_scale_tokens=6.0)
    assert math.isclose(half.item(), 1.0)


def test_logprob_mismatch() -> None:
    train = _t([[-1.0, -2.0, 5.0], [-0.5, -0.7, -0.1]])
    rollout = _t([[-1.1, -1.8, -math.inf], [-0.5, -0.4, -0.1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    out = logprob_mismatch(train, rollout, mask)
    diff = torch.tensor([0.1, -0.2, 0.0, -0.3, 0.0], dtype=F64)
    k3 = torch.expm1(diff) - diff
    assert math.isclose(out["train_rollout_logprob_abs_diff"], 0.6 / 5, rel_tol=1e-9)
    assert math.isclose(out["train_rollout_logprob_max_abs_diff"], 0.3, rel_tol=1e-9)
    assert math.isclose(out["train_rollout_kl"], k3.mean().item(), rel_tol=1e-9)
    assert out["train_rollout_kl"] > 0
    same = logprob_mismatch(train, train, mask)
    assert set(same.values()) == {0.0}
    empty = logprob_mismatch(train, rollout, torch.zeros(2, 3, dtype=torch.bool))
    assert set(empty.values()) == {0.0}


def test_end_to_end_tiny_step_reduces_loss() -> None:
    # token_logprobs -> policy_loss -> one SGD step on the logits moves probability toward A > 0.
    torch.manual_seed(8)
    logits = torch.randn(2, 4, 6, requires_grad=True)
    targets = torch.randint(0, 6, (2, 4))
    mask = torch.ones(2, 4, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    with torch.no_grad():
        old, _ = token_logprobs(logits, targets)
    lp, ent = token_logprobs(logits, targets, with_entropy=True)
    loss, _ = policy_loss(lp, old, adv, mask, PolicyLossConfig(entropy_coef=0.01), entropy=ent)
    loss.backward()
    assert logits.grad is not None
    with torch.no_grad():
        new, _ = token_logprobs(logits - 0.5 * logits.grad, targets)
    assert (new[0] > old[0]).all() and (new[1] < old[1]).all()
