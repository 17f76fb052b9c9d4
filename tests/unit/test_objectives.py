"""The policy-gradient objectives (train.loss) against a reference: TRL 1.16's GRPOTrainer loss on a fixed batch for
grpo, gspo, cispo and dr_grpo (loss and gradient), and Dr. GRPO against its paper's formula."""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from hpcrl.model.qwen3 import ModelArgs
from hpcrl.trainer.advantage import group_advantages
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.loss import PolicyLossConfig, policy_loss
from hpcrl.trainer.torch_backend import TorchTrainer

F32 = torch.float32


def _batch(seed: int, spread: float) -> dict[str, Tensor]:
    """A fixed batch of 6 responses (lengths 1..7 of 7 positions) with old, current and reference log-probs."""
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 7
    old = -torch.rand(b, t, generator=g) * 3 - 0.05
    lp = old + spread * torch.randn(b, t, generator=g)
    ref = old + 0.2 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    lengths = torch.tensor([1, 7, 3, 5, 2, 6])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return {"lp": lp, "old": old, "ref": ref, "adv": adv, "mask": mask}


def _trl_loss(batch: dict[str, Tensor], lp: Tensor, *, loss_type: str, level: str, eps: float, eps_high: float,
              beta: float) -> Tensor:  # fmt: skip
    """TRL's own `GRPOTrainer._compute_loss` on the batch: the trainer object around it holds only what that method
    reads (one process, no gradient accumulation), and the model's forward returns the batch's log-probs."""
    from trl import GRPOTrainer

    mask = batch["mask"].long()
    accelerator = SimpleNamespace(
        num_processes=1,
        gather=lambda x: x.reshape(-1) if x.dim() == 0 else x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction: x,
        sync_gradients=True,
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps_high,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=mask.shape[1],
        accelerator=accelerator,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    inputs: dict[str, Any] = {
        "prompt_ids": torch.zeros(mask.shape[0], 1, dtype=torch.long),
        "prompt_mask": torch.ones(mask.shape[0], 1, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask),
        "completion_mask": mask,
        "advantages": batch["adv"],
        "old_per_token_logps": batch["old"],
        "ref_per_token_logps": batch["ref"],
        "num_items_in_batch": mask.sum(),
    }
    return GRPOTrainer._compute_loss(trainer, None, inputs)  # type: ignore[arg-type]


# (our train.loss and aggregation, TRL's loss_type and importance_sampling_level)
CASES = {
    "grpo": ("grpo", "token", "bnpo", "token"),
    "gspo": ("gspo", "sequence", "grpo", "sequence"),
    "cispo": ("cispo", "token", "cispo", "token"),
    "dr_grpo": ("dr_grpo", "constant", "dr_grpo", "token"),
}


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradient_equal_trl(name: str, kl_coef: float) -> None:
    objective, aggregation, loss_type, level = CASES[name]
    # GSPO clips whole sequences, whose ratio (a geometric mean) moves less than a token's: a tighter clip makes
    # some of them clip here, as the paper's 3e-4 does in training.
    eps, eps_high = (0.03, 0.04) if objective == "gspo" else (0.2, 0.28)
    batch = _batch(seed=3, spread=0.4)
    cfg = PolicyLossConfig(
        eps_clip=eps, eps_clip_high=eps_high, kl_coef=kl_coef, aggregation=aggregation,  # type: ignore[arg-type]
        objective=objective,  # type: ignore[arg-type]
        tokens_per_sequence=batch["mask"].shape[1] if aggregation == "constant" else None,
    )  # fmt: skip
    ours_lp = batch["lp"].clone().requires_grad_()
    ours, stats = policy_loss(ours_lp, batch["old"], batch["adv"], batch["mask"], cfg, ref_logprobs=batch["ref"])
    ours.backward()

    trl_lp = batch["lp"].clone().requires_grad_()
    # TRL's CISPO caps the weight at epsilon_high itself; hpcrl's at 1 + eps_clip_high.
    trl_high = 1 + eps_high if objective == "cispo" else eps_high
    theirs = _trl_loss(batch, trl_lp, loss_type=loss_type, level=level, eps=eps, eps_high=trl_high, beta=kl_coef)
    theirs.backward()

    assert stats["pg_clipfrac"] > 0, "the batch must exercise the clip"
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-6)
    assert ours_lp.grad is not None and trl_lp.grad is not None
    torch.testing.assert_close(ours_lp.grad, trl_lp.grad * batch["mask"], rtol=1e-5, atol=1e-7)


def test_gspo_clips_whole_sequences() -> None:
    # One sequence whose mean log-ratio is 0 (tokens +-0.5) stays unclipped although each token ratio is far
    # outside the clip; another whose mean is 0.5 is clipped whole, every token's gradient cut.
    old = torch.zeros(2, 2)
    lp = torch.tensor([[0.5, -0.5], [0.5, 0.5]]).requires_grad_()
    mask = torch.ones(2, 2, dtype=torch.bool)
    cfg = PolicyLossConfig(objective="gspo", aggregation="sequence")
    loss, stats = policy_loss(lp, old, torch.tensor([1.0, 1.0]), mask, cfg)
    loss.backward()
    assert lp.grad is not None
    # Sequence 0: s = 1, value -1, gradient -s / (2 sequences x 2 tokens) per token; sequence 1: clipped.
    assert math.isclose(loss.item(), (-1.0 - (1 + cfg.eps_clip_high)) / 2, rel_tol=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, -0.25], [0.0, 0.0]]))
    assert stats["pg_clipfrac"] == 0.5
    # The token-level objective on the same batch clips token 0 of both sequences and keeps token 1 of sequence 0.
    token, _ = policy_loss(lp.detach(), old, torch.tensor([1.0, 1.0]), mask, PolicyLossConfig())
    assert not math.isclose(token.item(), loss.item())


def test_cispo_keeps_every_gradient() -> None:
    # A token with ratio e (above the cap 1.28) keeps a gradient, weighted by the cap, where the PPO clip cuts it.
    old = torch.zeros(1, 2)
    lp = torch.tensor([[1.0, 0.1]]).requires_grad_()
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = policy_loss(lp, old, torch.tensor([1.0]), mask, PolicyLossConfig(objective="cispo"))
    loss.backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, -torch.tensor([[1.28, math.exp(0.1)]]) / 2)
    assert stats["pg_clipfrac"] == 0.5
    ppo_lp = lp.detach().clone().requires_grad_()
    policy_loss(ppo_lp, old, torch.tensor([1.0]), mask, PolicyLossConfig())[0].backward()
    assert ppo_lp.grad is not None and ppo_lp.grad[0, 0] == 0.0


def test_dr_grpo_is_its_papers_formula() -> None:
    """Liu et al. 2025, eq. (3): A_i = R_i - mean(R) (no std), and the loss is
    -1/G sum_i sum_t min(r_it A_i, clip(r_it) A_i) / L with L a constant (the generation budget)."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards, normalize_std=TrainConfig(loss="dr_grpo").normalize_advantage_std is True)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))

    g = torch.Generator().manual_seed(5)
    budget, lengths = 6, torch.tensor([1, 6, 3, 4, 2, 5, 6, 1])
    mask = torch.arange(budget)[None, :] < lengths[:, None]
    old = -torch.rand(8, budget, generator=g, dtype=torch.float64)
    lp = old + 0.3 * torch.randn(8, budget, generator=g, dtype=torch.float64)
    a = adv.flatten().double()
    cfg = PolicyLossConfig(objective="dr_grpo", aggregation="constant", tokens_per_sequence=budget)
    loss, _ = policy_loss(lp, old, a, mask, cfg)

    expected = 0.0
    for i in range(8):
        for t in range(int(lengths[i])):
            r = math.exp(lp[i, t].item() - old[i, t].item())
            expected += min(r * a[i].item(), min(max(r, 0.8), 1.28) * a[i].item())
    expected = -expected / (8 * budget)
    assert math.isclose(loss.item(), expected, rel_tol=1e-12)

    # Unlike GRPO's per-sequence mean, a token's weight does not depend on its sequence's length: doubling a
    # sequence doubles its contribution.
    one = torch.zeros(1, 4, dtype=torch.float64)
    short = policy_loss(one, one, torch.ones(1), torch.tensor([[1, 1, 0, 0]]), cfg)[0]
    long = policy_loss(one, one, torch.ones(1), torch.ones(1, 4), cfg)[0]
    assert math.isclose(long.item(), 2 * short.item())


def test_train_loss_resolves_and_refuses() -> None:
    assert (TrainConfig().aggregation, TrainConfig().normalize_advantage_std) == ("token", True)
    assert TrainConfig(loss="gspo").aggregation == "sequence"
    dr = TrainConfig(loss="dr_grpo")
    assert (dr.aggregation, dr.normalize_advantage_std, dr.constant_normalizer_tokens) == ("constant", False, None)
    with pytest.raises(ValueError, match="loss: dr_grpo .* normalize_advantage_std is true"):
        TrainConfig(loss="dr_grpo", normalize_advantage_std=True)
    with pytest.raises(ValueError, match="eps_clip: 0.1 does not apply to loss: cispo"):
        TrainConfig(loss="cispo", eps_clip=0.1)
    with pytest.raises(ValueError, match="constant_normalizer_tokens applies to aggregation: constant"):
        TrainConfig(constant_normalizer_tokens=8)
    with pytest.raises(ValueError, match="objective must be one of"):
        PolicyLossConfig(objective="ppo")  # type: ignore[arg-type]


@pytest.mark.parametrize("loss", ["gspo", "dr_grpo", "cispo"])
def test_the_trainer_step_normalises_each_objective_over_the_whole_batch(loss: str, tiny_model_dir: Path) -> None:
    """Micro-batches of 3 and one of 8 make the same update: each micro-batch's loss is divided by the batch's
    global count (tokens, or sequences for gspo and dr_grpo), not its own."""
    from tests.unit.test_ppo import grpo_batch

    batch = grpo_batch(ModelArgs.from_dir(tiny_model_dir).vocab_size)
    cfg = {"lr": 1e-2, "loss": loss, "old_logprobs": "rollout"}
    if loss == "dr_grpo":
        cfg["constant_normalizer_tokens"] = 8
    whole = TorchTrainer(TrainConfig(**cfg, micro_batch_size=8), tiny_model_dir).train_grpo(batch)  # type: ignore[arg-type]
    split = TorchTrainer(TrainConfig(**cfg, micro_batch_size=3), tiny_model_dir).train_grpo(batch)  # type: ignore[arg-type]
    assert whole["loss"] == pytest.approx(split["loss"], rel=1e-5)
    assert whole["grad_norm"] == pytest.approx(split["grad_norm"], rel=1e-4)
    assert whole["pg_loss"] == pytest.approx(split["pg_loss"], rel=1e-5)
    # The engine's log-probs are far above the trainer's: the ratio clips at 1 - eps_clip (cispo has no lower bound).
    assert (whole["pg_clipfrac"] > 0) == (loss != "cispo")


def test_an_inert_clip_is_named_at_load() -> None:
    from hpcrl.run_config import load_run_config
    from tests.support import REPO

    quickstart = REPO / "experiments" / "quickstart.yaml"
    with pytest.warns(UserWarning, match="train.eps_clip and train.eps_clip_high are inert"):
        load_run_config(quickstart, ["train.eps_clip_high=0.4"])
    with pytest.raises(ValueError, match="overlong_window_tokens=9 must be at most rollout.max_new_tokens=8"):
        load_run_config(quickstart, ["train.overlong_window_tokens=9"])
    quiet = (
        [],
        ["train.eps_clip_high=0.4", "train.global_batch_size=128"],
        ["train.eps_clip=0.1", "train.ppo_epochs=2"],
    )
    for acting in (*quiet, ["train.eps_clip_high=0.4", "train.old_logprobs=rollout"]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_run_config(quickstart, acting)


def test_overlong_shaping_is_dapos_formula_and_truncated_answers_leave_the_loss() -> None:
    """Yu et al. 2025, eq. (13): R(y) = 0 for |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to
    L_max, -1 beyond (here the engine never exceeds L_max)."""
    from hpcrl.samples.sample import Example, Group, Sample
    from hpcrl.trainer.advantage import Overlong, batch_from_groups

    shaping = Overlong(max_new_tokens=16, window_tokens=4)
    for n in range(1, 17):
        expected = 0.0 if n <= 12 else (12 - n) / 4
        assert shaping.penalty_of(n) == pytest.approx(expected)

    def sample(n: int, finish: str) -> Sample:
        return Sample(prompt_ids=[1, 2], output_ids=[3] * n, logprobs=[-1.0] * n, text="", finish=finish,
                      weight_versions=[0] * n, reward=1.0)  # fmt: skip

    group = Group(example=Example(prompt="p", answer="a"), samples=[sample(4, "stop"), sample(14, "stop"),
                                                                    sample(16, "length")])  # fmt: skip
    plain = batch_from_groups([group], normalize_std=False)
    assert plain.advantages.tolist() == [0.0, 0.0, 0.0]  # equal rewards: no signal without the shaping
    shaped = batch_from_groups([group], normalize_std=False, overlong=Overlong(16, 4, mask_truncated=True))
    rewards = torch.tensor([1.0, 0.5, 0.0])
    torch.testing.assert_close(shaped.advantages, rewards - rewards.mean())
    assert shaped.loss_mask.sum(dim=1).tolist() == [4, 14, 0]  # the truncated answer leaves the loss
    cut = Group(example=group.example, samples=[sample(16, "length")] * 2)
    with pytest.raises(ValueError, match="every sample of the step was cut at rollout.max_new_tokens=16"):
        batch_from_groups([cut], normalize_std=False, overlong=Overlong(16, mask_truncated=True))
    with pytest.raises(ValueError, match="overlong_penalty applies with overlong_window_tokens > 0"):
        TrainConfig(overlong_penalty=0.5)


def _groups(examples: Sequence[Any], signal: Callable[[Any], bool]) -> list[Any]:
    """Groups of 4 samples per example, whose rewards differ where `signal(example)`."""
    from hpcrl.samples.sample import Group, Sample

    def sample(reward: float) -> Sample:
        return Sample(prompt_ids=[1], output_ids=[2], logprobs=[-1.0], text="", finish="stop", weight_versions=[0],
                      reward=reward)  # fmt: skip

    return [Group(example=e, samples=[sample(float(signal(e) and i % 2)) for i in range(4)]) for e in examples]


def test_dynamic_sampling_fills_the_batch_with_groups_whose_rewards_differ() -> None:
    from hpcrl.rollout.data import PromptSource, make_addition_task
    from hpcrl.rollout.dynamic import DynamicSampler, DynamicSamplingError

    data = PromptSource(make_addition_task(200, 2, seed=0), batch_size=8, seed=0)
    odd = lambda e: int(e.answer) % 2 == 1  # noqa: E731 - about half the prompts teach
    drawn: list[tuple[int, int, list[str]]] = []

    def draw(step: int, examples: Sequence[Any], k: int) -> list[Any]:
        drawn.append((step, k, [e.prompt for e in examples]))
        return _groups(examples, odd)

    sampler = DynamicSampler(data, prompts_per_step=8, max_batches=6)
    first = _groups(data.batch(3), odd)
    kept = sampler.fill(3, first, draw)
    assert kept is not None and len(kept) == 8 and all(odd(g.example) for g in kept)
    metrics = sampler.pop_metrics()
    equal_drawn = sum(not odd(g.example) for g in first) + sum(
        not odd(e) for _, _, prompts in drawn for e in data.examples if e.prompt in prompts
    )
    assert metrics["rollout/dynamic_batches"] == 1 + len(drawn) > 1
    assert metrics["rollout/dynamic_dropped_groups"] == equal_drawn
    # Extra batches come from a stream of their own, the same on a rerun (a resume), other than the step's own.
    before = list(drawn)
    drawn.clear()
    DynamicSampler(data, prompts_per_step=8, max_batches=6).fill(3, first, draw)
    assert drawn == before and drawn[0][2] != [e.prompt for e in data.batch(3)]

    hopeless = _groups(data.batch(3), lambda _: False)
    with pytest.raises(DynamicSamplingError, match=r"drew 2 x 8 prompts for step 3 and found only 0 groups") as e:
        DynamicSampler(data, prompts_per_step=8, max_batches=2).fill(3, hopeless, lambda s, ex, k: hopeless)
    assert "rollout.dynamic_sampling_max_batches" in str(e.value)


def test_async_dynamic_sampling_drops_equal_groups_on_arrival() -> None:
    from hpcrl.rollout.buffer import arrival_verdict
    from hpcrl.rollout.config import RolloutConfig
    from hpcrl.rollout.data import make_addition_task

    flat = _groups(make_addition_task(1, 2, seed=0), lambda _: False)[0]
    mixed = _groups(make_addition_task(1, 2, seed=1), lambda _: True)[0]
    assert arrival_verdict(flat, None, dynamic=True) == "equal_rewards"
    assert arrival_verdict(flat, None) is None and arrival_verdict(mixed, None, dynamic=True) is None
    with pytest.raises(ValueError, match="dynamic_sampling_max_batches applies with dynamic_sampling: true"):
        RolloutConfig(dynamic_sampling_max_batches=2)
