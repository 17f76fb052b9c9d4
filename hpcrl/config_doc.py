"""Every config key of a run, with its type, default and docstring, read from the config dataclasses.

A key's doc is the string literal written under its field (an attribute docstring), read from the source with
`ast`, so the dataclasses stay the one place a key is described. `iter_keys(RunConfig)` walks the nested
sections in declaration order; `render_markdown` writes docs/reference/config.md:

    hpcrl config reference > docs/reference/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union

__all__ = ["REGENERATE", "KeyDoc", "format_type", "format_value", "iter_keys", "render_markdown"]

REGENERATE = "hpcrl config reference > docs/reference/config.md"
REQUIRED = "required"


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyDoc:
    path: str
    """Dotted key, as an override writes it (`train.lr`)."""
    type: str
    """The accepted values, in YAML terms (`int`, `"torch" | "megatron"`, `float | null`); `section` for a
    nested mapping."""
    default: str
    """The default as YAML text (`null`, `true`, `"cpu"`), or `required`; empty for a section."""
    doc: str
    """The attribute docstring, whitespace collapsed; empty when the field has none."""
    is_section: bool = False


def iter_keys(cls: type, prefix: str = "") -> Iterator[KeyDoc]:
    """Every key of dataclass `cls`, a section's row before its keys, in declaration order.

    A section is a nested dataclass field (`Section` or `Section | None`); its doc is the field's docstring,
    else the section class's own docstring."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        section = _section_of(tp)
        default = _default_of(f)
        if section is not None:
            optional = section is not tp
            doc = docs.get(f.name) or _class_doc(section)
            yield KeyDoc(
                path=path,
                type="section | null" if optional else "section",
                default=format_value(default) if optional and not dataclasses.is_dataclass(default) else "",
                doc=doc,
                is_section=True,
            )
            yield from iter_keys(section, prefix=f"{path}.")
            continue
        yield KeyDoc(path=path, type=format_type(tp), default=format_value(default), doc=docs.get(f.name, ""))


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of `cls` and its dataclass bases (a subclass's doc wins), whitespace collapsed."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.ClassDef):
        return {}
    docs: dict[str, str] = {}
    body = node.body
    for stmt, following in zip(body, body[1:], strict=False):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[stmt.target.id] = _one_line(following.value.value)
    return docs


def _class_doc(klass: type) -> str:
    doc = klass.__doc__ or ""
    # dataclass() writes a signature as the docstring of a class that has none: that is no description.
    if not doc or doc.startswith(f"{klass.__name__}("):
        return ""
    return _one_line(inspect.cleandoc(doc).split("\n\n")[0])


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _section_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]) and isinstance(args[0], type):
            return args[0]
    return None


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def format_type(tp: Any) -> str:
    """A field type in YAML terms: `int`, `"a" | "b"`, `float | null`, `list[str]`, `dict[str, int]`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is Literal:
        return " | ".join(format_value(arg) for arg in args)
    if origin in (Union, types.UnionType):
        parts = [format_type(arg) for arg in args if arg is not type(None)]
        return " | ".join(parts + (["null"] if type(None) in args else []))
    if origin in (list, tuple):
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return f"list[{', '.join(format_type(arg) for arg in args)}]"
        return f"list[{format_type(args[0])}]" if args else "list"
    if origin is dict:
        return f"dict[{format_type(args[0])}, {format_type(args[1])}]" if args else "dict"
    if tp is Path:
        return "path"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


def format_value(value: Any) -> str:
    """A value as YAML text in one line: `null`, `true`, `3`, `0.0001`, `"cpu"`, `[1, 2]`; `required` if unset."""
    if value is dataclasses.MISSING:
        return REQUIRED
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.dumps(_plain(value), ensure_ascii=False)


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


def render_markdown(cls: type) -> str:
    """docs/reference/config.md for the run config class `cls`: one table per top-level section, the top-level keys
    first. (The class is passed in: this module sits below the configs it documents.)"""
    keys = list(iter_keys(cls))
    lines = [
        "# Configuration reference",
        "",
        "Every key of a run config, generated from the config dataclasses (each defined next to its component) by",
        f"`{REGENERATE}`; a unit test fails when this page and the code disagree.",
        "",
        "A run config is a YAML file of these keys; any key can be overridden on the command line as `key=value`",
        "(`hpcrl run experiments/quickstart.yaml train.lr=3e-5 rollout.n_samples_per_prompt=8`). Values are YAML 1.2:",
        "`1e-4` is a float, only `true`/`false` are booleans, `null` means unset. An unknown key is an error that",
        "lists the valid keys. A key marked *required* has no default.",
        "",
        "Sections: " + ", ".join(f"[`{k.path}`](#{k.path})" for k in keys if k.is_section and "." not in k.path),
        "",
    ]
    top = [k for k in keys if "." not in k.path and not k.is_section]
    lines += ["## Top level", "", *_table(top)]
    for section in (k for k in keys if k.is_section and "." not in k.path):
        rows = [k for k in keys if k.path.startswith(f"{section.path}.")]
        lines += ["", f"## {section.path}", ""]
        if section.doc:
            lines += [section.doc, ""]
        if section.type != "section":
            lines += [f"Optional section, default `{section.default}`.", ""]
        lines += _table(rows)
    return "\n".join(lines) + "\n"


def _table(rows: list[KeyDoc]) -> list[str]:
    out = ["| key | type | default | description |", "|---|---|---|---|"]
    for k in rows:
        default = "*required*" if k.default == REQUIRED else (f"`{_cell(k.default)}`" if k.default else "")
        out.append(f"| `{k.path}` | `{_cell(k.type)}` | {default} | {_cell(k.doc)} |")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
