"""A run against a hostile or careless local user: squatted engine ports, planted links in the run directory.

Real HTTP squatters on loopback, real engine processes, real `hpcrl run` processes and real files.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.local import EngineStartError, LocalEngine, LocalEngines, wait_started
from hpcrl.model.hf import save_state_dict
from hpcrl.store.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from hpcrl.store.run_dir import LOCK_NAME, RunDirError, RunDirLock
from tests.conftest import free_port, start_engine
from tests.support import REPO, skip_or_fail

QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


class Squatter:
    """An HTTP server on the engine's port that answers everything with 200 and records each request's headers."""

    def __init__(self, port: int) -> None:
        seen: list[dict[str, str]] = []
        self.seen = seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append({k.lower(): v for k, v in self.headers.items()})
                body = b'{"ok": true}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def squatter() -> Iterator[Squatter]:
    s = Squatter(free_port())
    yield s
    s.close()


def _engine_cmd(model_dir: Path, port: int, key: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model_dir), "--port", str(port),
            "--api-key", key]  # fmt: skip


def test_an_engine_whose_port_is_squatted_fails_to_start_and_the_squatter_gets_nothing(
    tmp_path: Path, tiny_model_dir: Path, squatter: Squatter
) -> None:
    """The race the launcher's pre-check cannot close: the squatter takes the port after the check, the
    engine then exits on bind while the squatter answers /health with 200."""
    port = squatter.server.server_address[1]
    log_path = tmp_path / "engine.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_engine_cmd(tiny_model_dir, port, "k" * 32), stdout=log, stderr=subprocess.STDOUT)
    eng = LocalEngine("engine-0", f"http://127.0.0.1:{port}", "k" * 32, proc, log_path)
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        wait_started(eng, kind="embedded", limit_s=60, say=print)
    message = str(info.value)
    print(f"refused after {time.monotonic() - t0:.1f} s: {message[:400]}")
    assert "exited with code" in message and "another process (not this engine) listens on its port" in message
    assert f"127.0.0.1:{port}" in message and "engine.base_port" in message
    assert squatter.seen == []  # not even a /health probe, so never the key
    assert proc.returncode != 0


def test_a_run_refuses_a_squatted_engine_port_without_sending_the_key(
    tmp_path: Path, tiny_model_dir: Path, squatter: Squatter
) -> None:
    port = squatter.server.server_address[1]
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", QUICKSTART, f"model.path={tiny_model_dir}", "num_steps=1",
         "engine.num_engines=1", f"engine.base_port={port}", "--run-dir", "r"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    print(out.stderr[-2000:])
    assert out.returncode == 1
    assert "hpcrl: error: EngineStartError: engine-0 cannot listen on" in out.stderr
    assert f"another process already listens on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr
    assert squatter.seen == []
    assert not list((tmp_path / "r" / "engines").glob("*.json"))  # no rendezvous with the squatter's address


def test_a_port_held_by_another_engine_is_a_start_failure_not_a_foreign_engine(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Another (keyless) engine serves on the port: the run's engines must not be replaced by it."""
    other = start_engine(tiny_model_dir, tmp_path)
    try:
        cfg = EngineConfig(num_engines=2, base_port=other.port - 1)  # engine-1 collides
        engines = LocalEngines(cfg, tiny_model_dir, tmp_path / "run", seed=0)
        with pytest.raises(EngineStartError) as info:
            engines.start()
        message = str(info.value)
        assert f"engine-1 cannot listen on 127.0.0.1:{other.port}" in message
        assert "engine.base_port=0 picks free ports" in message
        assert engines.engines == []  # engine-0, already launched, was stopped
        assert other.proc.poll() is None  # the other engine is untouched
    finally:
        other.stop()


# ---------------------------------------------------------------------------------------------------
# Planted links in the run directory


def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run_dir / LOCK_NAME).symlink_to(victim)
    with pytest.raises(RunDirError) as info:
        RunDirLock.acquire(run_dir, job_id="local")
    assert "is a symbolic link" in str(info.value) and str(victim) in str(info.value)
    assert victim.read_text() == "precious\n"


def test_a_planted_engine_log_link_is_refused_and_its_target_untouched(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "r"
    (run_dir / "logs").mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run_dir / "logs" / "engine-0.log").symlink_to(victim)
    engines = LocalEngines(EngineConfig(num_engines=1), tiny_model_dir, run_dir, seed=0)
    with pytest.raises(EngineStartError) as info:
        engines.start()
    assert "engine-0.log is a symbolic link" in str(info.value)
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("name", [LOCK_NAME, "config.yaml.tmp", "metrics.h5", "logs", "checkpoints/step_00000001.h5"])
def test_hpcrl_run_refuses_a_planted_link(tmp_path: Path, tiny_model_dir: Path, name: str) -> None:
    run_dir = tmp_path / "r"
    (run_dir / name).parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run_dir / name).symlink_to(victim)
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", QUICKSTART, f"model.path={tiny_model_dir}", "num_steps=1",
         "--run-dir", "r"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"hpcrl: error: r/{name} is a symbolic link (to {victim})" in out.stderr
    assert "Traceback" not in out.stderr
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("name", ["step_00000003.h5", ".step_00000003.h5.tmp"])
def test_a_checkpoint_is_never_written_through_a_planted_link(tmp_path: Path, name: str) -> None:
    ckpt_dir = tmp_path / "r" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (ckpt_dir / name).symlink_to(victim)
    with pytest.raises(RunDirError, match=rf"{name} is a symbolic link \(to {victim}\); hpcrl never writes through"):
        save_checkpoint(ckpt_dir, 2, {"w": torch.ones(4)}, {"step": 2})
    assert victim.read_text() == "precious\n"
    assert (ckpt_dir / name).is_symlink() and list_checkpoints(ckpt_dir) in ([], [ckpt_dir / name])


@pytest.mark.parametrize("name", ["model", "model.tmp"])
def test_an_export_is_never_written_through_a_planted_link(tmp_path: Path, tiny_model_dir: Path, name: str) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious\n")
    (run_dir / name).symlink_to(victim)
    state = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=rf"r/{name} is a symbolic link \(to {victim}\); hpcrl never writes through"):
        save_state_dict(state, run_dir / "model", source_dir=tiny_model_dir)
    assert [p.name for p in victim.iterdir()] == ["keep.txt"] and (victim / "keep.txt").read_text() == "precious\n"


def test_a_checkpoint_is_written_whole_through_its_own_temporary_file(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    (ckpt_dir / ".step_00000001.h5.tmp").write_bytes(b"left by a killed writer")
    path = save_checkpoint(ckpt_dir, 0, {"w": torch.arange(5000.0)}, {"step": 0})
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_00000001.h5"]
    assert torch.equal(load_checkpoint(path).tensors["w"], torch.arange(5000.0))


def test_failed_starts_leave_no_run_dir_that_a_later_start_would_take_for_a_run(
    tmp_path: Path, tiny_model_dir: Path, squatter: Squatter
) -> None:
    # The engine cannot start (its port is held): twice in a row, as a user retrying would.
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine\n")
    port = squatter.server.server_address[1]
    for run_dir in ("r", "r", "kept"):
        out = subprocess.run(
            [sys.executable, "-m", "hpcrl.cli", "run", QUICKSTART, f"model.path={tiny_model_dir}", "num_steps=1",
             f"engine.base_port={port}", "--run-dir", run_dir],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        print(out.stdout[-600:], out.stderr[-600:])
        assert out.returncode == 1 and "hpcrl: error: EngineStartError: engine-0 cannot listen on" in out.stderr
        assert "no step was recorded: removed what this start wrote (config.yaml, metrics.h5" in out.stdout
        assert not (tmp_path / "r").exists()
    # A folder that was there keeps what it held before; only what the failed start wrote is gone.
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [LOCK_NAME, "notes.txt"]
    assert squatter.seen == []


def test_a_failed_start_never_removes_what_a_run_recorded(tmp_path: Path) -> None:
    from hpcrl.store.metrics import MetricsWriter
    from hpcrl.store.run_dir import forget_failed_start

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    writer = MetricsWriter(run_dir / "metrics.h5", root_attrs={"config": ""})
    writer.log(0, {"train/loss": 0.5})
    writer.close()
    (run_dir / "config.yaml").write_text("name: x\n")
    assert forget_failed_start(run_dir, set(), created=True) == []
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "metrics.h5"]


def test_a_bad_environment_path_is_refused_before_any_engine_starts(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", str(REPO / "experiments" / "tool-quickstart.yaml"),
         f"model.path={tiny_model_dir}", "rollout.environment=no_such_pkg_hpcrl.envs:Env", "sft.num_steps=0",
         "num_steps=1", "--run-dir", "r"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    print(out.stdout[-800:], out.stderr[-800:])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert errors == [
        "hpcrl: error: rollout.environment: cannot import 'no_such_pkg_hpcrl.envs:Env': no module named "
        "'no_such_pkg_hpcrl' (check the spelling, and that it is on PYTHONPATH); give a built-in (calculator), a "
        "dotted path module:Class or a file path file.py:Class"
    ]
    assert "engine" not in out.stdout + out.stderr  # none was started
    assert not (tmp_path / "r").exists()


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """An empty folder the run cannot write: mode 0500, or for root (whom modes do not stop) a read-only mount."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        try:
            yield path
        finally:
            path.chmod(0o700)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)]).returncode != 0:
        skip_or_fail("root without a way to mount a read-only filesystem", missing="no read-only tmpfs mount")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_run_dir_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    with read_only_dir(tmp_path / "r") as run_dir:
        for where in ("r", "r/sub"):  # the run dir itself, and a new one under a read-only mount
            out = subprocess.run(
                [sys.executable, "-m", "hpcrl.cli", "run", QUICKSTART, f"model.path={tiny_model_dir}", "num_steps=1",
                 "--run-dir", where],
                cwd=tmp_path, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            print(out.stderr[-600:])
            assert out.returncode == 2, out.stderr[-3000:]
            assert "Traceback" not in out.stderr
            assert "hpcrl: error: cannot" in out.stderr, out.stderr
            assert "Permission denied" in out.stderr or "Read-only file system" in out.stderr
        assert list(run_dir.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# Errors a user meets as hpcrl: error lines, not tracebacks


@pytest.mark.parametrize("command", ["engine", "sessions"])
def test_serving_on_a_port_in_use_is_refused_before_the_model_loads(
    tmp_path: Path, tiny_model_dir: Path, squatter: Squatter, command: str
) -> None:
    port = squatter.server.server_address[1]
    args = {
        "engine": ["engine", "serve", "--model", str(tiny_model_dir), "--port", str(port)],
        "sessions": ["sessions", "serve", "--engine", "http://127.0.0.1:9", "--model", str(tiny_model_dir),
                     "--family", "tiny", "--port", str(port)],
    }[command]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", *args], capture_output=True, text=True, timeout=300)
    print(out.stderr[-800:])
    assert out.returncode == 1
    assert "hpcrl: error: PortInUseError: " in out.stderr and f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "another --port" in out.stderr and "Traceback" not in out.stderr
    assert "loaded" not in out.stdout + out.stderr  # refused before the model (or tokenizer) load
    assert squatter.seen == []


def _damaged_metrics(run_dir: Path, how: str) -> None:
    from hpcrl.store.metrics import MetricsWriter

    run_dir.mkdir()
    path = run_dir / "metrics.h5"
    writer = MetricsWriter(path, root_attrs={"config": ""})
    for step in range(3):
        writer.log(step, {"train/loss": 0.5})
    writer.close()
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "bit-flipped":
        for i in range(600, len(data), 53):
            data[i] ^= 0x40
    else:  # random bytes behind the HDF5 signature
        data = bytearray(data[:8] + os.urandom(3000))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "bit-flipped", "random"])
def test_a_damaged_metrics_file_is_an_error_line_naming_the_file(tmp_path: Path, how: str) -> None:
    _damaged_metrics(tmp_path / "r", how)
    before = (tmp_path / "r" / "metrics.h5").read_bytes()
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "report", "r"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    print(out.stderr[-600:])
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "error: cannot" in out.stderr and "r/metrics.h5" in out.stderr and "truncated or corrupt" in out.stderr
    assert (tmp_path / "r" / "metrics.h5").read_bytes() == before  # nothing rewritten


@pytest.mark.parametrize("how", ["bit-flipped", "truncated"])
def test_a_resume_over_a_damaged_metrics_file_is_an_error_line_naming_the_file(
    tmp_path: Path, tiny_model_dir: Path, how: str
) -> None:
    from hpcrl.config import dump_yaml
    from hpcrl.run_config import load_run_config

    overrides = [f"model.path={tiny_model_dir}", "num_steps=2"]
    _damaged_metrics(tmp_path / "r", how)
    # A checkpoint to resume from and the config it was written under: the run gets as far as opening metrics.h5.
    (tmp_path / "r" / "config.yaml").write_text(dump_yaml(load_run_config(QUICKSTART, overrides)))
    save_checkpoint(tmp_path / "r" / "checkpoints", 0, {"w": torch.ones(2)}, {})
    before = (tmp_path / "r" / "metrics.h5").read_bytes()
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", QUICKSTART, *overrides, "--run-dir", "r"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    print(out.stderr[-600:])
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "hpcrl: error: StoreError: cannot " in out.stderr and "r/metrics.h5 " in out.stderr
    assert "the file is truncated or corrupt: move it aside to start a new metrics file" in out.stderr
    assert (tmp_path / "r" / "metrics.h5").read_bytes() == before
    assert (tmp_path / "r" / "checkpoints" / "step_00000001.h5").exists()


def test_an_engine_whose_free_port_is_taken_before_it_binds_starts_on_another(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs starting side by side on one node: a port picked free (engine.base_port 0) is bound by another process
    between the pick and the engine's bind. The engine is started again on another free port, not the run failed."""
    import hpcrl.engine.local as local

    real_free_port = local._free_port
    squatter = socket.socket()
    picks: list[int] = []

    def free_port_then_taken() -> int:
        port = real_free_port()
        picks.append(port)
        if len(picks) == 1:  # taken just after the launcher checked it, while the engine imports torch
            threading.Timer(0.3, lambda: (squatter.bind(("127.0.0.1", port)), squatter.listen())).start()
        return port

    monkeypatch.setattr(local, "_free_port", free_port_then_taken)
    messages: list[str] = []
    engines = LocalEngines(EngineConfig(num_engines=1), tiny_model_dir, tmp_path / "run", seed=0, say=messages.append)
    try:
        (client,) = engines.start()
        assert len(picks) == 2 and client.url.endswith(f":{picks[1]}")
        assert client.health()
        assert any("its port was taken by another process" in m for m in messages), messages
    finally:
        engines.stop()
        squatter.close()
