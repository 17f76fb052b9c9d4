"""The config reference: keys read from the dataclasses, and docs/reference/config.md kept equal to them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hpcrl.config_doc import REGENERATE, format_type, format_value, iter_keys, render_markdown
from hpcrl.run_config import RunConfig

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"


@dataclass(kw_only=True, frozen=True)
class _Inner:
    """Inner section: what it holds."""

    size: int = 3
    """How many."""


@dataclass(kw_only=True, frozen=True)
class _Outer:
    path: str
    """Where it is."""
    mode: Literal["a", "b"] = "a"
    ratio: float | None = None
    """A ratio,
    over two lines."""
    names: tuple[str, ...] = ("x",)
    inner: _Inner = field(default_factory=_Inner)
    maybe: _Inner | None = None
    """Set to use it."""


def test_keys_carry_type_default_and_attribute_docstring() -> None:
    keys = {k.path: k for k in iter_keys(_Outer)}
    assert list(keys) == ["path", "mode", "ratio", "names", "inner", "inner.size", "maybe", "maybe.size"]
    assert (keys["path"].type, keys["path"].default, keys["path"].doc) == ("str", "required", "Where it is.")
    assert (keys["mode"].type, keys["mode"].default, keys["mode"].doc) == ('"a" | "b"', '"a"', "")
    assert (keys["ratio"].type, keys["ratio"].default) == ("float | null", "null")
    assert keys["ratio"].doc == "A ratio, over two lines."
    assert (keys["names"].type, keys["names"].default) == ("list[str]", '["x"]')
    # A section without a field docstring takes its class's; an optional one says its default.
    assert keys["inner"].is_section and keys["inner"].doc == "Inner section: what it holds."
    maybe = keys["maybe"]
    assert (maybe.type, maybe.default, maybe.doc) == ("section | null", "null", "Set to use it.")
    assert (keys["maybe.size"].type, keys["maybe.size"].default, keys["maybe.size"].doc) == ("int", "3", "How many.")


def test_format_value_is_yaml_text() -> None:
    assert [format_value(v) for v in (None, True, 1e-4, "cpu", [1, 2])] == ["null", "true", "0.0001", '"cpu"', "[1, 2]"]
    assert format_type(dict[str, int]) == "dict[str, int]"


def test_every_run_config_key_is_in_the_reference() -> None:
    assert REFERENCE.exists(), f"docs/reference/config.md is missing; write it with `{REGENERATE}`"
    text = REFERENCE.read_text()
    # A top-level section is a heading; every other key, a table row.
    missing = [k.path for k in iter_keys(RunConfig) if f"| `{k.path}` |" not in text and f"\n## {k.path}\n" not in text]
    assert not missing, f"docs/reference/config.md lacks {missing}; regenerate it with `{REGENERATE}`"


def test_every_run_config_key_has_a_docstring() -> None:
    # A section may be described by its field's docstring or by its class's; a key only by its field's.
    undocumented = [k.path for k in iter_keys(RunConfig) if not k.doc.strip()]
    assert not undocumented, (
        f"config keys without a docstring: {undocumented}; write one under each field (what it does, its unit, "
        f"when to change it), then regenerate the reference with `{REGENERATE}`"
    )


def test_reference_is_current() -> None:
    if REFERENCE.read_text() != render_markdown(RunConfig):
        raise AssertionError(
            "docs/reference/config.md differs from the config dataclasses (a key's type, default or docstring "
            f"changed); regenerate it from the repository root with `{REGENERATE}`"
        )
