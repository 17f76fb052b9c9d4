"""tools/gpu/record_sglang.py without SGLang: its server handling with stand-in processes, its file format, and a
real run of a few cases against the embedded engine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu" / "record_sglang.py"


@pytest.fixture(scope="module")
def recorder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("record_sglang", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["record_sglang"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_a_server_that_exits_during_startup_is_reported_with_its_log(recorder: ModuleType, tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "print('CUDA error: no device'); raise SystemExit(3)"]
    server = recorder.Server(cmd, f"http://127.0.0.1:{free_port()}", tmp_path / "server.log")
    with pytest.raises(RuntimeError, match=r"exited with 3 during start-up(.|\n)*CUDA error: no device"):
        server.start(startup_timeout_s=30)


def test_a_silent_server_times_out_and_is_killed_with_its_children(recorder: ModuleType, tmp_path: Path) -> None:
    # A parent that starts a child and both stay silent: SGLang's scheduler processes outlive a killed parent.
    child_pid = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(child_pid)!r}, 'w').write(str(p.pid)); print('loading weights', flush=True); time.sleep(600)"
    )
    server = recorder.Server([sys.executable, "-c", code], f"http://127.0.0.1:{free_port()}", tmp_path / "s.log")
    with pytest.raises(RuntimeError, match=r"did not answer /health with 200 within 3 s(.|\n)*loading weights"):
        server.start(startup_timeout_s=3)
    proc = server.proc
    server.stop()
    assert proc is not None and proc.poll() is not None
    pid = int(child_pid.read_text())

    def state() -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            return "gone"

    # The signal is delivered at once; the child may take a moment to finish dying. Gone, or a zombie awaiting
    # its reaper: no process left running.
    for _ in range(200):
        if state() in ("gone", "Z"):
            break
        time.sleep(0.05)
    assert state() in ("gone", "Z")


def test_file_format_keeps_token_lists_on_one_line(recorder: ModuleType) -> None:
    record = {"case": "x", "exchanges": [{"ids": [1, 2, 3], "triples": [[-0.5, 1, None], [-0.25, 2, None]]}]}
    text = recorder.dumps(record)
    assert json.loads(text) == record
    assert '"ids": [1, 2, 3]' in text and '"triples": [[-0.5, 1, null], [-0.25, 2, null]]' in text


def test_load_counts_are_found_in_either_shape(recorder: ModuleType) -> None:
    assert recorder._find_counts([{"dp_rank": 0, "num_reqs": 2}, {"dp_rank": 1, "num_reqs": 1}]) == 3
    assert recorder._find_counts({"loads": [{"num_running_reqs": 4}]}) == 4
    assert recorder._find_counts({"detail": "Not Found"}) is None


def test_unknown_case_is_refused(recorder: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        recorder.parse_args(["--out", "/tmp/x", "--cases", "health,generat"])
    assert info.value.code == 2
    assert "unknown case(s) ['generat']" in capsys.readouterr().err


def test_recording_the_embedded_engine_writes_one_file_per_case(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "rec"
    cases = "health,generate_logprobs_single,generate_sampling_mask,abort_request,error_bad_top_p"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--embedded", "--model", str(tiny_model_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*cmd, "--cases", cases, "--long-new-tokens", "900"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("case ")]
    assert [line.split()[1] for line in lines] == cases.split(",") and all(" ok " in line for line in lines)
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["cases"]) == cases.split(",") and manifest["failed"] == []
    abort = json.loads((out / "abort_request.json").read_text())
    generate, stop = abort["exchanges"]
    assert generate["background"] is True and generate["request"]["body"]["rid"] == "golden-abort"
    assert generate["response"]["body"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert stop["request"] == {
        "method": "POST",
        "path": "/abort_request",
        "body": {"rid": "golden-abort", "abort_all": False},
    }
    bad = json.loads((out / "error_bad_top_p.json").read_text())["exchanges"][0]["response"]
    assert bad["status"] == 400 and "top_p" in bad["body"]["error"]["message"]
