"""`hpcrl engine serve`'s engine settings: `--config FILE` and one flag for each key, made from `EngineConfig`.

The engine section is declared once (`hpcrl/engine/config.py`); this module turns each key an engine process reads
(`EngineConfig.SERVE_KEYS`, and every `engine.kernels` knob as `--kernels-<knob>`) into a flag whose help is the
key's docstring, then builds the one `EngineConfig` from the file's section with the given flags set over it, so
its checks run once, whichever way a setting came in. Light to import: `hpcrl --help` reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, Literal

from hpcrl.config import ConfigError, from_dict, load_yaml
from hpcrl.config_doc import field_docs
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.kernels_config import KernelsConfig, parse_value

_DEST = "engine_setting:"  # argparse dest prefix of a generated flag; the rest is the dotted key


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """`--config FILE` and a flag for every engine setting of one engine process (default: the file's, else the
    key's own)."""
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML holding the engine section (the keys of a run config's `engine:`), or a whole run config, whose "
        "`engine:` is read; flags given beside it win",
    )
    group = p.add_argument_group("engine settings (the keys of a run config's engine section)")
    hints = typing.get_type_hints(EngineConfig)
    docs = field_docs(EngineConfig)
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for key in EngineConfig.SERVE_KEYS:
        if key == "kernels":
            continue
        _add_flag(group, key, key, hints[key], docs.get(key, ""), fields[key].default)
    kernel_group = p.add_argument_group(
        "engine.kernels (CUDA kernel launch knobs; HPCRL_ENGINE_<KNOB> or HPCRL_<INVARIANT_KNOB> overrides)"
    )
    kernel_hints = typing.get_type_hints(KernelsConfig)
    kernel_docs = field_docs(KernelsConfig)
    for f in dataclasses.fields(KernelsConfig):
        name = f"kernels_{f.name}"
        _add_flag(kernel_group, name, f"kernels.{f.name}", kernel_hints[f.name], kernel_docs.get(f.name, ""), f.default)


def _add_flag(group: Any, name: str, key: str, tp: Any, doc: str, default: Any) -> None:
    flag = "--" + name.replace("_", "-")
    shown = _yaml_text(default)
    help_text = f"{doc} (engine.{key}; default {shown})".replace("%", "%%")
    kwargs: dict[str, Any] = {"dest": _DEST + key, "default": argparse.SUPPRESS, "help": help_text}
    inner = _without_none(tp)
    if inner is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
    elif typing.get_origin(inner) is Literal:
        group.add_argument(flag, choices=typing.get_args(inner), **kwargs)
    elif inner in (int, float):
        group.add_argument(flag, type=inner, metavar="N", **kwargs)
    elif typing.get_origin(inner) is tuple:
        group.add_argument(flag, metavar="A,B,...", **kwargs)  # parsed with the knob's own check (parse_value)
    else:
        group.add_argument(flag, metavar=name.split("_")[-1].upper(), **kwargs)


def _without_none(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if type(None) in typing.get_args(tp) and len(args) == 1 else tp


def engine_config(ns: argparse.Namespace) -> EngineConfig:
    """The engine section of `--config` (or none) with every given flag set over it, checked once."""
    data: dict[str, Any] = {}
    if ns.config is not None:
        data = _engine_section(load_yaml(ns.config), ns.config)
    given = {dest[len(_DEST) :]: value for dest, value in vars(ns).items() if dest.startswith(_DEST)}
    for key, value in given.items():
        if key.startswith("kernels."):
            knob = key.split(".", 1)[1]
            if isinstance(value, str):
                try:
                    value = parse_value(knob, value)
                except ValueError as exc:
                    raise ConfigError(f"--kernels-{knob.replace('_', '-')} {value}: {exc}") from None
            kernels = data.get("kernels")
            data["kernels"] = {**(kernels if isinstance(kernels, Mapping) else {}), knob: value}
        else:
            data[key] = value
    if data.get("kind", "embedded") != "embedded":
        raise ConfigError(
            f"--config {ns.config}: engine.kind is {data['kind']!r}, but hpcrl engine serve is the embedded engine; "
            "set engine.kind: embedded, or start SGLang itself"
        )
    try:
        return from_dict(EngineConfig, data, path="engine")
    except ConfigError as exc:
        flags = " ".join(f"--{k.replace('.', '-').replace('_', '-')} {_text(v)}" for k, v in given.items())
        source = " and ".join(x for x in (f"--config {ns.config}" if ns.config else "", flags) if x)
        raise ConfigError(f"{exc} (from {source or 'the defaults'})") from None


def _engine_section(data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The engine section of a file: its `engine:` when it is a whole run config (an engine section has no key
    `engine`), else the file itself."""
    section = data.get("engine", data) if isinstance(data, Mapping) else data
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"--config {path}: the engine section must be a mapping of keys, got {section!r}")
    return dict(section)


def _yaml_text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
