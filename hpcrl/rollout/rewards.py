"""Reward functions: plain callables `fn(response: str, answer: str) -> float`, named in the config.

A reward that also declares a keyword `meta` gets the example's meta JSON (`Example.meta`): the built-in
`reasoning_gym` reward uses it to find the task entry its scorer needs.

A reward is either a built-in name (see `BUILTIN_REWARDS`) or a path to any callable, `package.module:func` or
`file.py:func` (hpcrl/loader.py). `score` runs one over a batch so that a crash or a bad value in one sample marks
that sample failed instead of killing the step; `check_failures` then decides, from a configured share, whether the
batch is still worth training on.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import numbers
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import NoReturn, cast

from hpcrl.loader import LoadError, load_object

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFn",
    "ScoreResult",
    "ScoringInterrupted",
    "arithmetic_answer",
    "check_failures",
    "exact_match",
    "gsm8k_final_number",
    "load_reward",
    "score",
]

RewardFn = Callable[[str, str], float]


class RewardError(ValueError):
    """A reward function could not be loaded, or failed on too many samples."""


# ---------------------------------------------------------------------------------------------------
# Built-in rewards


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response equals the answer up to surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


# An integer not glued to a decimal point: "3.5" holds no integer, while "is 7." ends with 7.
# The minus counts only when no digit precedes it, so "10-3" ends with 3, not -3.
_INTEGER_RE = re.compile(r"(?<![\d.])-?\d+(?!\.?\d)")


def arithmetic_answer(response: str, answer: str) -> float:
    """1.0 when the last integer in the response equals the integer answer, else 0.0.

    Integers are plain digits with an optional leading minus; thousands separators are not understood
    ("1,234" ends with the integer 234), which suits the generated arithmetic tasks this is meant for.
    """
    try:
        expected = int(answer.strip())
    except ValueError:
        raise ValueError(f"arithmetic_answer needs an integer answer, got {answer!r}") from None
    matches = _INTEGER_RE.findall(response)
    return 1.0 if matches and int(matches[-1]) == expected else 0.0


# Thousands groups are tried first so that "1,234" is one number but "1,2,3" is three.
_NUMBER_RE = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_GSM8K_TOLERANCE = 1e-6


def _final_number(text: str) -> float | None:
    """The number after the last '####' when there is one, else the last number in the text."""
    _, marker, after = text.rpartition("####")
    if marker:
        match = _NUMBER_RE.search(after)
        if match:
            return float(match.group().replace(",", "").replace("$", ""))
    numbers_found = _NUMBER_RE.findall(text)
    if not numbers_found:
        return None
    return float(numbers_found[-1].replace(",", "").replace("$", ""))


def gsm8k_final_number(response: str, answer: str) -> float:
    """1.0 when the response's final number equals the answer's, within 1e-6, else 0.0.

    The final number is the one after '####' when present, else the last number; commas and '$' are
    ignored. The answer may be a bare number or a full GSM8K solution ending in '#### 72'.
    """
    expected = _final_number(answer)
    if expected is None:
        raise ValueError(f"gsm8k_final_number found no number in the answer {answer!r}")
    got = _final_number(response)
    return 1.0 if got is not None and abs(got - expected) <= _GSM8K_TOLERANCE else 0.0


def math_verify(response: str, answer: str) -> float:
    """1.0 when `math-verify` finds the response's final answer mathematically equal to the reference
    (LaTeX or plain: "\\frac{1}{2}" equals "0.5"), else 0.0. Needs `pip install 'hpcrl[data]'`."""
    try:
        import math_verify as mv
    except ImportError:
        raise RewardError("reward.fn=math_verify needs the math-verify package: pip install 'hpcrl[data]'") from None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that its timeout is off
    gold = mv.parse(answer, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify could not parse the reference answer {answer!r}")
    # parsing_timeout/timeout_seconds use signal.alarm, which works only in the main thread; score() runs
    # rewards in a worker thread and bounds them with reward.timeout_s instead.
    return 1.0 if mv.verify(gold, mv.parse(response, parsing_timeout=None), timeout_seconds=None) else 0.0


def reasoning_gym(response: str, answer: str, *, meta: str) -> float:
    """The reasoning-gym task's own scorer (data.source: reasoning_gym:TASK), on the text inside
    <answer>...</answer> when the response has one, else on the whole response."""
    from hpcrl.rollout.external_data import score_gym

    return score_gym(response, meta)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "arithmetic_answer": arithmetic_answer,
    "gsm8k": gsm8k_final_number,
    "math_verify": math_verify,
    "reasoning_gym": cast(RewardFn, reasoning_gym),
}


def takes_meta(fn: Callable[..., object]) -> bool:
    """Whether a reward declares the keyword `meta` (then it is called as fn(response, answer, meta=...))."""
    try:
        return "meta" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------------
# Loading


def load_reward(spec: str) -> RewardFn:
    """The reward function named by `spec`: a built-in name, or a path hpcrl/loader.py loads ('package.module:func',
    'package.module.func' or 'file.py:func')."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    builtins = ", ".join(BUILTIN_REWARDS)
    if ":" not in spec and "." not in spec:
        raise LoadError("reward.fn", spec, "it is neither a built-in nor a path", builtins=builtins)
    fn = load_object(spec, key="reward.fn", builtins=builtins)
    if not callable(fn):
        raise LoadError("reward.fn", spec, f"it is a {type(fn).__name__}, not callable", builtins=builtins)
    _check_signature(fn, spec)
    return cast(RewardFn, fn)


def _check_signature(fn: Callable[..., object], spec: str) -> None:
    # Catch a wrong signature at load time rather than as a failure on every sample of the first step.
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some C callables have no signature to check
    try:
        signature.bind("response", "answer")
    except TypeError as exc:
        raise LoadError(
            "reward.fn", spec, f"its signature {signature} cannot be called as fn(response, answer): {exc}"
        ) from None


# ---------------------------------------------------------------------------------------------------
# Scoring


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """Rewards of a batch; a failed sample has reward NaN and its error text, the others error None."""

    rewards: list[float]
    errors: list[str | None]

    @property
    def num_failed(self) -> int:
        return sum(error is not None for error in self.errors)

    @property
    def failed_share(self) -> float:
        return self.num_failed / len(self.errors) if self.errors else 0.0


class ScoringInterrupted(Exception):
    """`interrupted()` became true while a reward call was still running (a preemption signal)."""


def score(
    fn: RewardFn,
    responses: Sequence[str],
    answers: Sequence[str],
    *,
    metas: Sequence[str] | None = None,
    timeout_s: float | None = None,
    interrupted: Callable[[], bool] | None = None,
    poll_s: float = 0.05,
) -> ScoreResult:
    """Apply `fn` to each (response, answer); exceptions and non-finite or non-numeric values fail that sample.

    With `timeout_s`, a call that runs longer fails its sample ("timed out") and is left behind in its
    thread: Python cannot stop a running function, and a hung reward must not hang the run. With
    `interrupted`, ScoringInterrupted is raised as soon as it returns true, however long the call runs.
    """
    if len(responses) != len(answers):
        raise ValueError(f"score got {len(responses)} responses but {len(answers)} answers; pass one answer each")
    items: list[tuple[str, str, str | None]]
    if takes_meta(fn):
        if metas is None or len(metas) != len(answers):
            raise ValueError("this reward takes each example's meta: pass metas, one per answer")
        items = [(response, answer, meta) for response, answer, meta in zip(responses, answers, metas, strict=True)]
    else:
        items = [(response, answer, None) for response, answer in zip(responses, answers, strict=True)]
    if timeout_s is None and interrupted is None:
        pairs = [_score_one(fn, *item) for item in items]
    else:
        pairs = _score_watched(fn, items, timeout_s, interrupted, poll_s)
    return ScoreResult(rewards=[r for r, _ in pairs], errors=[e for _, e in pairs])


def _score_watched(
    fn: RewardFn,
    items: list[tuple[str, str, str | None]],
    timeout_s: float | None,
    interrupted: Callable[[], bool] | None,
    poll_s: float,
) -> list[tuple[float, str | None]]:
    """Score in a daemon worker thread, in order, while this thread watches the clock and `interrupted`."""
    results: list[tuple[float, str | None]] = []
    while len(results) < len(items):
        done: queue.Queue[tuple[float, str | None]] = queue.Queue()
        todo = items[len(results) :]
        worker = threading.Thread(
            target=_score_in_worker,
            args=(fn, todo, done),
            name="hpcrl-reward",
            daemon=True,  # a reward that never returns must not keep the process alive
        )
        worker.start()
        for _ in todo:
            pair = _wait_for_one(done, timeout_s, interrupted, poll_s, what=f"sample {len(results)} of {len(items)}")
            if pair is None:
                # The worker is stuck in this sample: fail it, and score the rest in a fresh worker.
                results.append((math.nan, f"timed out after {timeout_s:g} s (reward.timeout_s)"))
                break
            results.append(pair)
    return results


def _score_in_worker(
    fn: RewardFn, todo: list[tuple[str, str, str | None]], done: queue.Queue[tuple[float, str | None]]
) -> None:
    for item in todo:
        try:
            done.put(_score_one(fn, *item))
        except BaseException as exc:  # noqa: BLE001 - a dead worker would leave the run waiting forever
            done.put((math.nan, f"reward raised {type(exc).__name__}: {exc}"))


def _wait_for_one(
    done: queue.Queue[tuple[float, str | None]],
    timeout_s: float | None,
    interrupted: Callable[[], bool] | None,
    poll_s: float,
    *,
    what: str,
) -> tuple[float, str | None] | None:
    """The worker's next result, or None when it takes longer than timeout_s."""
    deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if interrupted is not None and interrupted():
            raise ScoringInterrupted(f"interrupted while scoring {what}")
        wait_s = poll_s if deadline_s is None else min(poll_s, max(0.0, deadline_s - time.monotonic()))
        try:
            return done.get(timeout=wait_s)
        except queue.Empty:
            if deadline_s is not None and time.monotonic() >= deadline_s:
                return None


class _ExitInReward(BaseException):
    """A reward called os._exit: raised in its place, so that the sample fails instead of the run vanishing."""

    def __init__(self, code: object) -> None:
        super().__init__(code)
        self.code = code


# The process whose reward call the current thread is in (None: none). A pid, not a flag: a reward that
# forks (multiprocessing) must let its child leave through the real os._exit.
_in_reward = threading.local()
_real_os_exit = os._exit


def _guarded_os_exit(status: int) -> NoReturn:
    if getattr(_in_reward, "pid", None) == os.getpid():
        raise _ExitInReward(status)
    _real_os_exit(status)


def _guard_os_exit() -> None:
    """Make os._exit called by a reward fail its sample: the run would otherwise end with no message or event.
    Other callers (and a reward's forked children) exit as before."""
    if os._exit is not _guarded_os_exit:
        os._exit = _guarded_os_exit


def _score_one(fn: RewardFn, response: str, answer: str, meta: str | None = None) -> tuple[float, str | None]:
    _guard_os_exit()
    _in_reward.pid = os.getpid()
    try:
        value: object = fn(response, answer) if meta is None else fn(response, answer, meta=meta)  # type: ignore[call-arg]
    except Exception as exc:  # a user hook may raise anything; one bad sample must not end the step
        return math.nan, f"{type(exc).__name__}: {exc}"
    except _ExitInReward as exc:
        return math.nan, f"reward called os._exit({exc.code!r}); a reward must return a number, not end the process"
    except SystemExit as exc:
        return math.nan, f"reward raised SystemExit({exc.code!r}); a reward must return a number, not exit"
    except KeyboardInterrupt:
        if threading.current_thread() is threading.main_thread():
            raise  # may be the user's Ctrl-C
        return math.nan, "reward raised KeyboardInterrupt; a reward must return a number"
    finally:
        _in_reward.pid = None
    # numbers.Real admits numpy scalars; bool is an int, so True/False count as 1.0/0.0.
    if not isinstance(value, numbers.Real):
        return math.nan, f"reward returned {type(value).__name__}, expected a number"
    reward = float(value)
    if not math.isfinite(reward):
        return math.nan, f"reward returned {reward}, expected a finite number"
    return reward, None


def check_failures(result: ScoreResult, max_failed_share: float) -> None:
    """Raise RewardError when the share of failed samples is above `max_failed_share` (0 to 1)."""
    if not 0.0 <= max_failed_share <= 1.0:
        raise ValueError(f"max_failed_share must be between 0 and 1, got {max_failed_share}")
    if result.failed_share <= max_failed_share:
        return
    first = next(i for i, error in enumerate(result.errors) if error is not None)
    raise RewardError(
        f"reward failed on {result.num_failed} of {len(result.errors)} samples ({result.failed_share:.1%}), "
        f"above max_failed_share {max_failed_share:.1%}; first error (sample {first}): {result.errors[first]}"
    )
