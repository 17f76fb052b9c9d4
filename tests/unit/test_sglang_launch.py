"""Start-up of a stock SGLang server as a state, and hpcrl's weight payload for it.

The launcher is run for real, on a stand-in `sglang.launch_server` process (tests/stand_ins/) that keeps
its port silent the way SGLang does for minutes. The payload is checked by unpickling it under the rule
SGLang's own receiver applies (`SafeUnpickler` in sglang/srt/utils/common.py: classes only from an
allowlist of module prefixes); the H200 run in docs/sglang.md pushes it into a real server.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.local import EngineStartError, LocalEngines, signal_group
from hpcrl.sync.tensor_handover import tensor_update_request

STAND_INS = Path(__file__).resolve().parents[1] / "stand_ins"

# The module prefixes SGLang 0.5.16's SafeUnpickler lets a payload load classes from (the ones a weight
# payload can need); anything else makes the server's scheduler raise and the whole server exit.
SGLANG_ALLOWED_PREFIXES = (
    "builtins.", "collections.", "copyreg.", "types.", "torch.", "multiprocessing.resource_sharer.",
)  # fmt: skip
SGLANG_DENIED = {("types", "FunctionType"), ("types", "CodeType"), ("builtins", "eval"), ("builtins", "exec")}


class SglangRule(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) in SGLANG_DENIED or not (module + ".").startswith(SGLANG_ALLOWED_PREFIXES):
            raise pickle.UnpicklingError(f"SGLang would refuse {module}.{name}")
        return super().find_class(module, name)


def test_sglang_payload_is_one_flat_bucket_sglang_can_unpickle_and_rebuild() -> None:
    named = [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 4)),
        ("model.norm.weight", torch.randn(4)),
        ("model.embed_tokens.weight", torch.randn(5, 4).to(torch.bfloat16)),
    ]
    with tensor_update_request(named, engine_kind="sglang", tp_size=2) as request:
        body = request.to_dict()
        assert body["load_format"] == "flattened_bucket"
        assert len(body["serialized_named_tensors"]) == 2  # one per TP rank
        obj = SglangRule(io.BytesIO(base64.b64decode(body["serialized_named_tensors"][0]))).load()
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    # What SGLang's _update_weights_from_flattened_bucket reads of each entry, and how it rebuilds.
    rebuilt = [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]
    assert [n for n, _ in rebuilt] == [n for n, _ in named]
    for (_, got), (_, want) in zip(rebuilt, named, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(m.numel == m.end_idx - m.start_idx for m in metadata)


def test_embedded_payload_stays_free_of_pickle() -> None:
    named = [("w", torch.randn(3))]
    with tensor_update_request(named, engine_kind="embedded") as request:
        raw = base64.b64decode(request.serialized_named_tensors[0])
    assert json.loads(raw)["kind"] == "shm"  # JSON: the embedded engine never unpickles request data


def _launcher(tmp_path: Path, cfg: EngineConfig, messages: list[str], **env: str) -> LocalEngines:
    engines = LocalEngines(cfg, tmp_path / "model", tmp_path / "run", seed=0, say=messages.append)
    engines.extra_env = {"PYTHONPATH": f"{STAND_INS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    return engines


def test_a_slow_sglang_start_is_starting_not_hung(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hpcrl.engine.local.PROGRESS_EVERY_S", 1.0)
    cfg = EngineConfig(kind="sglang", device="cuda", hung_after_s=1.0, health_timeout_s=0.5)
    assert cfg.start_timeout_s == 600.0  # the kind's own bound: SGLang takes minutes
    messages: list[str] = []
    record = tmp_path / "standin.json"
    engines = _launcher(tmp_path, cfg, messages, STANDIN_SILENT_S="3.5", STANDIN_RECORD=str(record))
    try:
        [client] = engines.start()  # silent for 3.5 s, over three times hung_after_s
        assert client.health()
    finally:
        engines.stop()
    starting = [m for m in messages if "starting:" in m]
    assert len(starting) >= 2 and all(m.startswith("sglang engine engine-0 starting") for m in starting)
    assert any("is up after" in m for m in messages)
    launched = json.loads(record.read_text())
    # /health must not generate: the fleet probes it while the KV cache is released (docs/sglang.md).
    assert launched["env"]["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    assert "--skip-server-warmup" in launched["argv"]


def test_a_start_past_its_timeout_names_the_kind_the_setting_and_the_log(tmp_path: Path) -> None:
    cfg = EngineConfig(kind="sglang", device="cuda", startup_timeout_s=1.5)
    engines = _launcher(tmp_path, cfg, [], STANDIN_SILENT_S="30")
    with pytest.raises(EngineStartError) as err:
        engines.start()
    message = str(err.value)
    assert "sglang engine engine-0 did not answer /health within 2 s" in message
    assert "engine.startup_timeout_s" in message and "stand-in sglang: loading" in message
    assert not engines.engines  # nothing left running


def test_an_engine_that_exits_while_starting_reports_its_code_and_log(tmp_path: Path) -> None:
    cfg = EngineConfig(kind="sglang", device="cuda")
    engines = _launcher(tmp_path, cfg, [], STANDIN_EXIT_CODE="3")
    with pytest.raises(EngineStartError, match=r"sglang engine engine-0 exited with code 3 while starting") as err:
        engines.start()
    assert "failing as asked" in str(err.value)


def test_sglang_missing_on_the_engine_node_names_the_install(tmp_path: Path) -> None:
    cfg = EngineConfig(kind="sglang", device="cuda")
    engines = LocalEngines(cfg, tmp_path / "model", tmp_path / "run", seed=0, say=lambda _: None)
    engines.extra_env = {"PYTHONPATH": str(tmp_path / "empty")}  # no sglang importable (nor the stand-in)
    with pytest.raises(EngineStartError) as err:
        engines.start()
    message = str(err.value)
    assert "sglang is not installed for" in message and "pip install 'hpcrl[sglang]'" in message
    assert "engine.kind=embedded" in message


def test_killing_an_engine_whose_process_another_thread_reaped_is_not_an_error() -> None:
    # The fleet's monitor thread polls the same Popen as the restart does; when it reaps the exited server
    # first, the process group is gone by the time the restart kills it (H200: SGLang's scheduler SIGKILLed
    # mid-push, the run died with ProcessLookupError instead of restarting the engine).
    proc = subprocess.Popen(["true"], start_new_session=True)
    os.waitpid(proc.pid, 0)  # reaped behind Popen's back, as by the other thread
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what the restart used to do
    signal_group(proc, signal.SIGKILL)
    assert proc.wait(timeout=5) == 0  # Popen learns the process is gone and the restart goes on
