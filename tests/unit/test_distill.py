"""On-policy distillation: the reverse-KL advantage against its formula and against TRL's GKD (beta=1), a teacher
of another vocabulary refused, and a tiny distillation run against a real teacher engine that dies mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
from hpcrl.rollout.teacher import TeacherError, check_same_vocabulary
from hpcrl.store import load_events, load_metrics
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.distill import distill_advantages, reverse_kl_expectation
from hpcrl.trainer.loss import PolicyLossConfig, policy_loss

PROMPTS = [[1, 5, 6], [1, 7]]
RESPONSES = [[8, 9, 10], [11, 12, 13, 14]]
STUDENT = [[-1.0, -2.0, -0.5], [-0.25, -3.0, -1.5, -0.75]]
TEACHER = [[-1.5, -0.5, -0.5], [-1.25, -9.0, -0.5, -2.75]]
MASKS = [None, [1, 0, 1, 1]]  # row 1: a tool-result token between two turns


def _batch() -> TrainBatch:
    return TrainBatch.from_sequences(
        PROMPTS, RESPONSES, advantages=[0.5, -1.0], rollout_logprobs=STUDENT, response_masks=MASKS
    )


@pytest.mark.parametrize("mode", ["reverse_kl", "mixed"])
def test_the_advantage_and_loss_are_the_reverse_kl_formula_on_model_tokens_only(mode: str) -> None:
    coef = 0.5
    batch, stats = distill_advantages(_batch(), TEACHER, mode=mode, coef=coef)
    assert batch.advantages.shape == batch.loss_mask.shape
    model_tokens = []
    for i, (prompt, mask) in enumerate(zip(PROMPTS, MASKS, strict=True)):
        for j in range(len(RESPONSES[i])):
            got = float(batch.advantages[i, len(prompt) - 1 + j])
            if mask is not None and not mask[j]:
                assert got == 0.0  # the tool's token is neither scored nor trained
                continue
            base = [0.5, -1.0][i] if mode == "mixed" else 0.0
            assert got == pytest.approx(base - coef * (STUDENT[i][j] - TEACHER[i][j]))
            model_tokens.append((STUDENT[i][j], TEACHER[i][j]))
    assert int(batch.advantages.ne(0).sum()) <= len(model_tokens) and batch.advantages[~batch.loss_mask].eq(0).all()
    n = len(model_tokens)
    assert stats["reverse_kl"] == pytest.approx(sum(s - t for s, t in model_tokens) / n)
    assert stats["teacher_logprob_mean"] == pytest.approx(sum(t for _, t in model_tokens) / n)
    assert stats["student_logprob_mean"] == pytest.approx(sum(s for s, _ in model_tokens) / n)

    # One update on the batch (old = current, ratio 1): the token-mean loss is the mean of -advantage, and under
    # reverse_kl that is coef x the reverse-KL estimate.
    lp = batch.rollout_logprobs.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, lp.detach(), batch.advantages, batch.loss_mask, PolicyLossConfig())
    expected = -batch.advantages[batch.loss_mask].mean()
    assert float(loss.detach()) == pytest.approx(float(expected))
    if mode == "reverse_kl":
        assert float(loss.detach()) == pytest.approx(coef * stats["reverse_kl"])
    # A micro-batch of the per-token batch keeps its advantages aligned with its positions.
    row = batch.select(slice(1, 2))
    assert torch.equal(row.advantages[0], batch.advantages[1, : row.loss_mask.shape[1]])


def test_the_full_vocabulary_reverse_kl_and_the_expected_gradient_equal_trl_gkd_with_beta_1() -> None:
    """TRL's GKD with lmbda=1 (on-policy) and beta=1 minimises KL(student || teacher) over the full vocabulary at
    each position; hpcrl's advantage is the sampled-token estimate of it. Equal by expectation, not per sample:
    the expectation over the student's tokens of the estimate is TRL's loss, and of the policy gradient TRL's
    gradient (enumerated exactly over a small vocabulary)."""
    from trl.experimental.gkd import GKDTrainer

    torch.manual_seed(0)
    positions, vocab = 5, 11
    student_logits = torch.randn(1, positions, vocab, dtype=torch.float64, requires_grad=True)
    teacher_logits = torch.randn(1, positions, vocab, dtype=torch.float64)
    labels = torch.zeros(1, positions, dtype=torch.long)
    trl_loss = GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta=1.0, reduction="none")
    trl_loss = trl_loss.sum() / positions  # per-token mean over the full vocabulary
    (trl_grad,) = torch.autograd.grad(trl_loss, student_logits)
    ours = reverse_kl_expectation(student_logits, teacher_logits).mean()
    assert float(ours.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-12, abs=1e-14)

    # The expected gradient of hpcrl's loss: every vocabulary entry as the sampled token, weighted by p(token).
    log_p = torch.log_softmax(student_logits[0], -1)
    log_q = torch.log_softmax(teacher_logits[0], -1)
    p_values, q_values = log_p.detach().tolist(), log_q.tolist()
    total = torch.zeros((), dtype=torch.float64)
    for t in range(positions):
        tokens = list(range(vocab))
        batch = TrainBatch.from_sequences(
            [[1]] * vocab, [[v] for v in tokens], rollout_logprobs=[[p_values[t][v]] for v in tokens]
        )
        batch, _ = distill_advantages(batch, [[q_values[t][v]] for v in tokens], mode="reverse_kl", coef=1.0)
        lp = log_p[t][:, None]  # [vocab rows, 1 position]: the student's log-prob of each row's token
        weights = log_p[t].exp().detach()[:, None]
        loss, _ = policy_loss(
            lp, lp.detach(), batch.advantages.double(), batch.loss_mask, PolicyLossConfig(), token_weights=weights,
            loss_scale_tokens=1.0,
        )  # fmt: skip
        total = total + loss / positions
    (our_grad,) = torch.autograd.grad(total, student_logits)
    # The batch holds log-probs in float32 (as every rollout's): equal to float32 rounding.
    print(f"max |gradient - TRL's| = {(our_grad - trl_grad).abs().max():.2e}")
    assert torch.allclose(our_grad, trl_grad, rtol=0, atol=1e-7), (our_grad - trl_grad).abs().max()


def test_on_a_fixed_batch_of_tiny_models_the_loss_and_gradient_equal_trl_gkd_trainer_lmbda_1_beta_1(
    tmp_path: Path,
) -> None:
    """A student and a bigger teacher (same character tokenizer), one fixed batch of prompts and sampled answers:
    TRL's `GKDTrainer.compute_loss` (lmbda=1, beta=1: the full-vocabulary reverse KL at each answer position) against
    hpcrl's distillation loss (the sampled-token advantage `-(log p - log q)` in the policy loss). Per position, the
    student-weighted mean of hpcrl's per-token loss over every token it could have sampled is TRL's per-token loss;
    the batch loss and every parameter's gradient equal TRL's to float32 rounding."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from hpcrl.trainer.logprobs import token_logprobs

    small = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1)
    student_dir = init_tiny_model(tmp_path / "student", TinyModelSpec(**small, seed=0))  # type: ignore[arg-type]
    teacher_dir = init_tiny_model(tmp_path / "teacher", TinyModelSpec(num_layers=2, hidden_size=64, seed=1))
    tok = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("3+4=", "12+30=", "7+8=")]
    torch.manual_seed(0)  # the answers are the student's own samples, as in on-policy distillation
    responses = []
    for p in prompts:
        out = student.generate(
            torch.tensor([p]), do_sample=True, top_k=0, max_new_tokens=4, pad_token_id=tok.pad_token_id
        )
        responses.append(out[0, len(p) :].tolist())
    args = GKDConfig(
        output_dir=str(tmp_path / "trl"), lmbda=1.0, beta=1.0, use_cpu=True, report_to=[], max_new_tokens=4
    )
    trainer = GKDTrainer(
        model=student, teacher_model=teacher, args=args, processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": ["3+4="]}), data_collator=lambda rows: rows,
    )  # fmt: skip
    # TRL's inputs: prompt + answer, right-padded; labels -100 on the prompt and the padding.
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    input_ids = torch.full((len(prompts), width), tok.pad_token_id)
    labels = torch.full((len(prompts), width), -100)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
    attention = [[j < len(p) + len(r) for j in range(width)] for p, r in zip(prompts, responses, strict=True)]
    inputs = {"input_ids": input_ids, "attention_mask": torch.tensor(attention).long(), "labels": labels}
    params = [q for q in student.parameters() if q.requires_grad]
    trl_loss = trainer.compute_loss(student, inputs)
    trl_grads = torch.autograd.grad(trl_loss, params)

    # hpcrl: the trainer's batch, the student's and the teacher's log-probs of each sampled token.
    batch = TrainBatch.from_sequences(prompts, responses)
    logits = student(batch.input_ids).logits[:, :-1]
    with torch.no_grad():
        teacher_logits = teacher(batch.input_ids).logits[:, :-1]
    targets = batch.input_ids[:, 1:]
    sampled_p = token_logprobs(logits.detach(), targets)[0][batch.loss_mask]
    sampled_q = token_logprobs(teacher_logits, targets)[0][batch.loss_mask]
    log_p = torch.log_softmax(logits[batch.loss_mask], -1)  # [answer tokens, V]
    log_q = torch.log_softmax(teacher_logits[batch.loss_mask], -1)
    assert torch.allclose(log_p.detach().gather(1, targets[batch.loss_mask][:, None])[:, 0], sampled_p, atol=1e-6)
    positions, vocab = log_p.shape
    assert positions == int((labels != -100).sum())

    # Every token of the vocabulary as the sampled one at every answer position: one-token rows through hpcrl's
    # distillation advantage and policy loss, each weighted by the student's probability of that token.
    rows = TrainBatch.from_sequences(
        [[1]] * (positions * vocab), [[v] for _ in range(positions) for v in range(vocab)],
        rollout_logprobs=[[x] for x in log_p.detach().flatten().tolist()],
    )  # fmt: skip
    rows, _ = distill_advantages(rows, [[x] for x in log_q.flatten().tolist()], mode="reverse_kl", coef=1.0)
    lp = log_p.reshape(-1, 1)
    weights = log_p.detach().exp().reshape(-1, 1)
    per_token = -(weights * rows.advantages).reshape(positions, vocab).sum(-1)  # E_p[log p - log q] per position
    trl_per_token = GKDTrainer.generalized_jsd_loss(
        logits[batch.loss_mask].detach(), teacher_logits[batch.loss_mask], beta=1.0, reduction="none"
    ).sum(-1)
    print(f"per-token reverse KL, TRL vs hpcrl: max |diff| {(trl_per_token - per_token).abs().max():.2e}")
    assert torch.allclose(per_token, trl_per_token, rtol=1e-5, atol=1e-6)
    ours, _ = policy_loss(
        lp, lp.detach(), rows.advantages, rows.loss_mask, PolicyLossConfig(), token_weights=weights,
        loss_scale_tokens=float(positions),
    )  # fmt: skip
    assert float(ours.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-5, abs=1e-6)
    our_grads = torch.autograd.grad(ours, params)
    gaps = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(our_grads, trl_grads, strict=True)]
    trl_value = float(trl_loss.detach())
    print(f"loss TRL {trl_value:.6f} hpcrl {float(ours.detach()):.6f}; worst relative gradient gap {max(gaps):.2e}")
    for (name, _), a, b in zip(student.named_parameters(), our_grads, trl_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max())), name
    # The one-sample estimate on the sampled tokens themselves: its batch mean is what distill/reverse_kl logs.
    print(f"sampled-token estimate {float((sampled_p - sampled_q).mean()):.4f}, full vocabulary {trl_value:.4f}")


def test_the_sampled_estimate_averages_to_the_full_vocabulary_reverse_kl() -> None:
    torch.manual_seed(1)
    student_logits, teacher_logits = torch.randn(64), torch.randn(64)
    log_p, log_q = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    draws = torch.multinomial(log_p.exp(), 200_000, replacement=True)
    estimate = (log_p[draws] - log_q[draws]).double()
    exact = float(reverse_kl_expectation(student_logits, teacher_logits))
    stderr = float(estimate.std()) / len(draws) ** 0.5
    print(f"reverse KL: full vocabulary {exact:.5f}, sampled-token mean {float(estimate.mean()):.5f} +- {stderr:.5f}")
    assert abs(float(estimate.mean()) - exact) < 4 * stderr


def _tokenizer_dir(path: Path, swap: tuple[str, str] | None = None, extra: str | None = None) -> Path:
    from hpcrl.model.tiny import build_tokenizer

    build_tokenizer().save_pretrained(path)
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    if swap is not None:
        a, b = swap
        vocab[a], vocab[b] = vocab[b], vocab[a]
    if extra is not None:
        vocab[extra] = len(vocab)
    (path / "tokenizer.json").write_text(json.dumps(data))
    return path


def test_a_teacher_with_another_vocabulary_is_refused_naming_the_token(tmp_path: Path) -> None:
    student = _tokenizer_dir(tmp_path / "student")
    check_same_vocabulary(student, _tokenizer_dir(tmp_path / "same"))
    with pytest.raises(TeacherError) as error:
        check_same_vocabulary(student, _tokenizer_dir(tmp_path / "swapped", swap=("a", "b")))
    message = str(error.value)
    assert "token 'a' is id 68 in the student's tokenizer and id 69 in the teacher's" in message
    assert "both need one tokenizer" in message
    with pytest.raises(TeacherError, match=r"\(99 tokens against 100\): token 'xyz' \(id 99\) is only in the teacher"):
        check_same_vocabulary(student, _tokenizer_dir(tmp_path / "bigger", extra="xyz"))


def test_a_tiny_distillation_run_scores_with_its_teacher_engine_and_survives_the_teacher_dying(
    workdir: Path, tiny_model_dir: Path
) -> None:
    teacher = init_tiny_model(workdir / "teacher", TinyModelSpec(num_layers=3, hidden_size=96, seed=1))
    args = [
        "run", "qs.yaml", "num_steps=2", "sft.num_steps=0", "data.prompts_per_step=2", "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=6", "checkpoint.every_steps=2", f"distill.teacher.model={teacher}", "distill.top_k=4",
        "--run-dir", "r",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", *args], cwd=workdir, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step    1/"):
            # The teacher's engine dies between two steps: the fleet restarts it, the next scoring goes through.
            record = json.loads((workdir / "r" / "teacher" / "engines" / "engine-0.json").read_text())
            os.kill(record["pid"], signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, "".join(lines)
    out = "".join(lines)
    assert "distill.mode=reverse_kl trains on the teacher's log-probs alone: reward.fn=arithmetic_answer" in out
    m = load_metrics(workdir / "r" / "metrics.h5")
    assert len(m["distill/reverse_kl"]) == 2
    for key in ("distill/reverse_kl", "distill/teacher_logprob_mean", "distill/teacher_s"):
        assert torch.isfinite(torch.as_tensor(m[key])).all(), key
    assert (m["distill/teacher_logprob_mean"] < 0).all() and (m["distill/teacher_s"] > 0).all()
    # One update a step, ratio 1: the loss is the batch's mean reverse-KL estimate plus the sparse forward KL of the
    # teacher's top-4 (distill.top_k), each a token mean.
    forward = m["train/distill_forward_kl_topk"]
    assert torch.isfinite(torch.as_tensor(forward)).all() and (forward > 0).all()
    assert m["train/loss"] == pytest.approx(m["distill/reverse_kl"] + forward, rel=1e-5, abs=1e-6)
    kinds = [e["kind"] for e in load_events(workdir / "r" / "metrics.h5")]
    assert "teacher_engine_dead" in kinds and "teacher_engine_restarted" in kinds, kinds
