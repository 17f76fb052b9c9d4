"""`key=value` overrides are accepted before or after a command's options: `hpcrl run CONFIG --run-dir DIR a=1`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hpcrl.cli import build_parser, main, parse_args
from tests.support import REPO

QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "C.yaml", "a=1", "--run-dir", "D", "b.c=2"],
        ["run", "C.yaml", "--run-dir", "D", "a=1", "b.c=2"],
        ["run", "--run-dir", "D", "C.yaml", "a=1", "b.c=2"],
        ["submit", "C.yaml", "--run-dir", "D", "a=1", "b.c=2"],
        ["sbatch", "C.yaml", "-o", "OUT", "a=1", "--dry-run", "b.c=2"],
        ["sbatch", "C.yaml", "a=1", "b.c=2", "-o", "OUT", "--dry-run"],
    ],
)
def test_overrides_before_and_after_options_keep_their_order(argv: list[str]) -> None:
    ns = parse_args(build_parser(), argv)
    assert ns.config == "C.yaml"
    assert ns.overrides == ["a=1", "b.c=2"]
    assert (ns.run_dir if argv[0] != "sbatch" else ns.output) == ("D" if argv[0] != "sbatch" else "OUT")


def test_a_later_override_of_the_same_key_wins(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sbatch", QUICKSTART, "num_steps=5", "--dry-run", "num_steps=7"]
    assert main(argv) == 0
    assert "|num_steps: 7\n" in capsys.readouterr().out


def test_sbatch_takes_overrides_after_the_output_option(tmp_path: Path) -> None:
    script = tmp_path / "q.sbatch"
    assert main(["sbatch", QUICKSTART, "-o", str(script), "num_steps=3", "slurm.partition=gpu"]) == 0
    text = script.read_text()
    assert "|num_steps: 3\n" in text and "#SBATCH --partition=gpu" in text
    # The header's regeneration command puts the overrides first, which must read back the same.
    assert f"hpcrl sbatch {QUICKSTART} num_steps=3 slurm.partition=gpu -o {script}" in text


@pytest.mark.parametrize("command", [["run"], ["submit"], ["sbatch", "--dry-run"]])
def test_an_override_after_options_is_applied_by_every_command(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A value the config refuses shows that the override reached the config (not "unrecognized arguments").
    code = main([command[0], QUICKSTART, "--run-dir", str(tmp_path / "r"), *command[1:], "num_steps=-1"])
    assert code == 2
    assert "num_steps must be between 0 and 1,000,000,000, got -1" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_word_that_is_neither_option_nor_override_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", QUICKSTART, "--run-dir", "D", "num_steps=1", "oops"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "hpcrl run: 'oops' is neither an option of this command nor a key=value override" in err
    assert "see hpcrl run --help" in err


def test_unknown_options_and_commands_without_overrides_still_fail(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", QUICKSTART, "--run-dri", "D"])
    assert exit_info.value.code == 2
    assert "'--run-dri' is neither an option" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", "D", "window=3"])
    assert "unrecognized arguments: window=3" in capsys.readouterr().err


def test_guard_watch_takes_settings_after_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    shutil.copy(REPO / "tests" / "data" / "guard_nvml_h200.jsonl", trace)
    argv = ["guard", "watch", "hot_c=70", "--trace", str(trace), "--count", "1", "cool_c=60", "--interval-s", "0.01"]
    assert main(argv) == 0
    assert "gpu0 36/70 °C" in capsys.readouterr().out  # the reading / the pause threshold hot_c
