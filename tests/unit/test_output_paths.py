"""A path hpcrl writes (-o, --run-dir) with a control character is refused before anything is read or written:
the name would split or forge lines in the logs, progress output and generated scripts that print it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.cli import main
from tests.support import REPO

QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


@pytest.mark.parametrize(
    ("argv", "flag", "bad", "what"),
    [
        (["report", "r", "-o", "out\nx"], "-o/--output", "'out\\nx'", "a newline (U+000A)"),
        (["compare", "r", "s", "-o", "a\rb"], "-o/--output", "'a\\rb'", "a carriage return (U+000D)"),
        (["run", QUICKSTART, "--run-dir", "r\tx"], "--run-dir", "'r\\tx'", "a tab (U+0009)"),
        (["role", "trainer", "--run-dir", "r\nx"], "--run-dir", "'r\\nx'", "a newline (U+000A)"),
        (["sbatch", QUICKSTART, "-o", "job\x1b.sh"], "-o/--output", "'job\\x1b.sh'", "an escape character (U+001B)"),
        (["guard", "record", "-o", "t\x7f.jsonl"], "-o/--output", "'t\\x7f.jsonl'", "a control character (U+007F)"),
    ],
)
def test_an_output_path_with_a_control_character_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str,
    bad: str, what: str,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"error: argument {flag}: {bad} contains {what}; hpcrl does not write to a path with a control" in err
    assert "choose a path of printable characters" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing created
