"""Knobs with a bound and YAML that would expand without one: refused at load, quickly, with the fix named."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.config import ConfigError, load_config, load_yaml
from hpcrl.run_config import RunConfig
from tests.support import REPO

QUICKSTART = REPO / "experiments" / "quickstart.yaml"
ASYNC = REPO / "experiments" / "async-quickstart.yaml"


def billion_laughs(key: str) -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + f"\n{key}: *l9\n"


@pytest.mark.parametrize("key", ["name", "not_a_key"])
def test_a_billion_laughs_config_is_refused_at_once(tmp_path: Path, key: str) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(key))
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, path)
    assert time.monotonic() - t0 < 5
    assert f"invalid YAML in {path}" in str(info.value) and "anchors and aliases" in str(info.value)
    assert "more than 100,000 values" in str(info.value)


def test_hpcrl_run_refuses_a_billion_laughs_config_with_an_error_line(tmp_path: Path) -> None:
    (tmp_path / "bomb.yaml").write_text(billion_laughs("name"))
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", "bomb.yaml", "--run-dir", "r"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    print(f"refused in {time.monotonic() - t0:.1f} s: {out.stderr.strip()}")
    assert out.returncode == 2 and "hpcrl: error: invalid YAML in bomb.yaml" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "r").exists()


def test_anchors_and_merge_keys_within_the_bound_still_load(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nderived:\n  <<: *b\n  y: 3\nlist: [*b, *b]\n")
    assert load_yaml(path)["derived"] == {"x": 1, "y": 3}


@pytest.mark.parametrize(
    ("config", "overrides", "message"),
    [
        (QUICKSTART, ["num_steps=1000000000000000000000000000000"], "num_steps must be between 0 and 1,000,000,000"),
        (QUICKSTART, ["data.num_examples=3", "data.prompts_per_step=4"],
         "num_examples=3 is less than prompts_per_step=4"),
        (ASYNC, ["buffer.max_inflight_groups=100000"], "max_inflight_groups=100000 is more than 1024 groups"),
    ],
)  # fmt: skip
def test_unbounded_knobs_are_refused(config: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, config, overrides)
    assert message in str(info.value)


def test_the_quickstarts_stay_within_the_bounds() -> None:
    load_config(RunConfig, QUICKSTART)
    load_config(RunConfig, ASYNC, ["buffer.max_inflight_groups=32"])


def test_slurm_env_refuses_the_engine_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, QUICKSTART, ["slurm.env={HPCRL_ENGINE_API_KEY: secret}"])
    assert "HPCRL_ENGINE_API_KEY would be written into the job script" in str(info.value)
