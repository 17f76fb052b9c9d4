"""Evaluation during training: held-out prompts, greedy accuracy and pass@k / mean@k in
metrics.h5, and a run with evaluation trains exactly as one without."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcrl.report.build import build_report
from hpcrl.rollout.config import EvalConfig
from hpcrl.rollout.evaluate import held_out_examples
from hpcrl.run_config import load_run_config
from hpcrl.samples.sample import DataError, Example
from hpcrl.store import load_metrics
from tests.support import SMALL, assert_same_metrics, hpcrl


def test_held_out_examples_leave_out_every_training_prompt() -> None:
    training = [Example(f"{i}+1=", str(i + 1)) for i in range(5)]
    built = [Example(f"{i}+1=", str(i + 1)) for i in range(3, 12)]
    held = held_out_examples(EvalConfig(every_steps=1, num_prompts=4), training, built)
    assert [e.prompt for e in held] == ["5+1=", "6+1=", "7+1=", "8+1="]
    with pytest.raises(DataError, match="no held-out prompt"):
        held_out_examples(EvalConfig(every_steps=1), training, training)


def test_bad_eval_settings_are_refused_at_load(tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {path: m}\ndata: {source: train.jsonl}\neval: {every_steps: 5}\n")
    with pytest.raises(ValueError, match=r"data.source 'train.jsonl' is a file, so set eval.source"):
        load_run_config(cfg)
    for bad, message in (("every_steps: -1", "every_steps must be >= 0"), ("num_samples: 0", "k of pass@k")):
        cfg.write_text(f"model: {{path: m}}\neval: {{{bad}}}\n")
        with pytest.raises(ValueError, match=message):
            load_run_config(cfg)


def test_a_run_with_evaluation_trains_exactly_as_one_without(workdir: Path, small_run: tuple[Path, str]) -> None:
    # The run without evaluation is the session's shared SMALL run (6 steps): the same command less `eval.*`.
    evals = ["eval.every_steps=2", "eval.num_prompts=8", "eval.num_samples=3"]
    out = hpcrl("run", "qs.yaml", *SMALL, *evals, "--run-dir", "with", cwd=workdir)
    assert "eval after step 2: greedy accuracy" in out.stdout and "pass@3" in out.stdout
    with_eval, without = load_metrics(workdir / "with" / "metrics.h5"), load_metrics(small_run[0] / "metrics.h5")
    # Evaluated after steps 2, 4 and 6 (rows 1, 3, 5); every figure a share of 8 prompts (of 3 samples for mean@k).
    evaluated, skipped = [1, 3, 5], [0, 2, 4]
    for key in ("eval/accuracy_greedy", "eval/pass_at_k", "eval/mean_at_k"):
        values = with_eval.pop(key)
        assert np.isnan(values[skipped]).all() and np.isfinite(values[evaluated]).all(), key
        assert ((values[evaluated] * 8 * (3 if key == "eval/mean_at_k" else 1)) % 1 == 0).all(), key
        assert ((0 <= values[evaluated]) & (values[evaluated] <= 1)).all(), key
    assert list(with_eval.pop("eval/num_prompts")[evaluated]) == [8, 8, 8]
    with_eval.pop("eval/k")
    with_eval.pop("timing/eval_s", None)
    without.pop("timing/eval_s", None)
    # The training figures are bitwise those of the run without evaluation: it touched no training stream.
    assert_same_metrics(with_eval, without)
    report = build_report(workdir / "with", out_dir=workdir / "report")
    assert "Evaluation" in (workdir / "report" / "report.md").read_text() and report is not None
