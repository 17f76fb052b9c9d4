"""distill.top_k: the sparse forward-KL term against its formula computed independently, the student's top-k
log-probs of both trainer heads against a plain log_softmax, and the setting's validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hpcrl.model.hf import load_model
from hpcrl.rollout.distill_config import DistillConfig, TeacherConfig
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.distill import sparse_forward_kl, with_teacher_topk
from hpcrl.trainer.torch_backend import LogProbs

PROMPTS = [[1, 5, 6], [1, 7]]
RESPONSES = [[8, 9, 10], [11, 12, 13, 14]]
MASKS = [None, [1, 0, 1, 1]]  # row 1: a tool-result token between two turns
V, K, COEF = 16, 3, 0.7


def _teacher_top(gen: torch.Generator) -> tuple[list[list[list[tuple[float, int]]]], list[torch.Tensor]]:
    """Per row, per response token: the teacher's top-K (log-prob, id) pairs of random logits, and those logits."""
    top, logits = [], []
    for r in RESPONSES:
        lg = torch.randn(len(r), V, generator=gen, dtype=torch.float64) * 2
        lp = torch.log_softmax(lg, -1).topk(K, -1)
        top.append([list(zip(v, i, strict=True)) for v, i in zip(lp.values.tolist(), lp.indices.tolist(), strict=True)])
        logits.append(lg)
    return top, logits


def test_the_sparse_forward_kl_and_its_gradient_are_the_formula_on_model_tokens_only() -> None:
    gen = torch.Generator().manual_seed(0)
    top, teacher_logits = _teacher_top(gen)
    batch = with_teacher_topk(TrainBatch.from_sequences(PROMPTS, RESPONSES, response_masks=MASKS), top, coef=COEF)
    assert batch.teacher_topk_ids is not None and batch.teacher_topk_logprobs is not None
    assert batch.teacher_topk_weights is not None
    student_logits = torch.randn(2, batch.loss_mask.shape[1], V, generator=gen, dtype=torch.float64).requires_grad_()
    log_s = torch.log_softmax(student_logits, -1)
    per_token = sparse_forward_kl(log_s.gather(-1, batch.teacher_topk_ids), batch.teacher_topk_logprobs,
                                  batch.teacher_topk_weights)  # fmt: skip
    per_token.sum().backward()

    # Independently: loop over the model tokens, the teacher's full distribution, its K best ids.
    expected = torch.zeros(per_token.shape, dtype=torch.float64)
    grad = torch.zeros(student_logits.shape, dtype=torch.float64)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        for j in range(len(r)):
            if MASKS[i] is not None and not MASKS[i][j]:  # type: ignore[index]
                continue
            t = len(p) - 1 + j
            log_t = torch.log_softmax(teacher_logits[i][j], -1)
            best = sorted(range(V), key=lambda v: -float(log_t[v]))[:K]
            ls = torch.log_softmax(student_logits[i, t].detach(), -1)
            expected[i, t] = COEF * sum(math.exp(log_t[v]) * (log_t[v] - ls[v]) for v in best)
            # d/dz of -sum_v w_v log softmax(z)_v = -w + (sum w) softmax(z)
            w = torch.zeros(V, dtype=torch.float64)
            w[best] = COEF * log_t[best].exp()
            grad[i, t] = -w + w.sum() * ls.exp()
    assert torch.allclose(per_token.detach(), expected, atol=1e-6)  # teacher log-probs travel as float32
    assert torch.allclose(student_logits.grad, grad, atol=1e-6)  # type: ignore[arg-type]
    assert expected[1, len(PROMPTS[1])] == 0 and per_token[1, len(PROMPTS[1])] == 0  # the tool token: no term


@pytest.mark.parametrize("chunk", [None, 4])
def test_the_trainer_heads_score_the_teacher_ids_as_a_plain_log_softmax(
    tiny_model_dir: Path, chunk: int | None
) -> None:
    model = load_model(tiny_model_dir).float()
    head = LogProbs(model, TrainConfig(logprob_chunk_tokens=chunk))
    ids = torch.tensor([[1, 20, 21, 14, 22, 32, 23, 24, 2]])
    topk_ids = torch.randint(
        0, model.args.vocab_size, (1, ids.shape[1] - 1, K), generator=torch.Generator().manual_seed(1)
    )
    lp, _, top = head(ids, None, False, topk_ids)
    with torch.no_grad():
        ref = torch.log_softmax(model(ids)[:, :-1].float(), -1)
    assert top is not None and top.shape == topk_ids.shape
    assert torch.allclose(top.detach(), ref.gather(-1, topk_ids), atol=1e-5)
    assert torch.allclose(lp.detach(), ref.gather(-1, ids[:, 1:, None])[..., 0], atol=1e-5)
    top.sum().backward()  # differentiable: the sparse forward KL trains through it
    assert model.output_weight.grad is not None and model.output_weight.grad.abs().sum() > 0


def test_top_k_is_validated() -> None:
    teacher = TeacherConfig(model="t")
    assert DistillConfig(teacher=teacher, top_k=None).top_k is None
    assert DistillConfig(teacher=teacher, top_k=1).top_k == 1
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="top_k must be"):
            DistillConfig(teacher=teacher, top_k=bad)  # type: ignore[arg-type]


def test_a_teacher_whose_output_has_another_size_is_refused_under_top_k(tiny_model_dir: Path, tmp_path: Path) -> None:
    from hpcrl.model.tiny import ModelShape, init_shaped_model
    from hpcrl.run.errors import RunError
    from hpcrl.run.teacher_start import check_teacher

    # The same character tokenizer, a wider output head.
    shape = ModelShape(vocab_size=163, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=16, max_position_embeddings=64)  # fmt: skip
    teacher = init_shaped_model(tmp_path / "teacher", shape, dtype="float32")
    d = DistillConfig(teacher=TeacherConfig(model=str(teacher)), top_k=4)
    with pytest.raises(RunError, match="must index the student's vocabulary"):
        check_teacher(d, tiny_model_dir, True, "arithmetic_answer", print)
    check_teacher(DistillConfig(teacher=TeacherConfig(model=str(teacher))), tiny_model_dir, True, "f", print)
