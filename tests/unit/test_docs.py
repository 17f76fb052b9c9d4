"""The manual reads as a manual: its links resolve, and nothing in the product narrates how it was made."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MANUAL = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "benchmarks").glob("*.md"))]
# Markdown links and the repository paths the pages name in prose or code spans.
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PATH = re.compile(r"(?<![\w/.-])((?:docs|benchmarks|tools|experiments|tests)/[\w./-]+\.(?:md|py|sh|yaml))")
# What a lab notebook says and a manual does not.
NOTEBOOK = re.compile(r"\bsessions? \d+|\bissues? #\d+|DESIGN\.md|\.\./shared", re.IGNORECASE)


def test_every_link_and_named_path_exists() -> None:
    missing = []
    for page in MANUAL:
        text = page.read_text()
        for target in LINK.findall(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(REPO)}: link {target}")
        for path in PATH.findall(text):
            path = path.rstrip(".")
            if not ((REPO / path).exists() or (page.parent / path).exists()):
                missing.append(f"{page.relative_to(REPO)}: {path}")
    assert not missing, "pages name files that do not exist:\n" + "\n".join(missing)


def test_no_page_comment_or_tool_narrates_its_history() -> None:
    found = []
    roots = [REPO / "hpcrl", REPO / "tools", REPO / "tests", REPO / "experiments"]
    files = [p for root in roots for p in root.rglob("*") if p.suffix in {".py", ".sh", ".yaml", ".md"}]
    for path in [*MANUAL, *files]:
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if NOTEBOOK.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert not found, (
        "say what the code does and why, not which session or issue made it, and refer only to files in the "
        "repository:\n" + "\n".join(found)
    )
