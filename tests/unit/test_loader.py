"""What a config names by path (a reward, a buffer filter, an environment) goes through one loader: a dotted path
or a file path `file.py:name`; a path that does not load is one clear error before anything starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcrl.loader import LoadError, load_object
from hpcrl.store import load_metrics
from tests.support import hpcrl

TINY = [
    "num_steps=2",
    "sft.num_steps=0",
    "data.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_new_tokens=6",
    "checkpoint.every_steps=1",
]


def test_every_failure_has_one_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mod_a.py").write_text("value = 3\n")
    cases = {
        "mod_a": "it is not of the form module:name",
        "no_such_mod_hpcrl:f": "no module named 'no_such_mod_hpcrl' (check the spelling, and that it is on PYTHONPATH)",
        "./mod_a.py:missing": "'./mod_a.py' has no attribute 'missing' (it has: no public callables)",
        "./mod_b.py:f": f"no file 'mod_b.py' (relative paths start at {tmp_path})",
        "./mod_a.txt:f": "'mod_a.txt' is not a Python file (file.py)",
    }
    for spec, reason in cases.items():
        with pytest.raises(LoadError) as info:
            load_object(spec, key="buffer.filter")
        assert str(info.value) == (
            f"buffer.filter: cannot import {spec!r}: {reason}; give a dotted path module:function or a file path "
            "file.py:function"
        )
    assert load_object("./mod_a.py:value", key="x") == 3
    assert load_object("mod_a.py:value", key="x") == 3


def test_a_reward_path_that_does_not_import_is_refused_before_any_engine_starts(workdir: Path) -> None:
    out = hpcrl("run", "qs.yaml", *TINY, "reward.fn=my_rewards_hpcrl:score", "--run-dir", "r", cwd=workdir, check=False)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "hpcrl: error: reward.fn: cannot import 'my_rewards_hpcrl:score': no module named 'my_rewards_hpcrl' (check "
        "the spelling, and that it is on PYTHONPATH); give a built-in (exact_match, arithmetic_answer, gsm8k, "
        "math_verify, reasoning_gym), a dotted path module:function or a file path file.py:function"
    )
    # No engine started: the run dir, where an engine's log would be, was never created.
    assert "starting" not in out.stdout and not (workdir / "r").exists()


def test_a_reward_from_a_file_next_to_the_config_trains(workdir: Path) -> None:
    (workdir / "my_reward.py").write_text("def fn(response, answer):\n    return 0.25\n")
    hpcrl("run", "qs.yaml", *TINY, "reward.fn=./my_reward.py:fn", "--run-dir", "r", cwd=workdir)
    m = load_metrics(workdir / "r" / "metrics.h5")
    assert list(m["step"]) == [0, 1]
    np.testing.assert_array_equal(m["rollout/reward_mean"], [0.25, 0.25])
