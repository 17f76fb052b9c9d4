"""The engine's JSON wire: what a strict peer can parse goes out, what a lenient peer sends comes in."""

from __future__ import annotations

import enum
import gc
import json
import math

import pytest

from hpcrl.engine import jsonwire


def test_non_finite_numbers_go_out_as_null_that_strict_parsers_accept() -> None:
    body = jsonwire.dumps({"output_token_logprobs": [[-math.inf, 7, None], [math.nan, 8, None], [-0.5, 9, None]]})
    parsed = json.loads(body, parse_constant=lambda c: pytest.fail(f"bare {c} on the wire"))
    assert parsed == {"output_token_logprobs": [[None, 7, None], [None, 8, None], [-0.5, 9, None]]}


def test_what_orjson_refuses_still_goes_out_through_the_standard_library() -> None:
    class Field(str, enum.Enum):
        ID = "id"

    body = jsonwire.dumps({Field.ID: 2**70, "lp": math.nan})
    assert json.loads(body) == {"id": 2**70, "lp": None}


def test_bare_nan_from_a_lenient_peer_parses_and_garbage_is_a_value_error() -> None:
    assert math.isnan(jsonwire.loads(b'{"lp": NaN}')["lp"])
    with pytest.raises(ValueError):
        jsonwire.loads(b"<html>502 Bad Gateway</html>")


def test_parsing_leaves_the_collector_as_it_found_it() -> None:
    assert gc.isenabled()
    jsonwire.loads(b"[1, 2]")
    with pytest.raises(ValueError):
        jsonwire.loads(b"{")
    assert gc.isenabled()
    gc.disable()
    try:
        jsonwire.loads(b"[1]")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_pause_inside_a_pause_keeps_the_collector_off_until_the_outer_one_ends() -> None:
    assert gc.isenabled()
    with jsonwire.gc_paused():
        with jsonwire.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_answer_tuples_go_out_as_arrays_with_non_finite_log_probs_as_null() -> None:
    body = jsonwire.dumps({"output_token_logprobs": [(-0.5, 9, None), (math.nan, 8, "a")]})
    assert json.loads(body) == {"output_token_logprobs": [[-0.5, 9, None], [None, 8, "a"]]}


def test_a_pause_that_begins_inside_another_threads_pause_leaves_the_collector_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The interleaving that switched the collector off for good: B checks the collector while A's pause holds
    # it off, A's pause ends (on again), then B switches it off and, having found it off, never back on.
    import threading

    a_inside, a_may_end, a_ended = threading.Event(), threading.Event(), threading.Event()
    real_isenabled, real_disable = gc.isenabled, gc.disable

    def isenabled() -> bool:
        found = real_isenabled()
        if threading.current_thread().name == "B":
            a_may_end.set()
        return found

    def disable() -> None:
        if threading.current_thread().name == "B":
            a_ended.wait(timeout=2)
        real_disable()

    monkeypatch.setattr(gc, "isenabled", isenabled)
    monkeypatch.setattr(gc, "disable", disable)

    def a() -> None:
        with jsonwire.gc_paused():
            a_inside.set()
            a_may_end.wait(timeout=2)
        a_ended.set()

    def b() -> None:
        a_inside.wait(timeout=2)
        with jsonwire.gc_paused():
            a_may_end.set()

    threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    try:
        assert gc.isenabled()
    finally:
        gc.enable()
