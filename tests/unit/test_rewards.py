"""Reward functions: built-ins, loading by name or dotted path, batch scoring and the failure budget."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from hpcrl.loader import LoadError
from hpcrl.rollout.rewards import (
    BUILTIN_REWARDS,
    RewardError,
    ScoreResult,
    arithmetic_answer,
    check_failures,
    exact_match,
    gsm8k_final_number,
    load_reward,
    score,
    takes_meta,
)

# --- built-ins -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "answer", "reward"), [(" 42\n", "42", 1.0), ("42", " 42 ", 1.0), ("4 2", "42", 0.0)]
)
def test_exact_match(response: str, answer: str, reward: float) -> None:
    assert exact_match(response, answer) == reward


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("357", "357", 1.0),
        ("12+345=357", "357", 1.0),
        ("The answer is 357.", "357", 1.0),
        ("first 357 then 358", "357", 0.0),
        ("it is -5", "-5", 1.0),
        ("10-3", "7", 0.0),  # the last integer is 3: a minus after a digit is an operator
        ("10-3", "3", 1.0),
        ("3.5", "5", 0.0),  # no integer inside a decimal number
        ("about 3.5 or 4", "4", 1.0),
        ("no digits here", "1", 0.0),
        ("", "0", 0.0),
        ("x=0042", "42", 1.0),
        ("1,234", "234", 1.0),  # thousands separators are not understood (documented)
    ],
)
def test_arithmetic_answer(response: str, answer: str, reward: float) -> None:
    assert arithmetic_answer(response, answer) == reward


def test_arithmetic_answer_needs_integer_answer() -> None:
    with pytest.raises(ValueError, match=r"arithmetic_answer needs an integer answer, got 'x'"):
        arithmetic_answer("1", "x")


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("so she has 72 eggs\n#### 72", "72", 1.0),
        ("#### 72 and later 5", "72", 1.0),  # the number after '####' wins over the last number
        ("#### 1 then #### 72", "72", 1.0),  # the last '####' counts
        ("She pays $1,234.50 in total.", "1234.5", 1.0),
        ("costs -$5", "-5", 1.0),
        ("72.0000000001", "72", 1.0),
        ("72.01", "72", 0.0),
        ("#### none", "3", 0.0),
        ("#### none, but 3 earlier", "3", 1.0),  # '####' without a number falls back to the last number
        ("1, 2, 3", "3", 1.0),
        ("nothing", "3", 0.0),
        ("He had 18 then 20", "Janet sells 16 - 3 - 4 = 9 eggs... she makes 9 * 2 = $18.\n#### 18", 0.0),
        ("#### 18", "Janet sells 16 - 3 - 4 = 9 eggs... she makes 9 * 2 = $18.\n#### 18", 1.0),
    ],
)
def test_gsm8k_final_number(response: str, answer: str, reward: float) -> None:
    assert gsm8k_final_number(response, answer) == reward


def test_gsm8k_needs_a_number_in_the_answer() -> None:
    with pytest.raises(ValueError, match="found no number in the answer 'n/a'"):
        gsm8k_final_number("1", "n/a")


@pytest.mark.parametrize("name", sorted(n for n, fn in BUILTIN_REWARDS.items() if not takes_meta(fn)))
def test_builtin_contract(name: str) -> None:
    # The contract every reward hook must meet: fn(response, answer) -> a finite float (the ones taking
    # an example's meta are tested with their data source in test_external_data.py).
    fn = load_reward(name)
    for response, answer in [("7", "7"), ("#### 7", "8"), ("", "0")]:
        value = fn(response, answer)
        assert isinstance(value, float) and math.isfinite(value)


# --- load_reward -----------------------------------------------------------------------------------


def test_load_builtins_by_name() -> None:
    assert load_reward("exact_match") is exact_match
    assert load_reward("arithmetic_answer") is arithmetic_answer
    assert load_reward("gsm8k") is gsm8k_final_number


@pytest.mark.parametrize("spec", ["hpcrl.rollout.rewards.exact_match", "hpcrl.rollout.rewards:exact_match"])
def test_load_by_dotted_path(spec: str) -> None:
    assert load_reward(spec) is exact_match


def test_load_user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_reward_ok.py").write_text("def length(response, answer):\n    return float(len(response))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("user_reward_ok:length")
    assert fn("abc", "") == 3.0


BUILTINS = "exact_match, arithmetic_answer, gsm8k, math_verify, reasoning_gym"
HINT = f"; give a built-in ({BUILTINS}), a dotted path module:function or a file path file.py:function"


def test_unknown_bare_name_lists_builtins() -> None:
    with pytest.raises(LoadError) as info:
        load_reward("exact")
    assert str(info.value) == "reward.fn: cannot import 'exact': it is neither a built-in nor a path" + HINT


@pytest.mark.parametrize("spec", [":f", "mod:", ".f"])
def test_malformed_path(spec: str) -> None:
    with pytest.raises(LoadError) as info:
        load_reward(spec)
    assert str(info.value) == f"reward.fn: cannot import {spec!r}: it is not of the form module:name" + HINT


def test_missing_module() -> None:
    with pytest.raises(LoadError) as info:
        load_reward("no_such_pkg_hpcrl.rewards.f")
    assert str(info.value) == (
        "reward.fn: cannot import 'no_such_pkg_hpcrl.rewards.f': no module named 'no_such_pkg_hpcrl' (check the "
        "spelling, and that it is on PYTHONPATH)" + HINT
    )


def test_module_whose_own_import_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_reward_dep.py").write_text("import no_such_dependency_hpcrl\n\ndef f(r, a):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        LoadError, match=r"importing 'user_reward_dep' failed: No module named 'no_such_dependency_hpcrl'"
    ):
        load_reward("user_reward_dep.f")


def test_module_that_raises_on_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_reward_boom.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(LoadError, match=r"importing 'user_reward_boom' raised RuntimeError: boom"):
        load_reward("user_reward_boom.f")


def test_missing_attribute_lists_callables() -> None:
    with pytest.raises(LoadError) as info:
        load_reward("hpcrl.rollout.rewards.exact_matsh")
    message = str(info.value)
    assert "'hpcrl.rollout.rewards' has no attribute 'exact_matsh' (it has: " in message
    assert "arithmetic_answer" in message and message.endswith(HINT)


def test_not_callable() -> None:
    with pytest.raises(LoadError, match=r"reward.fn: cannot import 'math.pi': it is a float, not callable; give"):
        load_reward("math.pi")


def test_wrong_signature_is_caught_at_load() -> None:
    with pytest.raises(LoadError, match=r"its signature .* cannot be called as fn\(response, answer\)"):
        load_reward("math.sqrt")


def test_a_reward_from_a_file_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`reward.fn=./my_reward.py:fn`, relative to the working directory, as a user writes it next to a config."""
    (tmp_path / "my_reward.py").write_text("def fn(response, answer):\n    return float(response == answer)\n")
    monkeypatch.chdir(tmp_path)
    fn = load_reward("./my_reward.py:fn")
    assert fn("7", "7") == 1.0 and fn("7", "8") == 0.0
    assert load_reward(str(tmp_path / "my_reward.py") + ":fn") is fn  # one module per file, however it is named
    with pytest.raises(LoadError) as info:
        load_reward("./no_reward.py:fn")
    assert str(info.value) == (
        f"reward.fn: cannot import './no_reward.py:fn': no file 'no_reward.py' (relative paths start at {tmp_path})"
        + HINT
    )
    (tmp_path / "broken.py").write_text("def fn(response, answer)\n")
    with pytest.raises(LoadError, match=r"running 'broken.py' raised SyntaxError: .*; give a built-in"):
        load_reward("broken.py:fn")


# --- score / check_failures ------------------------------------------------------------------------


def test_score_all_ok() -> None:
    result = score(exact_match, ["a", "b"], ["a", "c"])
    assert result == ScoreResult(rewards=[1.0, 0.0], errors=[None, None])
    assert result.num_failed == 0 and result.failed_share == 0.0


def test_score_records_exceptions_as_failed_samples() -> None:
    result = score(arithmetic_answer, ["1", "2"], ["1", "two"])
    assert result.rewards[0] == 1.0 and math.isnan(result.rewards[1])
    assert result.errors == [None, "ValueError: arithmetic_answer needs an integer answer, got 'two'"]


@pytest.mark.parametrize(
    ("value", "reward", "error"),
    [
        (True, 1.0, None),
        (False, 0.0, None),
        (2, 2.0, None),
        (np.float32(0.5), 0.5, None),
        (np.int64(3), 3.0, None),
        (Fraction(1, 4), 0.25, None),
        ("1.0", math.nan, "reward returned str, expected a number"),
        (None, math.nan, "reward returned NoneType, expected a number"),
        (1j, math.nan, "reward returned complex, expected a number"),
        (math.nan, math.nan, "reward returned nan, expected a finite number"),
        (-math.inf, math.nan, "reward returned -inf, expected a finite number"),
    ],
)
def test_score_checks_returned_values(value: object, reward: float, error: str | None) -> None:
    result = score(lambda response, answer: value, ["r"], ["a"])  # type: ignore[arg-type,return-value]
    assert result.errors == [error]
    got = result.rewards[0]
    assert (math.isnan(got) and math.isnan(reward)) or got == reward
    assert type(got) is float


def test_score_length_mismatch() -> None:
    with pytest.raises(ValueError, match="score got 2 responses but 1 answers"):
        score(exact_match, ["a", "b"], ["a"])


def test_score_empty_batch() -> None:
    result = score(exact_match, [], [])
    assert result.rewards == [] and result.failed_share == 0.0
    check_failures(result, max_failed_share=0.0)


def test_check_failures_within_budget_passes() -> None:
    result = score(arithmetic_answer, ["1", "1", "1", "1"], ["1", "1", "1", "x"])
    assert result.failed_share == 0.25
    check_failures(result, max_failed_share=0.25)


def test_check_failures_over_budget_names_share_and_first_error() -> None:
    result = score(arithmetic_answer, ["1", "1", "1", "1"], ["1", "x", "1", "y"])
    with pytest.raises(RewardError) as info:
        check_failures(result, max_failed_share=0.25)
    assert str(info.value) == (
        "reward failed on 2 of 4 samples (50.0%), above max_failed_share 25.0%; "
        "first error (sample 1): ValueError: arithmetic_answer needs an integer answer, got 'x'"
    )


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_check_failures_validates_share(share: float) -> None:
    with pytest.raises(ValueError, match="max_failed_share must be between 0 and 1"):
        check_failures(ScoreResult(rewards=[], errors=[]), max_failed_share=share)
