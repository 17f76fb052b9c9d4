"""A run's own session server against other local users: a per-run key, and a full server as a clear error.

A real session server on loopback in front of a real embedded engine; real HTTP clients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from hpcrl.sessions.config import SessionServerConfig
from hpcrl.sessions.environment import SessionServerError, load_environment, run_episode
from hpcrl.sessions.server import SessionServer

KEY = "k" * 32


def _cfg(engine_url: str, model_dir: Path, **kw: Any) -> SessionServerConfig:
    return SessionServerConfig(model_family="tiny", model=str(model_dir), engine_urls=(engine_url,), **kw)


def test_a_keyed_session_server_refuses_everyone_without_its_key(shared_engine: Any, tiny_model_dir: Path) -> None:
    with SessionServer(_cfg(shared_engine.url, tiny_model_dir, api_key=KEY, max_sessions=2)) as srv:
        assert httpx.get(f"{srv.url}/health", trust_env=False).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.post(f"{srv.url}/sessions", json={}, headers=headers, trust_env=False)
            assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"], r.text
        # An intruder's attempts opened nothing: the run still has its whole session limit.
        assert srv.service.sessions == {}
        result = run_episode(
            load_environment("calculator"), {"prompt": "2*3?", "answer": 6}, srv.url,
            sampling={"max_tokens": 3, "seed": 0}, api_key=KEY,
        )  # fmt: skip
        assert result.num_turns >= 1 and len(result.sequences) == 1
        with pytest.raises(SessionServerError) as info:
            run_episode(load_environment("calculator"), {"prompt": "2*3?", "answer": 6}, srv.url)
        assert "HTTP 401" in str(info.value)


def test_a_full_session_server_is_a_clear_error_not_an_httpx_traceback(
    shared_engine: Any, tiny_model_dir: Path
) -> None:
    with SessionServer(_cfg(shared_engine.url, tiny_model_dir, max_sessions=1)) as srv:
        assert httpx.post(f"{srv.url}/sessions", json={}, trust_env=False).status_code == 200  # the one slot
        with pytest.raises(SessionServerError) as info:
            run_episode(load_environment("calculator"), {"prompt": "2*3?", "answer": 6}, srv.url)
        message = str(info.value)
        assert f"the session server at {srv.url} refused a new session: HTTP 429" in message
        assert "max_sessions" in message
        assert isinstance(info.value, RuntimeError)  # `hpcrl run` prints it as an hpcrl: error line


def test_sessions_serve_drives_a_keyed_engine_with_a_key_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    import subprocess
    import sys
    import time

    from tests.conftest import free_port, start_engine

    engine = start_engine(tiny_model_dir, tmp_path, "--api-key", KEY, timeout_s=300)
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    cmd = [sys.executable, "-m", "hpcrl.cli", "sessions", "serve", "--engine", engine.url, "--model",
           str(tiny_model_dir), "--family", "tiny", "--port", str(port),
           "--engine-api-key-file", str(key_file)]  # fmt: skip
    key_file.chmod(0o644)
    loose = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert loose.returncode == 2 and f"chmod 600 {key_file}" in loose.stderr, loose.stderr
    key_file.chmod(0o600)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"{url}/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "sessions serve did not come up"
            time.sleep(0.5)
        sid = httpx.post(f"{url}/sessions", json={}, trust_env=False).json()["session_id"]
        r = httpx.post(
            f"{url}/sessions/{sid}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            trust_env=False, timeout=120,
        )  # fmt: skip
        assert r.status_code == 200, r.text  # the engine (which refuses requests without its key) answered
    finally:
        proc.terminate()
        proc.wait(30)
        engine.stop()
