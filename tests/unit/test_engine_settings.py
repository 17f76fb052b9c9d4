"""engine.decode_* settings reach the embedded engine process and change what it runs; one max_running_requests."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx
import pytest

from hpcrl.cli import build_parser
from hpcrl.config import ConfigError, from_dict
from hpcrl.engine.config import DEFAULT_MAX_RUNNING_REQUESTS, EngineConfig
from hpcrl.engine.embedded.scheduler import SchedulerConfig
from hpcrl.engine.embedded.server import ServerConfig
from hpcrl.engine.local import LocalEngines
from tests.conftest import start_engine


def _engine_state(cfg: EngineConfig, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    engines = LocalEngines(cfg, model_dir, run_dir, seed=0)
    try:
        (client,) = engines.start()
        state: dict[str, Any] = client.server_info()["internal_states"][0]
        return state
    finally:
        engines.stop()


def test_decode_settings_reach_the_engine_and_change_its_decode_path(tiny_model_dir: Path, tmp_path: Path) -> None:
    default = _engine_state(EngineConfig(), tiny_model_dir, tmp_path / "default")
    assert default["decode_path"] == "eager"  # auto on CPU
    assert default["profile"] is None

    tuned = EngineConfig(decode_mode="compile", decode_overlap="on", decode_profile=True)
    state = _engine_state(tuned, tiny_model_dir, tmp_path / "tuned")
    assert state["decode_path"] == "cpu_compiled"
    assert state["profile"] is not None and state["profile"]["overlap"] is True
    assert state["profile"]["decode_steps"] == 0


def test_decode_settings_apply_to_the_embedded_engine_only() -> None:
    with pytest.raises(ConfigError, match="apply to kind: embedded only"):
        from_dict(EngineConfig, {"kind": "sglang", "decode_mode": "eager"})
    with pytest.raises(ConfigError, match="expected one of 'auto', 'eager', 'triton', 'graph', 'compile'"):
        from_dict(EngineConfig, {"decode_mode": "fast"})


def _profile(url: str) -> Any:
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]["profile"]


def test_deprecated_environment_switch_still_works_and_a_flag_wins(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPCRL_ENGINE_PROFILE", "1")
    env_only = start_engine(tiny_model_dir, tmp_path)
    try:
        assert _profile(env_only.url) is not None
        assert "HPCRL_ENGINE_PROFILE is deprecated" in env_only.log() and "--decode-profile" in env_only.log()
    finally:
        env_only.stop()
    flag = start_engine(tiny_model_dir, tmp_path, "--no-decode-profile")
    try:
        assert _profile(flag.url) is None
        assert "HPCRL_ENGINE_PROFILE=1 is ignored: --decode-profile off was given" in flag.log()
    finally:
        flag.stop()


def test_max_running_requests_has_one_default() -> None:
    serve = build_parser().parse_args(["engine", "serve", "--model", "m"])
    assert isinstance(serve, argparse.Namespace)
    defaults = {
        "engine.max_running_requests": EngineConfig().max_running_requests,
        "hpcrl engine serve --max-running-requests": serve.max_running_requests,
        "ServerConfig": ServerConfig(model="m").max_running_requests,
        "SchedulerConfig": SchedulerConfig().max_running_requests,
    }
    assert defaults == dict.fromkeys(defaults, DEFAULT_MAX_RUNNING_REQUESTS)
