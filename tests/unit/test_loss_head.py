"""The fused log-prob head (train.logprob_chunk_tokens): the plain head's numbers, no [tokens x vocab] logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcrl.trainer.logprobs import hidden_token_logprobs, token_logprobs

# fp32 on the CPU: the fused head sums the same products in other GEMM shapes, so agreement is to rounding.
LP_ATOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


def _plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lp, ent = token_logprobs((hidden @ weight.t())[None], targets[None], with_entropy=True)
    assert ent is not None
    return lp[0], ent[0]


@pytest.mark.parametrize("chunk_tokens", [1, 8, 37, 1000])
def test_fused_head_matches_the_plain_head_in_value_and_gradient(chunk_tokens: int) -> None:
    gen = torch.Generator().manual_seed(0)
    n, h, v = 37, 24, 301  # 37 tokens: chunks of 8 leave a tail of 5
    hidden = torch.randn(n, h, generator=gen).requires_grad_(True)
    weight = (torch.randn(v, h, generator=gen) * 0.5).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=gen)
    up_lp, up_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    lp, ent = hidden_token_logprobs(hidden, weight, targets, chunk_tokens=chunk_tokens, with_entropy=True)
    assert ent is not None
    grads = torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), (hidden, weight))
    want_lp, want_ent = _plain(hidden, weight, targets)
    want = torch.autograd.grad((want_lp * up_lp).sum() + (want_ent * up_ent).sum(), (hidden, weight))

    torch.testing.assert_close(lp, want_lp, rtol=0, atol=LP_ATOL)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=LP_ATOL)
    for got, exp in zip(grads, want, strict=True):
        torch.testing.assert_close(got, exp, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    # Without grad it is the same forward, and it does not ask for the entropy unless told.
    with torch.no_grad():
        lp2, ent2 = hidden_token_logprobs(hidden, weight, targets, chunk_tokens=chunk_tokens)
    assert ent2 is None and torch.equal(lp2, lp.detach())


def test_fused_head_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"hidden \[N, H\] and weight \[V, H\]"):
        hidden_token_logprobs(torch.zeros(4, 8), torch.zeros(10, 6), torch.zeros(4, dtype=torch.long), chunk_tokens=2)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        hidden_token_logprobs(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.long), chunk_tokens=0)


def test_a_grpo_step_with_the_fused_head_trains_like_the_plain_one(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One GRPO update of the tiny model with train.logprob_chunk_tokens gives the plain head's loss, gradient
    norm and gradients (to rounding), with a KL to the reference and an entropy bonus in the loss."""
    from hpcrl.trainer import torch_backend
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.config import TrainConfig
    from hpcrl.trainer.torch_backend import TorchTrainer

    calls = []

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(kwargs["chunk_tokens"])
        return hidden_token_logprobs(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_backend, "hidden_token_logprobs", counted)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 99, (5,), generator=gen).tolist() for _ in range(6)]
    responses = [torch.randint(3, 99, (4 + i,), generator=gen).tolist() for i in range(6)]
    batch = TrainBatch.from_sequences(prompts, responses, advantages=torch.randn(6, generator=gen).tolist())
    results = {}
    for chunk in (None, 7):
        cfg = TrainConfig(lr=1e-3, micro_batch_size=4, kl_coef=0.1, entropy_coef=0.01, logprob_chunk_tokens=chunk)
        trainer = TorchTrainer(cfg, tiny_model_dir)
        metrics = trainer.train_grpo(batch)
        # The gradients, not the updated weights: Adam's first step is about lr * sign(grad), which turns a
        # rounding-size difference of a near-zero gradient into a difference of 2 * lr.
        grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
        results[chunk] = (metrics, grads)
    assert calls == [7, 7, 7, 7]  # the fused head ran: 2 micro-batches x (policy + reference)
    (plain, plain_w), (fused, fused_w) = results[None], results[7]
    assert plain["loss"] == pytest.approx(fused["loss"], rel=1e-5, abs=1e-7)
    assert plain["grad_norm"] == pytest.approx(fused["grad_norm"], rel=1e-4)
    assert plain["grad_norm"] > 0
    assert plain_w.keys() == fused_w.keys() and "model.embed_tokens.weight" in plain_w
    for name, g in plain_w.items():
        torch.testing.assert_close(fused_w[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_the_knob_is_validated_and_refused_where_it_would_do_nothing() -> None:
    from hpcrl.run_config import load_run_config
    from hpcrl.trainer.config import TrainConfig

    with pytest.raises(ValueError, match="logprob_chunk_tokens must be >= 1"):
        TrainConfig(logprob_chunk_tokens=0)
    # The megatron backend has a vocab-parallel fused head of its own (tests/unit/test_megatron.py).
    assert TrainConfig(backend="megatron", logprob_chunk_tokens=4096).logprob_chunk_tokens == 4096
    with pytest.raises(ValueError, match="would not be used with logprobs: invariant"):
        TrainConfig(logprobs="invariant", logprob_chunk_tokens=4096)
    quickstart = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"
    with pytest.raises(ValueError, match="train.logprob_chunk_tokens .* would not be used"):
        load_run_config(quickstart, ["rollout.top_k=20", "train.logprob_chunk_tokens=4096"])
    cfg = load_run_config(quickstart, ["train.logprob_chunk_tokens=4096"])
    assert cfg.train.logprob_chunk_tokens == 4096
