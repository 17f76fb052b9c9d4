"""`hpcrl config show`: the resolved config as a config file, each key with its doc and default; `--diff`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hpcrl.cli import main
from hpcrl.config import from_dict
from hpcrl.run_config import RunConfig, load_run_config
from tests.support import REPO

QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


def show(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["config", "show", *args]) == 0
    return capsys.readouterr().out


def test_show_prints_the_resolved_config_that_runs_as_it_is(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    text = show(capsys, QUICKSTART, "train.lr=1e-4", "logging.tensorboard=true")
    lines = text.splitlines()
    # Each key's doc above it, its default beside it where the value differs.
    at = lines.index("  every_steps: 25  # default: 10")
    assert lines[at - 1] == "  # Write a checkpoint after every N-th GRPO step (and after the last)."
    assert "  lr: 0.0001  # default: 1e-05" in lines and "seed: 0" in lines
    assert "  tensorboard: true  # default: false" in lines
    assert max(len(line) for line in lines) <= 120
    (tmp_path / "shown.yaml").write_text(text)
    expected = load_run_config(QUICKSTART, ["train.lr=1e-4", "logging.tensorboard=true"])
    assert load_run_config(tmp_path / "shown.yaml") == expected


def test_diff_shows_only_what_differs_from_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = show(capsys, QUICKSTART, "--diff", "--no-docs", "logging.wandb.project=grpo")
    assert "num_steps: 300  # default: 20" in text.splitlines()
    assert "seed:" not in text and "#" not in text.replace("# default:", "")
    assert 'logging:\n  wandb:\n    project: "grpo"  # default: required\n' in text
    data = yaml.safe_load(text)
    assert data["train"] == {"lr": 0.0005, "micro_batch_size": 128, "old_logprobs": "trainer"}
    # The diff plus the defaults is the config.
    assert from_dict(RunConfig, data) == load_run_config(QUICKSTART, ["logging.wandb.project=grpo"])


def test_without_a_config_it_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = show(capsys, "num_steps=3")
    assert "num_steps: 3  # default: 20" in text
    assert "  path:  # required: set it in the config or as model.path=..." in text
    assert "  wandb: null" in text and "project:" not in text  # an absent optional section hides its keys


def test_an_unknown_key_is_refused_with_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", QUICKSTART, "logging.neptune=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'logging.neptune'" in err and "valid keys of logging: tensorboard, wandb, mlflow" in err
