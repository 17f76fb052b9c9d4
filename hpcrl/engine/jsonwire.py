"""JSON on the engine's wire: orjson, with the garbage collector kept out of large answers.

A batch /generate answer of 256 sequences x 512 tokens with log-probs is 131k [logprob, id, text] lists, about
5 MB. Built or parsed with the standard library inside a process that has torch loaded (~500k tracked objects), it
took 0.8 s of a 6 s pass (CPU): most of it cyclic garbage collections that the new lists set
off, each scanning the whole heap. orjson writes and parses several times faster, and a parse creates no
reference cycles, so pausing the collector during it loses nothing.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import threading
from collections.abc import Iterator
from typing import Any

import orjson


def dumps(obj: Any) -> bytes:
    """UTF-8 JSON; NaN and infinities become null (JSON has neither; bare NaN breaks strict parsers)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        # What orjson refuses and the standard library takes: str-subclass keys, integers past 64 bits.
        return json.dumps(_finite_or_null(obj), allow_nan=False).encode()


def _finite_or_null(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite_or_null(v) for v in obj]
    return obj


_pause_lock = threading.Lock()
_pause_depth = 0  # pauses in progress, over all threads
_pause_restore = False  # whether the first of them found the collector on


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: for building or parsing large acyclic answers (lists, dicts, tuples).

    Pauses may overlap across threads (the engine client parses answers in a thread pool): the collector comes
    back on when the last pause ends, if it was on when the first began. A check-then-disable per pause would
    leave it off for good when one thread's pause began inside another's."""
    global _pause_depth, _pause_restore
    with _pause_lock:
        if _pause_depth == 0:
            _pause_restore = gc.isenabled()
            gc.disable()
        _pause_depth += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pause_depth -= 1
            if _pause_depth == 0 and _pause_restore:
                gc.enable()


def loads(data: bytes | str) -> Any:
    """Parse JSON; raises ValueError (json.JSONDecodeError) on a malformed body."""
    with gc_paused():
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            # orjson refuses the bare NaN/Infinity that Python's json writes; some peers send them.
            return json.loads(data)
