"""Config machinery: YAML files and dotted overrides into nested, frozen, typed dataclasses.

Each component writes its own `@dataclass(kw_only=True, slots=True, frozen=True)` config next to its code;
this module only turns plain data into those dataclasses (and back) with errors that name the dotted
key, the problem and the fix.

YAML dialect: files and override values are read with YAML 1.2 core-schema scalars instead of PyYAML's
YAML 1.1 defaults, because 1.1 surprises users in both directions:
- `lr: 1e-4` is a *string* in YAML 1.1 (it wants `1.0e-4`); here it is the float 0.0001.
- `yes`, `no`, `on`, `off`, `y`, `n` are *booleans* in YAML 1.1; here they are strings, so a bool field
  given `yes` is rejected ("expected bool (true or false)") and a str field given `no` keeps "no".
  Booleans are only true/false (also True/TRUE/False/FALSE).
- `012` is octal and `1:20` is the sexagesimal 80 in YAML 1.1; here `012` is 12 and `1:20` a string.
Integers may use underscores between digits (`1_000_000`). Duplicate keys in a mapping are an error.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "apply_overrides",
    "dump_yaml",
    "from_dict",
    "load_config",
    "load_yaml",
    "to_dict",
]


class ConfigError(ValueError):
    """A user error in a config file, an override or a config value."""


# ---------------------------------------------------------------------------------------------------
# YAML 1.2 core-schema loader


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema bools, ints and floats, rejecting duplicate keys."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        # PyYAML keeps the last of two equal keys silently; in a config that hides an edit.
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    # `<<: *base` keys are meant to be overridden by the explicit keys next to them.
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, Hashable) and key in seen:
                    first_line = seen[key].start_mark.line + 1
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"duplicate key {key!r} (first defined on line {first_line})",
                        key_node.start_mark,
                    )
                if isinstance(key, Hashable):
                    seen[key] = key_node
        return super().construct_mapping(node, deep=deep)  # type: ignore[arg-type]

    def construct_document(self, node: yaml.Node) -> Any:
        # Aliases are shared in the loaded data, but a typed key's conversion (and any message quoting the value)
        # walks them expanded: nine nested anchors ("billion laughs") would hang the load for good.
        if _expanded_size(node) > MAX_YAML_VALUES:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"the document expands through its anchors and aliases (&name / *name) to more than "
                f"{MAX_YAML_VALUES:,} values (the most a config may hold); write the values out instead of "
                "nesting aliases",
                node.start_mark,
            )
        return super().construct_document(node)


MAX_YAML_VALUES = 100_000


def _expanded_size(root: yaml.Node) -> int:
    """How many nodes `root` holds with every alias expanded (a cycle counts as too many); linear in the nodes."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            sizes[key] = min(1 + sum(sizes[id(c)] for c in _children(node)), MAX_YAML_VALUES + 1)
            continue
        if key in sizes:
            continue
        if key in on_path:  # an alias of one of its own ancestors: infinite when expanded
            return MAX_YAML_VALUES + 1
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return []


_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT_RE = re.compile(r"^(?:[-+]?[0-9](?:_?[0-9])*|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_RE = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
# Order matters: resolvers are tried in insertion order and the float pattern also matches integers.
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_RE, list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT_RE, list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _construct_bool(loader: _Loader, node: yaml.ScalarNode) -> bool:
    return str(loader.construct_scalar(node)).lower() == "true"


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    if text.startswith(("0o", "0x")):
        return int(text, 0)
    # Base 10 explicitly: YAML 1.1 (and int(x, 0)) would read a leading zero as octal.
    return int(text.replace("_", ""), 10)


def _construct_float(loader: _Loader, node: yaml.ScalarNode) -> float:
    text = str(loader.construct_scalar(node)).lower()
    if text.endswith(".inf"):
        return -math.inf if text.startswith("-") else math.inf
    if text == ".nan":
        return math.nan
    return float(text)


_Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes every string which YAML 1.1 *or* this loader would read as a non-string.

    Without it, the str "1e-4" is written plain (it is a string in YAML 1.1) and read back as a float.
    """


_Dumper.yaml_implicit_resolvers = {
    first: list(yaml.SafeDumper.yaml_implicit_resolvers.get(first, []))
    + list(_Loader.yaml_implicit_resolvers.get(first, []))
    for first in set(yaml.SafeDumper.yaml_implicit_resolvers) | set(_Loader.yaml_implicit_resolvers)
}


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = "; ".join(part for part in (exc.context, exc.problem) if part)
        raise ConfigError(f"invalid YAML in {source}{where}: {problem}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {source}: {exc}") from exc


# ---------------------------------------------------------------------------------------------------
# Files and overrides


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file whose top level is a mapping."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file not found: {path} (check the path; relative paths start at {Path.cwd()})"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a directory, expected a YAML file: {path}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc}") from None
    data = _parse_yaml(text, str(path))
    if data is None:
        raise ConfigError(f"config file {path} is empty; expected a mapping of sections such as 'train: {{...}}'")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping of keys, got {_describe(data)}")
    return data


_OVERRIDE_FORM = "expected the form a.b.c=value, e.g. train.lr=1e-4"


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str], *, cls: type | None = None) -> dict[str, Any]:
    """Return a copy of `data` with each `a.b.c=value` override set; `data` is left unchanged.

    Values are YAML (`train.lr=1e-4` is a float, `x.tags=[a, b]` a list, `x.name=''` an empty string,
    `x.name=` null). With `cls`, each dotted key is checked against the dataclass fields, so a typo
    fails here with the valid keys even when the key is absent from the YAML file.
    """
    if isinstance(overrides, str):
        raise TypeError(f"overrides must be a sequence of 'key=value' strings, got the single string {overrides!r}")
    result = copy.deepcopy(dict(data))
    for override in overrides:
        key, sep, value_text = override.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"override {override!r} has no '='; {_OVERRIDE_FORM}")
        parts = key.split(".")
        if not key or any(not part for part in parts):
            raise ConfigError(f"override {override!r} has an empty key part; {_OVERRIDE_FORM}")
        if cls is not None:
            _check_key_path(cls, parts, override)
        value = _parse_yaml(value_text, f"the value of override {override!r}")
        _set_path(result, parts, value, override)
    return result


def load_config(cls: type[T], path: str | Path, overrides: Sequence[str] = ()) -> T:
    """Load `path`, apply the `a.b.c=value` overrides and build a `cls` from the result."""
    return from_dict(cls, apply_overrides(load_yaml(path), overrides, cls=cls))


def _set_path(data: dict[str, Any], parts: list[str], value: Any, override: str) -> None:
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            # A section that is absent or null (an optional section left off) is created by the override.
            child = node[part] = {}
        elif not isinstance(child, dict):
            section = ".".join(parts[: depth + 1])
            raise ConfigError(
                f"override {override!r}: cannot set a key inside '{section}', "
                f"which is {_describe(child)}, not a mapping"
            )
        node = child
    node[parts[-1]] = value


def _check_key_path(cls: type, parts: list[str], override: str) -> None:
    current: Any = cls
    for depth, part in enumerate(parts):
        section = ".".join(parts[:depth])
        section_cls = _dataclass_of(current)
        if section_cls is None:
            dict_value_type = _dict_value_type(current)
            if dict_value_type is None:
                raise ConfigError(
                    f"override {override!r}: '{section}' has type {_type_name(current)}, not a section; "
                    f"set it as a whole: {section}=value"
                )
            # Keys of a dict[str, X] are free-form; only the values' type is known.
            current = dict_value_type
            continue
        hints = _field_types(section_cls)
        if part not in hints:
            dotted = ".".join(parts[: depth + 1])
            raise ConfigError(
                f"override {override!r}: {_unknown_key_message(dotted, part, section, section_cls, hints)}"
            )
        current = hints[part]


# ---------------------------------------------------------------------------------------------------
# Dataclasses from and to plain data


def from_dict(cls: type[T], data: Mapping[str, Any], *, path: str = "") -> T:
    """Build the dataclass `cls` (with nested dataclass sections) from plain data, checking every type.

    `path` is the dotted section name used in error messages ("train" makes errors read "train.lr: ...").
    A ValueError from the dataclass's `__post_init__` is re-raised as ConfigError prefixed with `path`.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping of keys, got {_describe(data)}")
    hints = _field_types(cls)
    for key in data:
        if key not in hints:
            dotted = _join(path, str(key))
            raise ConfigError(_unknown_key_message(dotted, str(key), path, cls, hints))
    kwargs: dict[str, Any] = {}
    missing: list[str] = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.name in data:
            kwargs[field.name] = _convert(hints[field.name], data[field.name], _join(path, field.name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            missing.append(f"'{_join(path, field.name)}' ({_type_name(hints[field.name])})")
    if len(missing) == 1:
        raise ConfigError(f"missing required key {missing[0]}; set it in the config")
    if missing:
        raise ConfigError(f"missing required keys {', '.join(missing)}; set them in the config")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{path or cls.__name__}: {exc}") from exc


def to_dict(obj: Any) -> dict[str, Any]:
    """The plain YAML-able data of a config dataclass instance: dicts, lists and scalars, Paths as str."""
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        raise TypeError(f"to_dict needs a dataclass instance, got {type(obj).__name__}")
    plain: dict[str, Any] = _plain(obj)
    return plain


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (list, tuple)):
        return [_plain(item) for item in obj]
    if isinstance(obj, Mapping):
        return {str(key): _plain(value) for key, value in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"to_dict cannot turn {type(obj).__name__} {obj!r} into YAML; config fields must be plain values")


def dump_yaml(obj: Any) -> str:
    """The YAML text of a config dataclass, in field order; `load_yaml` + `from_dict` read it back equal."""
    return yaml.dump(to_dict(obj), Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


# ---------------------------------------------------------------------------------------------------
# Type conversion


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Union or origin is types.UnionType:
        return _convert_union(tp, args, value, path)
    if origin is Literal:
        # Compare types too: True == 1 and 1 == 1.0 must not satisfy Literal[1] or Literal[1.0].
        if any(type(value) is type(choice) and value == choice for choice in args):
            return value
        allowed = ", ".join(repr(choice) for choice in args)
        raise ConfigError(f"{path}: expected one of {allowed}; got {_describe(value)}")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping (section {tp.__name__}), got {_describe(value)}")
        return from_dict(tp, value, path=path)
    if origin in (list, tuple) or tp in (list, tuple):
        return _convert_sequence(tp, origin or tp, args, value, path)
    if origin is dict or tp is dict:
        return _convert_dict(args, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected bool (true or false), got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            # 3e5 is a float in YAML but means the integer 300000.
            return int(value)
        raise ConfigError(f"{path}: expected int, got {_describe(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                # NaN passes every `x > 0` check in __post_init__ (all comparisons are false), and inf
                # turns the first use into NaN: no setting means either, so none is accepted.
                raise ConfigError(f"{path}: expected a finite number, got {value}; set a finite value")
            return float(value)
        raise ConfigError(f"{path}: expected float, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        # YAML reads `version: 1.10` as the float 1.1; quoting is the fix the user needs to hear.
        hint = f"; quote it in YAML to keep it text: '{value}'" if isinstance(value, (bool, int, float)) else ""
        raise ConfigError(f"{path}: expected str, got {_describe(value)}{hint}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(f"{path}: expected a path (str), got {_describe(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected null, got {_describe(value)}")
    raise TypeError(
        f"{path}: config field type {tp!r} is not supported; use bool, int, float, str, Path, Literal, "
        "X | None, list[X], tuple[X, ...], dict[str, X] or a nested dataclass"
    )


def _convert_union(tp: Any, args: tuple[Any, ...], value: Any, path: str) -> Any:
    if value is None and type(None) in args:
        return None
    candidates = [arg for arg in args if arg is not type(None)]
    if len(candidates) == 1:
        # `X | None` is the common case: report X's own, more specific error.
        return _convert(candidates[0], value, path)
    for candidate in candidates:
        try:
            return _convert(candidate, value, path)
        except ConfigError:
            continue
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")


def _convert_sequence(tp: Any, origin: Any, args: tuple[Any, ...], value: Any, path: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list ({_type_name(tp)}), got {_describe(value)}")
    if origin is list:
        item_type = args[0] if args else Any
        return [_convert(item_type, item, f"{path}[{i}]") for i, item in enumerate(value)]
    if not args or (len(args) == 2 and args[1] is Ellipsis):
        item_type = args[0] if args else Any
        return tuple(_convert(item_type, item, f"{path}[{i}]") for i, item in enumerate(value))
    if len(value) != len(args):
        raise ConfigError(f"{path}: expected a list of {len(args)} items ({_type_name(tp)}), got {len(value)} items")
    return tuple(
        _convert(item_type, item, f"{path}[{i}]") for i, (item_type, item) in enumerate(zip(args, value, strict=True))
    )


def _convert_dict(args: tuple[Any, ...], value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {_describe(value)}")
    key_type, value_type = args if args else (Any, Any)
    result: dict[str, Any] = {}
    for key, item in value.items():
        if key_type is str and not isinstance(key, str):
            raise ConfigError(f"{path}: keys must be strings, got {_describe(key)}; quote the key in YAML")
        result[key] = _convert(value_type, item, _join(path, str(key)))
    return result


# ---------------------------------------------------------------------------------------------------
# Helpers


def _field_types(cls: type) -> dict[str, Any]:
    # get_type_hints resolves the string annotations that `from __future__ import annotations` leaves.
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside `tp` when it is a section: `Section` or `Section | None`."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        sections = [arg for arg in typing.get_args(tp) if dataclasses.is_dataclass(arg) and isinstance(arg, type)]
        others = [arg for arg in typing.get_args(tp) if arg is not type(None) and arg not in sections]
        if len(sections) == 1 and not others:
            return sections[0]
    return None


def _dict_value_type(tp: Any) -> Any | None:
    if typing.get_origin(tp) in (Union, types.UnionType):
        non_none = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        tp = non_none[0] if len(non_none) == 1 else tp
    if typing.get_origin(tp) is dict:
        args = typing.get_args(tp)
        return args[1] if args else Any
    if tp is dict:
        return Any
    return None


def _unknown_key_message(dotted: str, key: str, section: str, cls: type, hints: Mapping[str, Any]) -> str:
    valid = list(hints)
    # A section lists the keys it renamed (`RENAMED_KEYS = {"old": "new: value"}`): an old config hears the new one.
    renamed: Mapping[str, str] = getattr(cls, "RENAMED_KEYS", {})
    if key in renamed:
        return f"{dotted} was renamed: use {_join(section, renamed[key])}"
    # A section lists the keys it dropped (`REMOVED_KEYS = {"key": "why"}`): an old config then hears why.
    removed: Mapping[str, str] = getattr(cls, "REMOVED_KEYS", {})
    if key in removed:
        where = section or cls.__name__
        return f"unknown key '{dotted}': it was removed ({removed[key]}); delete it. Valid keys of {where}: " + (
            ", ".join(valid)
        )
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    where = section or cls.__name__
    return f"unknown key '{dotted}'{hint}; valid keys of {where}: {', '.join(valid)}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return repr(tp).replace("typing.", "").replace("pathlib.", "")
