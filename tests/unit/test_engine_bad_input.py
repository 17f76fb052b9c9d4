"""What a careless or hostile client sends the engine and the session server: a 400 naming the problem, never a
500, and no request that stalls everyone else. Real engine and session server processes/threads on loopback."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from hpcrl.sessions.config import SessionServerConfig
from hpcrl.sessions.server import SessionServer


def _post_raw(url: str, body: bytes, timeout_s: float = 120.0) -> httpx.Response:
    return httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=timeout_s)


def test_deep_json_and_lone_surrogates_are_400_on_generate(shared_engine: Any) -> None:
    deep = b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = _post_raw(f"{shared_engine.url}/generate", deep)
    assert r.status_code == 400 and "nests JSON too deeply" in r.json()["error"]["message"], r.text
    r = _post_raw(f"{shared_engine.url}/generate", b'{"text": "a\\ud800b", "sampling_params": {"max_new_tokens": 1}}')
    assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]["message"], r.text
    r = httpx.post(
        f"{shared_engine.url}/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "n": 1_000_000}},
        timeout=60,
    )
    assert r.status_code == 400 and "sequences, more than 65536" in r.json()["error"]["message"], r.text
    # The engine still serves.
    r = httpx.post(
        f"{shared_engine.url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_a_huge_text_prompt_does_not_stall_the_engine(shared_engine: Any) -> None:
    """A 5 MB text is tokenized off the event loop: /health and other requests answer meanwhile."""
    text = "hello world " * (5_000_000 // 12)
    answer: dict[str, Any] = {}

    def send() -> None:
        answer["r"] = httpx.post(
            f"{shared_engine.url}/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}}, timeout=300
        )

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.5)  # the body is on its way / being tokenized
    slowest_s = 0.0
    while sender.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{shared_engine.url}/health", timeout=30).status_code == 200
        slowest_s = max(slowest_s, time.monotonic() - t0)
        time.sleep(0.2)
    sender.join()
    print(f"slowest /health while a 5 MB prompt was handled: {slowest_s:.2f} s")
    assert slowest_s < 5.0
    assert answer["r"].status_code == 400  # over the context length: refused, with the count
    assert "context length" in answer["r"].json()["error"]["message"]


def test_deep_json_and_lone_surrogates_are_400_on_chat_completions(shared_engine: Any, tiny_model_dir: Path) -> None:
    cfg = SessionServerConfig(model_family="tiny", model=str(tiny_model_dir), engine_urls=(shared_engine.url,))
    with SessionServer(cfg) as srv:
        sid = httpx.post(f"{srv.url}/sessions", json={}).json()["session_id"]
        chat = f"{srv.url}/sessions/{sid}/v1/chat/completions"
        deep = b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
        r = _post_raw(chat, deep)
        assert r.status_code == 400 and "nests JSON too deeply" in r.json()["error"]["message"], r.text
        r = _post_raw(chat, b'{"messages": [{"role": "user", "content": "hi \\udc80"}], "max_tokens": 1}')
        assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]["message"], r.text
        # A surrogate pair is one character like any other: here U+1F600, which the tiny model's character
        # tokenizer cannot encode, so the 400 names that character (not a lone surrogate).
        r = _post_raw(chat, b'{"messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}], "max_tokens": 1}')
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "U+1F600" in message and "surrogate" not in message, r.text
