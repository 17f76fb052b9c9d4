"""PPO mini-batches and epochs, where the old log-probs come from, importance correction against the engine,
and prompt ids with the tokenizer's special tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcrl.config import ConfigError
from hpcrl.model.qwen3 import ModelArgs
from hpcrl.rollout.config import DataConfig
from hpcrl.rollout.generate import PromptFormatter
from hpcrl.run_config import load_run_config
from hpcrl.store import load_metrics
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.loss import PolicyLossConfig, importance_weights, policy_loss
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.support import REPO, SMALL, hpcrl

QUICKSTART = REPO / "experiments" / "quickstart.yaml"


# ----- config refusals -----


def test_a_global_batch_size_that_does_not_divide_the_batch_is_refused_with_the_sizes_that_do() -> None:
    # The quickstart's batch: 32 prompts x 8 samples = 256.
    with pytest.raises(ValueError) as error:
        load_run_config(QUICKSTART, ["train.global_batch_size=48"])
    message = str(error.value)
    assert "train.global_batch_size=48 must divide the rollout batch" in message
    assert "32 x 8 = 256" in message and "use one of 1, 2, 4, 8, 16, 32, 64, 128, 256" in message
    with pytest.raises(ValueError, match="must divide the rollout batch"):
        load_run_config(QUICKSTART, ["train.global_batch_size=512"])
    assert load_run_config(QUICKSTART, ["train.global_batch_size=32"]).train.global_batch_size == 32


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.ppo_epochs=0"], "ppo_epochs must be >= 1"),
        (["train.is_clip=1.0"], "is_clip must be > 1"),
        (
            ["train.num_ranks=3", "train.global_batch_size=16"],
            r"global_batch_size \(16\) must be a multiple of num_ranks",
        ),
        (["train.off_policy_correction=tis", "train.old_logprobs=rollout"], "set old_logprobs: trainer"),
    ],
)
def test_ppo_settings_that_cannot_work_are_refused_at_load(overrides: list[str], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        load_run_config(QUICKSTART, overrides)


def test_unknown_choices_name_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="train.off_policy_correction: expected one of 'none', 'tis', 'mis'"):
        load_run_config(QUICKSTART, ["train.off_policy_correction=icepop"])
    with pytest.raises(ConfigError, match="data.add_special_tokens"):
        load_run_config(QUICKSTART, ["data.add_special_tokens=bos"])
    assert load_run_config(QUICKSTART, ["data.add_special_tokens=true"]).data.add_special_tokens is True


# ----- prompt ids -----


def bos_tokenizer_dir(tiny_model_dir: Path, out: Path) -> Path:
    """A copy of the tiny model whose tokenizer puts a BOS first, as Llama's does (`<|im_start|>` plays the
    BOS: a token the model already has, so the weights fit unchanged)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.bos_token = "<|im_start|>"
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B", special_tokens=[("<|im_start|>", bos)]
    )
    tok.save_pretrained(out)
    return out


def test_auto_keeps_the_bos_a_tokenizer_adds_and_false_drops_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bos_tokenizer_dir(tiny_model_dir, tmp_path / "tok"))  # read back from disk
    bos = tok.bos_token_id
    plain = tok.encode("12+34=", add_special_tokens=False)
    auto = PromptFormatter(tok, DataConfig()).encode("12+34=")
    assert auto == [bos, *plain] == tok.encode("12+34=")
    assert PromptFormatter(tok, DataConfig(add_special_tokens=True)).encode("12+34=") == auto
    assert PromptFormatter(tok, DataConfig(add_special_tokens=False)).encode("12+34=") == plain
    assert PromptFormatter(tok, DataConfig()).describe(auto).endswith("['<|im_start|>', '1', '2', '+', '3', '4', '=']")
    # A chat template writes its own markers: auto and false add nothing to them, true puts the BOS first.
    chat = PromptFormatter(tok, DataConfig(prompt_template="chat")).encode("1+1=")
    assert tok.convert_ids_to_tokens(chat[:2]) == ["<|im_start|>", "u"]
    assert PromptFormatter(tok, DataConfig(prompt_template="chat", add_special_tokens=False)).encode("1+1=") == chat
    assert PromptFormatter(tok, DataConfig(prompt_template="chat", add_special_tokens=True)).encode("1+1=") == [
        bos,
        *chat,
    ]


def test_the_quickstart_tokenizer_gets_the_same_ids_under_auto(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for prompt in ("12+34=", "7+0=", "99+99="):
        before = tok.encode(prompt, add_special_tokens=False)  # what every run encoded before the setting
        assert PromptFormatter(tok, DataConfig()).encode(prompt) == before


# ----- importance weights -----


def test_tis_and_mis_weights_of_known_ratios() -> None:
    ratios = torch.tensor([[0.5, 1.0, 2.0, 3.0], [1.5, 8.0, 9.0, 0.25]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    rollout = torch.full_like(ratios, -2.0)
    old = rollout + ratios.log()
    tis, tis_stats = importance_weights(old, rollout, mask, mode="tis", is_clip=2.0)
    torch.testing.assert_close(tis, torch.tensor([[0.5, 1.0, 2.0, 2.0], [1.5, 2.0, 0.0, 0.0]]))
    # Six masked tokens; 3.0 and 8.0 are above the clip (2.0 is not).
    assert tis_stats["is_clipped_share"] == pytest.approx(2 / 6)
    assert tis_stats["is_weight_mean"] == pytest.approx((0.5 + 1 + 2 + 2 + 1.5 + 2) / 6)
    mis, mis_stats = importance_weights(old, rollout, mask, mode="mis", is_clip=2.0)
    torch.testing.assert_close(mis, torch.tensor([[0.5, 1.0, 2.0, 0.0], [1.5, 0.0, 0.0, 0.0]]))
    assert mis_stats["is_clipped_share"] == pytest.approx(2 / 6)
    assert mis_stats["is_weight_mean"] == pytest.approx((0.5 + 1 + 2 + 1.5) / 6)


def test_a_token_weight_scales_that_tokens_policy_gradient() -> None:
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = policy_loss(
        lp, lp.detach(), torch.tensor([1.0]), mask, PolicyLossConfig(), token_weights=torch.tensor([[2.0, 0.0]])
    )
    loss.backward()
    # Ratio 1, advantage 1, token mean over 2 tokens: d loss / d lp = -w / 2.
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.0]]))


# ----- the trainer -----


def grpo_batch(vocab: int, num_samples: int = 8, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts, responses = [ids(2, 6) for _ in range(num_samples)], [ids(2, 7) for _ in range(num_samples)]
    return TrainBatch.from_sequences(
        prompts,
        responses,
        advantages=torch.randn(num_samples, generator=g).tolist(),
        rollout_logprobs=[[-2.0 - 0.1 * j for j in range(len(r))] for r in responses],
    )


def adam_steps(trainer: TorchTrainer) -> int:
    return int(next(iter(trainer.optimizer.state.values()))["step"].item())


def test_quarter_mini_batches_over_two_epochs_make_eight_steps_and_clip(tiny_model_dir: Path) -> None:
    batch = grpo_batch(ModelArgs.from_dir(tiny_model_dir).vocab_size)
    trainer = TorchTrainer(TrainConfig(lr=3e-2, global_batch_size=2, ppo_epochs=2), tiny_model_dir)
    m = trainer.train_grpo(batch)
    assert m["num_optimizer_steps"] == 8 and adam_steps(trainer) == 8
    assert m["pg_clipfrac"] > 0 and m["ppo_kl"] != 0
    assert m["num_tokens"] == batch.num_response_tokens  # each sample counted once, not once per epoch
    single = TorchTrainer(TrainConfig(lr=3e-2), tiny_model_dir).train_grpo(batch)
    assert single["num_optimizer_steps"] == 1 and single["pg_clipfrac"] == 0  # the ratio is 1 by construction
    with pytest.raises(ValueError, match="global_batch_size=3 does not divide this rollout batch of 8"):
        TorchTrainer(TrainConfig(global_batch_size=3), tiny_model_dir).train_grpo(batch)


def trainer_logprobs(trainer: TorchTrainer, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
    """What the trainer's own forward gives each target position, micro-batch by micro-batch, without grad."""
    out = torch.zeros_like(batch.rollout_logprobs)
    with torch.no_grad():
        for start in range(0, len(batch), micro_batch_size):
            lp = trainer.score(batch.select(slice(start, start + micro_batch_size)), reference=False)
            out[start : start + micro_batch_size, : lp.shape[1]] = lp
    return out


def with_rollout_logprobs(batch: TrainBatch, logprobs: torch.Tensor) -> TrainBatch:
    return TrainBatch(**{**batch.tensors(), "rollout_logprobs": logprobs})


def test_one_step_without_the_old_logprob_pass_equals_one_with_it(tiny_model_dir: Path) -> None:
    """The single-step path takes the old log-probs from its own forward; giving the trainer the same numbers
    from a separate no-grad forward (as rollout log-probs) must update the weights identically."""
    cfg = dict(lr=1e-2, micro_batch_size=4, entropy_coef=0.01)
    batch = grpo_batch(ModelArgs.from_dir(tiny_model_dir).vocab_size)
    old = trainer_logprobs(TorchTrainer(TrainConfig(**cfg), tiny_model_dir), batch, 4)
    skipped = TorchTrainer(TrainConfig(**cfg), tiny_model_dir)
    a = skipped.train_grpo(batch)
    explicit = TorchTrainer(TrainConfig(**cfg, old_logprobs="rollout"), tiny_model_dir)
    b = explicit.train_grpo(with_rollout_logprobs(batch, old))
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for (name, wa), (_, wb) in zip(skipped.export_weights(), explicit.export_weights(), strict=True):
        assert torch.equal(wa, wb), name
    assert adam_steps(skipped) == adam_steps(explicit) == 1


def test_tis_and_mis_in_the_trainer_weigh_by_the_ratios_to_the_engine(tiny_model_dir: Path) -> None:
    batch = grpo_batch(ModelArgs.from_dir(tiny_model_dir).vocab_size)
    train_lp = trainer_logprobs(TorchTrainer(TrainConfig(), tiny_model_dir), batch, 16)
    # An engine whose log-probs put ratio exp(train - rollout) at 4 on even rows and 0.5 on odd rows.
    ratio = torch.tensor([4.0 if i % 2 == 0 else 0.5 for i in range(len(batch))])[:, None]
    engine = with_rollout_logprobs(batch, torch.where(batch.loss_mask, train_lp - ratio.log(), 0.0))
    tokens = batch.loss_mask.sum(dim=1).float()
    even = float(tokens[0::2].sum() / tokens.sum())  # the share of tokens at ratio 4
    tis = TorchTrainer(TrainConfig(off_policy_correction="tis", is_clip=2.0), tiny_model_dir).train_grpo(engine)
    assert tis["is_clipped_share"] == pytest.approx(even)
    assert tis["is_weight_mean"] == pytest.approx(2.0 * even + 0.5 * (1 - even), rel=1e-5)
    mis = TorchTrainer(TrainConfig(off_policy_correction="mis", is_clip=2.0), tiny_model_dir).train_grpo(engine)
    assert mis["is_clipped_share"] == pytest.approx(even)
    assert mis["is_weight_mean"] == pytest.approx(0.5 * (1 - even), rel=1e-5)
    none = TorchTrainer(TrainConfig(), tiny_model_dir).train_grpo(engine)
    assert "is_weight_mean" not in none and none["loss"] != tis["loss"]


def test_a_run_trains_on_bos_prompts_in_mini_batches_over_two_ranks(workdir: Path, tiny_model_dir: Path) -> None:
    """One `hpcrl run` end to end: the BOS reaches the engine and the trainer (said and logged), and two ranks
    taking each mini-batch half and half make the same updates as one rank."""
    model = bos_tokenizer_dir(tiny_model_dir, workdir / "bos-model")
    # The random model earns no arithmetic reward, and all-zero advantages would train nothing.
    reward = "def reward(response: str, answer: str) -> float:\n    return len(response) % 2\n"
    (workdir / "oddlen.py").write_text(reward)
    common = [*SMALL, "num_steps=1", "sft.num_steps=0", f"model.path={model}", "reward.fn=oddlen:reward"]
    common += ["train.global_batch_size=4", "train.ppo_epochs=2", "train.lr=3e-2"]  # batch 4 x 4 = 16: 8 steps
    one = hpcrl("run", "qs.yaml", *common, "--run-dir", "one", "--verbose", cwd=workdir)
    two = hpcrl("run", "qs.yaml", *common, "train.num_ranks=2", "--run-dir", "two", cwd=workdir)
    assert "first prompt of this step as token ids (data.add_special_tokens=auto): [1, " in one.stdout
    assert "token ids" not in two.stdout  # shown only under --verbose
    first = next(line for line in one.stdout.splitlines() if line.startswith("first prompt of this step"))
    assert "<|im_start|>" in first  # the BOS, by name
    a, b = load_metrics(workdir / "one" / "metrics.h5"), load_metrics(workdir / "two" / "metrics.h5")
    assert a["train/num_optimizer_steps"][0] == b["train/num_optimizer_steps"][0] == 8
    assert a["train/pg_clipfrac"][0] > 0
    for key in ("train/loss", "train/pg_clipfrac", "train/ppo_kl", "train/grad_norm"):
        np.testing.assert_allclose(b[key][0], a[key][0], rtol=1e-4, atol=1e-6, err_msg=key)
