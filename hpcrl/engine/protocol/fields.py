"""Field checks shared by every request and answer type, and `Message`, the base of a request body.

Every error is a `ValueError` whose message names the field, the allowed values and what was received: the embedded
server returns it verbatim as HTTP 400.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, cast

from hpcrl.engine.contract import Endpoint

# --------------------------------------------------------------------------------------------------------------
# Validation helpers. JSON has no int/bool distinction problem but Python does: True is an int, so every
# integer check excludes bool explicitly.


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float))) and not isinstance(value, bool)


def _int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    number = cast(int, value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}")
    return number


def _float(name: str, value: object) -> float:
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    number = float(cast(float, value))
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}")
    return number


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def _str(name: str, value: object, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r} ({type(value).__name__})")
    if not allow_empty and not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _optional_str(name: str, value: object) -> str | None:
    return None if value is None else _str(name, value)


def _list(name: str, value: object) -> list[Any]:
    # A str is a Sequence too; accepting it would silently split "abc" into characters.
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list, got {value!r} ({type(value).__name__})")
    return list(value)


def _all_of_type(values: list[Any], kinds: set[type]) -> bool:
    """Every value's type is one of `kinds` exactly (so bool is no int), checked at C speed: answers carry lists of
    ~10^5 numbers, and a Python-level check per element costs about a microsecond each."""
    return set(map(type, values)) <= kinds


def _token_ids(name: str, value: object, *, allow_empty: bool) -> list[int]:
    ids = _list(name, value)
    if not allow_empty and not ids:
        raise ValueError(f"{name} is empty; a prompt needs at least one token id")
    if _all_of_type(ids, {int}) and (not ids or min(ids) >= 0):
        return ids
    for index, token in enumerate(ids):
        if not _is_int(token) or token < 0:
            raise ValueError(f"{name}[{index}] must be a non-negative integer token id, got {token!r}")
    return ids


def _mapping(name: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {value!r} ({type(value).__name__})")
    return value


def _reject_unknown_keys(what: str, data: Mapping[str, Any], valid: Sequence[str]) -> None:
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {what}; valid keys: {sorted(valid)}")


def _is_default(value: object, default: object) -> bool:
    # SGLang treats null as "use the default"; empty containers carry no request either.
    if value is None or value == default:
        return True
    return isinstance(value, (Mapping, list, tuple, str)) and len(value) == 0 and default is None


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _simple_from_dict(cls: type, what: str, data: object, *, missing: Mapping[str, Any] | None = None) -> Any:
    body = _mapping(what, data)
    names = _field_names(cls)
    _reject_unknown_keys(what, body, names)
    kwargs = dict(missing or {})
    kwargs.update(body)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        # A missing required key surfaces as TypeError from the dataclass __init__.
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        raise ValueError(f"{what} is missing required key(s); required: {required} ({exc})") from exc


# --------------------------------------------------------------------------------------------------------------
# Request bodies

_M = TypeVar("_M", bound="Message")


def _jsonable(value: Any) -> Any:
    # Tuples keep the dataclasses immutable; JSON wants lists.
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    return value


@dataclass(frozen=True, kw_only=True)
class Message:
    """A request body of one endpoint.

    `missing` holds SGLang's server defaults where they differ from hpcrl's dataclass defaults: `from_dict` applies
    them to an absent key so that the embedded server behaves like SGLang. `body_optional` types accept an empty
    or null body as all-defaults (older servers took none).
    """

    endpoint: ClassVar[Endpoint]
    missing: ClassVar[Mapping[str, Any]] = {}
    body_optional: ClassVar[bool] = False

    @classmethod
    def from_dict(cls: type[_M], data: object) -> _M:
        what = f"the {cls.endpoint.path} body"
        body = (data or {}) if cls.body_optional else data
        return cast(_M, _simple_from_dict(cls, what, body, missing=cls.missing))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
