"""The code style gate: ruff (config in ruff.toml) over the package, tools and tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    out = subprocess.run([ruff, "check", "hpcrl", "tools", "tests"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv") and "pytest" in line]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if "python -m pytest" in line]
    assert len(commands) == 1 and ci == commands, f"README: {commands}\n.ci/run: {ci}"
    assert "python -m mypy && " in commands[0], "the type check runs before pytest"
