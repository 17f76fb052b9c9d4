"""The engine section reaches the embedded engine process whole and changes what it runs; `hpcrl engine serve
--config`; engine.kernels' knobs, their environment overrides and their checks; one max_running_requests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from hpcrl.cli import build_parser
from hpcrl.config import ConfigError, from_dict, load_yaml, to_dict
from hpcrl.engine.config import DEFAULT_MAX_RUNNING_REQUESTS, EngineConfig
from hpcrl.engine.embedded.forward import split_k_for
from hpcrl.engine.embedded.scheduler import SchedulerConfig
from hpcrl.engine.embedded.serve_cli import engine_config
from hpcrl.engine.embedded.server_config import ServerConfig
from hpcrl.engine.kernels_config import KernelsConfig, with_env_overrides
from hpcrl.engine.local import LocalEngines
from tests.conftest import start_engine


def _engine_info(cfg: EngineConfig, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    engines = LocalEngines(cfg, model_dir, run_dir, seed=0)
    try:
        (client,) = engines.start()
        info: dict[str, Any] = client.server_info()
        return info
    finally:
        engines.stop()


def test_the_launcher_passes_the_engine_section_whole(tiny_model_dir: Path, tmp_path: Path) -> None:
    default = _engine_info(EngineConfig(), tiny_model_dir, tmp_path / "default")["internal_states"][0]
    assert default["decode_path"] == "eager"  # auto on CPU
    assert default["profile"] is None

    tuned = EngineConfig(
        decode_mode="compile", decode_overlap="on", decode_profile=True, max_running_requests=5,
        max_prefill_tokens=77, deterministic=False, group_timeout_s=9.0,
        kernels=KernelsConfig(gemm="triton", cublas_split_k=(1, 1), attn_config=(32, 4, 2, 2)),
    )  # fmt: skip
    info = _engine_info(tuned, tiny_model_dir, tmp_path / "tuned")
    # The server holds the section as the run config wrote it, every key; the scheduler and the kernels run it.
    assert {k: info[k] for k in to_dict(tuned) if k != "context_length"} == {
        k: v for k, v in to_dict(tuned).items() if k != "context_length"
    }
    state = info["internal_states"][0]
    assert state["decode_path"] == "cpu_compiled"
    assert state["profile"] is not None and state["profile"]["overlap"] is True
    assert state["profile"]["decode_steps"] == 0
    assert (state["max_running_requests"], state["max_prefill_tokens"]) == (5, 77)
    assert state["kernels"] == to_dict(tuned.kernels)
    config_file = tmp_path / "tuned" / "engines" / "engine-0.yaml"
    assert config_file.stat().st_mode & 0o777 == 0o600
    assert from_dict(EngineConfig, load_yaml(config_file)) == tuned


def test_decode_settings_apply_to_the_embedded_engine_only() -> None:
    with pytest.raises(ConfigError, match="apply to kind: embedded only"):
        from_dict(EngineConfig, {"kind": "sglang", "decode_mode": "eager"})
    with pytest.raises(ConfigError, match="expected one of 'auto', 'eager', 'triton', 'graph', 'compile'"):
        from_dict(EngineConfig, {"decode_mode": "fast"})


def _profile(url: str) -> Any:
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]["profile"]


def test_the_old_environment_switches_are_refused_naming_their_key(tmp_path: Path) -> None:
    for var, key in (("HPCRL_ENGINE_PROFILE", "engine.decode_profile"), ("HPCRL_ENGINE_DECODE", "engine.decode_mode")):
        r = _serve("--model", str(tmp_path / "absent"), env={var: "1"})
        assert r.returncode == 2, r.stderr
        assert f"{var} is no longer read: set {key}" in r.stderr, r.stderr


def test_max_running_requests_has_one_default() -> None:
    serve = build_parser().parse_args(["engine", "serve", "--model", "m"])
    defaults = {
        "engine.max_running_requests": EngineConfig().max_running_requests,
        "hpcrl engine serve": engine_config(serve).max_running_requests,
        "ServerConfig": ServerConfig(model="m").engine.max_running_requests,
        "SchedulerConfig": SchedulerConfig(context_length=64).max_running_requests,
    }
    assert defaults == dict.fromkeys(defaults, DEFAULT_MAX_RUNNING_REQUESTS)


def test_engine_serve_takes_a_run_configs_engine_section_and_serves(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_config = tmp_path / "run.yaml"
    run_config.write_text(
        "model:\n  path: somewhere\n"
        "engine:\n  max_running_requests: 3\n  max_prefill_tokens: 40\n  deterministic: false\n"
        "  kernels:\n    prefill: model\n    sample_config: [256, 4, 512, 2]\n"
    )
    eng = start_engine(tiny_model_dir, tmp_path, "--config", str(run_config), "--max-prefill-tokens", "41")
    try:
        out = httpx.post(
            eng.url + "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            timeout=60,
        )
        assert out.status_code == 200, out.text
        assert len(out.json()["output_ids"]) == 4
        info = httpx.get(eng.url + "/server_info", timeout=10).json()
        assert (info["max_running_requests"], info["deterministic"]) == (3, False)
        assert info["max_prefill_tokens"] == 41, "a flag given beside --config wins"
        state = info["internal_states"][0]
        assert (state["max_running_requests"], state["max_prefill_tokens"]) == (3, 41)
        assert state["kernels"]["prefill"] == "model" and state["kernels"]["sample_config"] == [256, 4, 512, 2]
        assert "kernels: sample_config=256,4,512,2 (engine.kernels), prefill=model (engine.kernels)" in eng.log()
    finally:
        eng.stop()


def test_an_unknown_kernel_knob_is_refused_with_the_valid_ones(tmp_path: Path) -> None:
    valid = r"engine.kernels: attn_config, attn_config_kv8, sample_config, gemm, .*, pdl, prefill"
    with pytest.raises(
        ConfigError, match=r"unknown key 'engine.kernels.pld' \(did you mean 'pdl'\?\); valid keys of " + valid
    ):
        from_dict(EngineConfig, {"kernels": {"pld": False}}, path="engine")
    section = tmp_path / "engine.yaml"
    section.write_text("kernels:\n  gemm_tiles: [64, 64]\n")
    r = _serve("--model", str(tmp_path / "absent"), "--config", str(section))
    assert r.returncode == 2, r.stderr
    assert "unknown key 'engine.kernels.gemm_tiles'" in r.stderr and "gemm_config_qkv" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("HPCRL_ENGINE_PDL", "yes", "HPCRL_ENGINE_PDL='yes': expected 1 (on) or 0 (off); unset it"),
        ("HPCRL_ENGINE_GEMM", "cutlass", "HPCRL_ENGINE_GEMM='cutlass': expected one of cublas, triton; unset it"),
        ("HPCRL_ENGINE_PREFILL", "flash", "HPCRL_ENGINE_PREFILL='flash': expected one of auto, fused, model"),
        ("HPCRL_ENGINE_ATTN_CONFIG_KV8", "32,2,3,5", "the 4th value, use_dot, must be 0 (CUDA-core dots), 1"),
        ("HPCRL_ENGINE_SAMPLE_CONFIG", "1024,8,8", "expected exactly 4 comma-separated non-negative integers"),
        ("HPCRL_ENGINE_SAMPLE_CONFIG", "1000,4", "each a power of two, warps at most 32"),
        ("HPCRL_ENGINE_SAMPLE_CONFIG", "512,64", "each a power of two, warps at most 32"),
        ("HPCRL_ENGINE_GEMM_CONFIG_O", "64,48,128,1,4,3", "the blocks must be powers of two >= 16"),
        ("HPCRL_ENGINE_GEMM_CONFIG_QKV", "64,64,64,2,4,4", "SPLIT_K 1 for qkv and gate_up"),
        ("HPCRL_ENGINE_CUBLAS_SPLIT_K", "0,2", "the parts of the o and the down GEMM must be >= 1"),
        ("HPCRL_ENGINE_CUBLAS_SPLIT_K", "two,2", "expected exactly 2 comma-separated non-negative integers"),
        ("HPCRL_ENGINE_ATN_CONFIG", "1", "HPCRL_ENGINE_ATN_CONFIG: no kernel knob is called so; the variables are "),
    ],
)
def test_a_bad_environment_override_is_refused_with_the_variable_and_the_values(
    var: str, value: str, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        with_env_overrides(KernelsConfig(), {var: value})
    assert message in str(err.value) and var in str(err.value)


def test_a_bad_environment_override_stops_engine_serve_before_the_model_loads(tmp_path: Path) -> None:
    r = _serve("--model", str(tmp_path / "absent"), env={"HPCRL_ENGINE_GEMM_CONFIG_DOWN": "64,64"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("hpcrl: error: HPCRL_ENGINE_GEMM_CONFIG_DOWN='64,64': expected exactly 6"), r.stderr
    assert "unset it to use engine.kernels.gemm_config_down" in r.stderr and "Traceback" not in r.stderr


def test_an_environment_override_changes_the_resolved_config_and_is_reported(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolved, overrides = with_env_overrides(
        KernelsConfig(gemm="triton"), {"HPCRL_ENGINE_PDL": "0", "HPCRL_ENGINE_SAMPLE_CONFIG": "256,4", "HOME": "/"}
    )
    assert resolved == KernelsConfig(gemm="triton", pdl=False, sample_config=(256, 4, 1024, 4))
    assert [str(o) for o in overrides] == [
        "pdl=0 (from HPCRL_ENGINE_PDL)",
        "sample_config=256,4 (from HPCRL_ENGINE_SAMPLE_CONFIG)",
    ]

    monkeypatch.setenv("HPCRL_ENGINE_PDL", "0")
    monkeypatch.setenv("HPCRL_ENGINE_GEMM", "")  # blank: unset
    eng = start_engine(tiny_model_dir, tmp_path, "--kernels-gemm", "triton")
    try:
        info = httpx.get(eng.url + "/server_info", timeout=10).json()
        assert info["kernels"]["pdl"] is False and info["kernels"]["gemm"] == "triton"
        assert info["internal_states"][0]["kernels"]["pdl"] is False, "the kernels read the resolved config"
        assert info["kernel_overrides"] == ["pdl=0 (from HPCRL_ENGINE_PDL)"]
        started = next(line for line in eng.log().splitlines() if "serving on" in line)
        assert "kernels: gemm=triton (engine.kernels), pdl=0 (from HPCRL_ENGINE_PDL)" in started, started
    finally:
        eng.stop()


def test_split_k_must_divide_the_model_when_given_and_falls_back_when_defaulted() -> None:
    qwen = SimpleNamespace(num_heads=16, head_dim=128, intermediate_size=3072)
    odd = SimpleNamespace(num_heads=16, head_dim=128, intermediate_size=3073)
    assert split_k_for(qwen, None) == (2, 2)
    assert split_k_for(odd, None) == (2, 1), "the default that does not divide K falls back to the whole GEMM"
    assert split_k_for(odd, (4, 1)) == (4, 1)
    with pytest.raises(ValueError, match=r"cublas_split_k 2,2: 2 parts do not divide this model's down GEMM, K = 3073"):
        split_k_for(odd, (2, 2))


def test_the_scheduler_launches_its_kernels_with_the_engine_sections_knobs(tiny_model_dir: Path) -> None:
    import torch

    from hpcrl.engine.embedded.kernels import launch
    from hpcrl.engine.embedded.scheduler import Scheduler
    from hpcrl.model.hf import load_model

    before = launch.SETTINGS
    knobs = KernelsConfig(pdl=False, attn_config=(16, 2, 1, 0))
    try:
        Scheduler(
            load_model(tiny_model_dir),
            SchedulerConfig(engine=EngineConfig(max_running_requests=2, kernels=knobs), context_length=32),
            device=torch.device("cpu"),
            dtype=torch.float32,
        )
        assert launch.SETTINGS == knobs
    finally:
        launch.configure(before)


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hpcrl.cli", "engine", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
