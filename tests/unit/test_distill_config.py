"""The distill section: parsed into its dataclasses, its mistakes refused with the key and the fix."""

from __future__ import annotations

import pytest

from hpcrl.config import ConfigError
from hpcrl.run_config import load_run_config
from tests.support import REPO

QUICKSTART = REPO / "experiments" / "quickstart.yaml"
TEACHER = ["distill.teacher.model=runs/models/teacher"]


def test_the_distill_section_parses_with_the_teacher_engine_as_an_engine_section() -> None:
    cfg = load_run_config(QUICKSTART, [*TEACHER, "distill.mode=mixed", "distill.coef=0.5",
                                       "distill.teacher.engine.num_threads=2"])  # fmt: skip
    assert cfg.distill is not None
    assert (cfg.distill.mode, cfg.distill.coef, cfg.distill.teacher.model) == ("mixed", 0.5, "runs/models/teacher")
    assert cfg.distill.teacher.engine.num_threads == 2
    assert load_run_config(QUICKSTART).distill is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "distill.teacher.engine.bogus=1",
            "unknown key 'distill.teacher.engine.bogus'; valid keys of distill.teacher.engine: kind, num_engines",
        ),
        ("distill.bogus=1", "unknown key 'distill.bogus'; valid keys of distill: teacher, mode, coef"),
        ("distill.coef=0", "coef must be a finite number > 0, got 0.0"),
        ("distill.mode=forward_kl", "distill.mode: expected one of 'reverse_kl', 'mixed'"),
        ("distill.top_k=0", "top_k must be >= 1"),
        (
            "distill.top_k=4 train.logprobs=invariant engine.batch_invariant=true",
            "set train.logprobs=plain or distill.top_k=null",
        ),
        ("rollout.top_k=5", "set rollout.top_k=-1 and rollout.top_p=1"),
        ("distill.teacher.engine.offload_during_train=true", "never paused for the trainer"),
    ],
)
def test_bad_distill_settings_are_refused_naming_the_key(override: str, message: str) -> None:
    with pytest.raises((ConfigError, ValueError)) as error:
        load_run_config(QUICKSTART, [*TEACHER, *override.split()])
    assert message in str(error.value)


def test_a_distill_section_without_a_teacher_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="teacher"):
        load_run_config(QUICKSTART, ["distill.mode=mixed"])
