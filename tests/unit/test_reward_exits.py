"""A reward that exits instead of returning: SystemExit, KeyboardInterrupt, os._exit fail their sample.

Real scoring threads, a real forked child of a reward, and a real `hpcrl run` whose reward calls os._exit.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpcrl.rollout.rewards import score
from hpcrl.store.metrics import load_events
from tests.support import REPO


def _sys_exit(response: str, answer: str) -> float:
    sys.exit(3)


def _keyboard_interrupt(response: str, answer: str) -> float:
    raise KeyboardInterrupt


def _os_exit(response: str, answer: str) -> float:
    os._exit(7)


def _ok_or_exit(response: str, answer: str) -> float:
    if response == "bad":
        os._exit(7)
    return 1.0


WATCHED = [{"timeout_s": 5.0}, {"interrupted": lambda: False}, {"timeout_s": None}]


@pytest.mark.parametrize("watch", WATCHED, ids=["timeout", "interrupted", "unwatched"])
@pytest.mark.parametrize(
    ("fn", "error"),
    [
        (_sys_exit, "reward raised SystemExit(3)"),
        (_os_exit, "reward called os._exit(7)"),
        (_keyboard_interrupt, "reward raised KeyboardInterrupt"),
    ],
)
def test_a_reward_that_exits_fails_its_sample(fn, error: str, watch: dict) -> None:
    if fn is _keyboard_interrupt and not watch.get("timeout_s") and "interrupted" not in watch:
        # Unwatched, the reward runs in the main thread, where a KeyboardInterrupt may be the user's Ctrl-C.
        with pytest.raises(KeyboardInterrupt):
            score(fn, ["a"], ["b"], **watch)
        return
    result = score(fn, ["a", "b"], ["x", "y"], **watch)
    assert all(math.isnan(r) for r in result.rewards)
    assert result.errors[0] is not None and result.errors[0].startswith(error), result.errors


def test_only_the_exiting_sample_fails_and_os_exit_works_elsewhere() -> None:
    result = score(_ok_or_exit, ["ok", "bad", "ok"], ["1", "1", "1"], timeout_s=5.0)
    assert result.rewards[0] == 1.0 and math.isnan(result.rewards[1]) and result.rewards[2] == 1.0
    # Outside a reward call, os._exit ends a (forked) process as before.
    child = multiprocessing.get_context("fork").Process(target=os._exit, args=(5,))
    child.start()
    child.join(10)
    assert child.exitcode == 5


def _forking_reward(response: str, answer: str) -> float:
    child = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    child.start()
    child.join(10)
    return 1.0 if child.exitcode == 0 else 0.0


def test_a_reward_that_forks_lets_its_child_exit() -> None:
    result = score(_forking_reward, ["a"], ["b"], timeout_s=20.0)
    assert result.rewards == [1.0], result.errors


@pytest.mark.parametrize(("body", "shown"), [("os._exit(7)", "os._exit(7)"), ("sys.exit(3)", "SystemExit(3)")])
def test_a_run_whose_reward_exits_stops_with_a_message_and_an_event(
    tmp_path: Path, tiny_model_dir: Path, body: str, shown: str
) -> None:
    (tmp_path / "exiting_reward.py").write_text(
        textwrap.dedent(f"""
            import os, sys

            def reward(response, answer):
                {body}
        """)
    )
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", str(REPO / "experiments" / "quickstart.yaml"),
         f"model.path={tiny_model_dir}", "num_steps=2", "reward.fn=exiting_reward.reward", "--run-dir", "r",
         # The first reward call exits: no SFT warm start and one small step's rollout lead to it.
         "sft.num_steps=0", "data.prompts_per_step=2", "rollout.n_samples_per_prompt=2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    print(out.stderr[-1500:])
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    assert "hpcrl: error:" in out.stderr and shown in out.stderr and "Traceback" not in out.stderr
    stopped = [e for e in load_events(tmp_path / "r" / "metrics.h5") if e["kind"] == "stopped"]
    assert stopped and shown in stopped[0]["detail"]["first_error"]
