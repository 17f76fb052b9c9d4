"""`hpcrl config show`: the resolved run config as YAML, each key with its doc and default.

    hpcrl config show                                   # every key at its default
    hpcrl config show experiments/quickstart.yaml       # the config a run of this file would use
    hpcrl config show experiments/quickstart.yaml train.lr=1e-4 --diff   # only what differs from the defaults

The output is YAML (docs and defaults are comments), so it can be saved and run as a config. Keys and docs come
from the config dataclasses through hpcrl/config_doc.py, the same walk that writes docs/reference/config.md.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hpcrl.config_doc import REQUIRED, KeyDoc, format_value, iter_keys

WIDTH = 120
_OVERRIDE = re.compile(r"[A-Za-z_][\w.-]*=")
_MISSING = object()


def resolved_values(config: str | None, overrides: list[str]) -> dict[str, Any]:
    """The plain data of the run config `config` + `overrides` (no file: the defaults + overrides)."""
    from hpcrl.config import apply_overrides, from_dict, load_yaml, to_dict
    from hpcrl.run_config import RunConfig

    data = load_yaml(config) if config is not None else {}
    data = apply_overrides(data, overrides, cls=RunConfig)
    placeholder = config is None and "path" not in data.get("model", {})
    if placeholder:
        # model.path has no default; without a file the rest can still be shown, with it marked required.
        data = {**data, "model": {**data.get("model", {}), "path": ""}}
    values = to_dict(from_dict(RunConfig, data))
    if placeholder:
        values["model"]["path"] = _MISSING
    return values


def _lookup(values: Mapping[str, Any], path: str) -> Any:
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _filled_default(values: Mapping[str, Any], path: str) -> str | None:
    """What a train key that defaults to null or `auto` is filled with under the config's train.loss
    (train.aggregation, train.normalize_advantage_std) or its device (train.torch_compile,
    train.logprob_chunk_tokens, train.micro_batch_size): an unchanged default, though the loaded config names its
    value."""
    section, _, name = path.partition(".")
    if section != "train" or "." in name:
        return None
    from hpcrl.trainer.config import TrainConfig

    context = {key: _lookup(values, f"train.{key}") for key in ("loss", "device", "backend", "logprobs")}
    try:
        filled = getattr(TrainConfig(**context), name)
    except (TypeError, ValueError, AttributeError):
        return None
    return _text(filled)


def _text(value: Any) -> str:
    return REQUIRED if value is _MISSING else format_value(value)


def _comment(text: str, indent: str) -> list[str]:
    width = max(40, WIDTH - len(indent) - 2)
    return [f"{indent}# {line}" for line in textwrap.wrap(text, width)] if text else []


def render(values: Mapping[str, Any], *, diff: bool = False, docs: bool = True) -> str:
    """The YAML text: every key (only those differing from the default with `diff`), its doc above it as a
    comment, its default beside it where the value differs."""
    keys = list(_visible(list(iter_keys(_run_config())), values))
    # A key differs by its value; an optional section by being there or not (null).
    changed = {
        k.path
        for k in keys
        if (not k.is_section or k.type != "section")
        and _text(_lookup(values, k.path)) not in (k.default, _filled_default(values, k.path))
    }
    lines: list[str] = []
    for key in keys:
        if diff and not any(path == key.path or path.startswith(f"{key.path}.") for path in changed):
            continue
        depth = key.path.count(".")
        indent = "  " * depth
        name = key.path.rsplit(".", 1)[-1]
        value = _lookup(values, key.path)
        if docs:
            if depth == 0 and lines:
                lines.append("")
            lines += _comment(key.doc, indent)
        if key.is_section and value is not None:
            lines.append(f"{indent}{name}:")
            continue
        if value is _MISSING:
            lines.append(f"{indent}{name}:  # required: set it in the config or as {key.path}=...")
            continue
        note = f"  # default: {key.default}" if key.path in changed else ""
        lines.append(f"{indent}{name}: {_text(value)}{note}")
    return "\n".join(lines) + "\n"


def _visible(keys: list[KeyDoc], values: Mapping[str, Any]) -> Iterator[KeyDoc]:
    """The keys to print: those under an absent (null) optional section are left out."""
    absent: list[str] = []
    for key in keys:
        if any(key.path.startswith(f"{prefix}.") for prefix in absent):
            continue
        if key.is_section and _lookup(values, key.path) is None:
            absent.append(key.path)
        yield key


def _run_config() -> type:
    from hpcrl.run_config import RunConfig

    return RunConfig


def _show(ns: argparse.Namespace) -> int:
    config, overrides = ns.config, list(ns.overrides)
    if config is not None and _OVERRIDE.match(config) and not Path(config).exists():
        config, overrides = None, [config, *overrides]  # `hpcrl config show train.lr=1e-4`: no file
    values = resolved_values(config, overrides)
    text = render(values, diff=ns.diff, docs=not ns.no_docs)
    if ns.diff and not text.strip():
        print("# every key is at its default", file=sys.stderr)
    sys.stdout.write(text)
    return 0


def add_config_commands(sub: argparse._SubParsersAction) -> None:
    """Register `config show` on the hpcrl CLI."""
    config = sub.add_parser("config", help="config utilities").add_subparsers(dest="config_cmd", required=True)
    p = config.add_parser(
        "show",
        help="print the resolved run config with each key's doc and default (--diff: only what differs)",
        description="Print the run config that `hpcrl run CONFIG [key=value ...]` would use, as YAML: each key's "
        "doc above it as a comment, its default beside it where the value differs. Without CONFIG: the defaults. "
        "The output is a valid config file.",
        epilog="example: hpcrl config show experiments/quickstart.yaml train.lr=1e-4 --diff",
    )
    p.add_argument("config", nargs="?", default=None, help="YAML run config (default: none, show the defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 num_steps=10")
    p.add_argument("--diff", action="store_true", help="only the keys whose value differs from the default")
    p.add_argument("--no-docs", action="store_true", help="leave out the doc comments")
    p.set_defaults(func=_show)
    ref = config.add_parser(
        "reference",
        help="print the configuration reference (every key's type, default and doc) as Markdown",
        description="Print docs/reference/config.md as the code defines it: one table per section.",
        epilog="example: hpcrl config reference > docs/reference/config.md",
    )
    ref.set_defaults(func=_reference)


def _reference(args: argparse.Namespace) -> int:
    from hpcrl.config_doc import render_markdown
    from hpcrl.run_config import RunConfig

    sys.stdout.write(render_markdown(RunConfig))
    return 0
