"""The disk-delta agent of a stock SGLang server, as the launcher starts it: beside the server, as its own process.

No GPU here, so the server is a stand-in: a real process started by the real launcher (`python -m
sglang.launch_server`, found first on PYTHONPATH) that listens on the slot's port, checks the slot's API key and
answers /update_weights_from_disk with SGLang 0.5.16's recorded bodies (tests/golden/sglang-0.5.16/disk/): the
success body when the model directory holds weights (it then keeps a copy of what it loaded, as SGLang would serve
it, and reports the body's weight_version in /model_info, as recorded), the recorded 400 body when the directory
is missing or when the test tells it to refuse a version (SGLang then keeps the weights it had, as recorded).
Everything of hpcrl's is real: `hpcrl engine join` as a join job runs it (its launcher, the agent process and its
HTTP endpoint), the run's join watcher and the driver's disk_delta transport.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from hpcrl.engine.client import EngineClient
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.delta_agent_client import AgentRecord, DeltaAgentUnreachable, agent_record_path, find_agent
from hpcrl.engine.fleet import EngineFleet
from hpcrl.engine.joined import JoinWatcher, Registration, joined_dir, this_identity
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.disk_delta import DiskDeltaTransport
from hpcrl.sync.errors import WeightSyncError
from hpcrl.sync.transport import TransportContext

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "sglang-0.5.16" / "disk"

STANDIN = r"""
import json, os, shutil, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1]
key = json.loads(Path(opt("--config")).read_text().split(":", 1)[1])
golden, state = Path(os.environ["STANDIN_GOLDEN"]), Path(os.environ["STANDIN_STATE"])
def exchange(case, path):
    data = json.loads((golden / f"{case}.json").read_text())
    return next(e["response"] for e in data["exchanges"] if e["request"]["path"] == path)
ok = exchange("update_weights_from_disk_weight_version", "/update_weights_from_disk")
refused = exchange("update_weights_from_disk_missing_path", "/update_weights_from_disk")
info = exchange("update_weights_from_disk_weight_version", "/model_info")["body"]
current = {"weight_version": opt("--weight-version"), "model_path": opt("--model-path")}

class H(BaseHTTPRequestHandler):
    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def allowed(self):
        if self.headers.get("Authorization") != f"Bearer {key}":
            self.answer(401, {"error": "Unauthorized"})
            return False
        return True
    def do_GET(self):
        if not self.allowed():
            return
        if self.path == "/health":
            self.answer(200, {})
        elif self.path == "/model_info":
            self.answer(200, {**info, **current})
        else:
            self.answer(404, {"detail": "Not Found"})
    def do_POST(self):
        if not self.allowed():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/update_weights_from_disk":
            self.answer(404, {"detail": "Not Found"})
            return
        path, version = Path(body["model_path"]), str(body.get("weight_version"))
        refuse = state / "refuse"
        if not (path / "model.safetensors").is_file() or (refuse.exists() and refuse.read_text() == version):
            self.answer(refused["status"], refused["body"])  # SGLang keeps the weights it had
            return
        shutil.copyfile(path / "model.safetensors", state / f"loaded-{version}.safetensors")
        current.update(weight_version=version, model_path=str(path))
        reply = dict(ok["body"], message=ok["body"]["message"].replace("to 7.", f"to {version}."))
        self.answer(ok["status"], reply)
    def log_message(self, *a):
        pass

ThreadingHTTPServer((opt("--host"), int(opt("--port"))), H).serve_forever()
"""


def recorded(case: str) -> dict:
    data = json.loads((GOLDEN / f"{case}.json").read_text())
    if not data.get("recorded"):
        pytest.fail(f"{GOLDEN / case}.json is not a recording of SGLang 0.5.16 yet (recorded: false)")
    return data


@dataclass
class Engine:
    client: EngineClient
    run_dir: Path
    state: Path


def standin_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment under which `python -m sglang.launch_server` is the stand-in, and its state directory."""
    for case in ("update_weights_from_disk_weight_version", "update_weights_from_disk_missing_path"):
        recorded(case)
    package = tmp_path / "standin" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(STANDIN)
    state = tmp_path / "state"
    state.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")]),
        "STANDIN_GOLDEN": str(GOLDEN), "STANDIN_STATE": str(state), "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    return env, state


def wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen[str], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what} did not happen; the join process said:\n{proc.communicate()[0]}")
        time.sleep(0.1)


def trainer_weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def step(weights: list[tuple[str, torch.Tensor]], seed: int) -> list[tuple[str, torch.Tensor]]:
    """A sparse update, as a step at a small learning rate makes it: a few elements of every tensor change."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, tensor in weights:
        flat = tensor.clone().flatten()
        picked = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=gen)
        flat[picked] += 1e-3
        out.append((name, flat.view_as(tensor)))
    return out


def transport(run_dir: Path, engines: list[EngineClient], delta_dir: Path) -> DiskDeltaTransport:
    """The driver's disk_delta transport to SGLang engines (`engines` may grow: the fleet's live ones)."""
    t = DiskDeltaTransport(
        TransportContext(
            cfg=SyncConfig(transport="disk_delta", delta_dir=str(delta_dir), snapshot_every=10, group_timeout_s=60.0),
            engines=engines,
            device=torch.device("cpu"),
            pool=ThreadPoolExecutor(1),
            each=lambda fn, what: [fn(e) for e in engines],
            engine_kind="sglang",
            engine_tp_size=1,
            run_dir=run_dir,
        )  # fmt: skip
    )
    t.connect()
    return t


def push(t: DiskDeltaTransport, weights: list[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
    t.begin(version)
    t.send(weights)
    t.finish(version)
    return t.metrics()


def assert_serves(engine: Engine, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
    assert engine.client.weight_version() == version  # what the run checks before a joined engine's first request
    loaded = load_file(str(engine.state / f"loaded-{version}.safetensors"))
    for name, tensor in weights:
        assert torch.equal(loaded[name].view(torch.int32), tensor.view(torch.int32)), name


def test_an_sglang_engine_joins_a_run_from_its_own_process_and_takes_pushes_through_its_agent(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    env, state = standin_env(tmp_path)
    run_dir, weights_dir = tmp_path / "run", tmp_path / "run" / "weights"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(
        f"name: x\nmodel:\n  path: {tiny_model_dir}\nengine:\n  kind: sglang\nsync:\n  transport: disk_delta\n"
    )
    # The run: it announces itself (identity, probe) and has pushed versions 100..102 before the engine comes.
    events: list[tuple[str, dict]] = []
    watcher = JoinWatcher(
        run_dir, this_identity(tiny_model_dir, weights_dir), load_timeout_s=60.0, engine_kind="sglang",
        on_event=lambda kind, detail: events.append((kind, detail)),
    )  # fmt: skip
    engines: list[EngineClient] = []
    t = transport(run_dir, engines, weights_dir)
    history = [trainer_weights(tiny_model_dir)]
    push(t, history[0], 100)
    for version in (101, 102):
        history.append(step(history[-1], version))
        push(t, history[-1], version)

    # The engine's own process (as a join job runs it): the launcher starts the server and its agent beside it; the
    # agent brings the server to version 102 from the snapshot and the deltas before it registers.
    joiner = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "engine", "join", str(run_dir)], env={**os.environ, **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(
            "a registration", lambda: any(p.name != "RUN.json" for p in joined_dir(run_dir).glob("*.json")), joiner
        )
        (reg_path,) = [p for p in joined_dir(run_dir).glob("*.json") if p.name != "RUN.json"]
        reg = Registration.from_file(reg_path)
        assert reg.weight_version == 102
        engine = Engine(EngineClient(reg.url, api_key=reg.token), run_dir, state)
        assert_serves(engine, history[-1], 102)
        record_path = agent_record_path(run_dir, "engine-1")  # the run's own engine is engine-0
        record = AgentRecord.read(record_path)
        assert record.engine_url == reg.url and oct(record_path.stat().st_mode & 0o777) == "0o600"
        assert not (run_dir / "engines" / "engine-1.agent-key").exists()  # the server's key, read and removed
        assert httpx.get(record.url + "/health", trust_env=False).status_code == 401  # its token only

        # The run pushed 103 meanwhile: its watcher catches the engine up through the agent, checks the version the
        # engine reports, and only then routes to it.
        history.append(step(history[-1], 103))
        push(t, history[-1], 103)
        fleet = EngineFleet(EngineConfig(kind="sglang"), [], launcher=None, on_event=lambda kind, detail: None)
        try:
            assert watcher.update(fleet, 103), events
        finally:
            fleet.close()
        assert [s.joined for s in fleet.slots] == [reg.id] and events[-1][0] == "engine_joined"
        assert events[-1][1]["version"] == 103
        assert_serves(engine, history[-1], 103)

        # The driver's pushes: each writes the delta and asks the engine's agent to load it, waiting for the answer.
        engines.append(engine.client)
        t.reconnect(engines)
        current = history[-1]
        for version in (104, 105):
            current = step(current, version)
            metrics = push(t, current, version)
            assert_serves(engine, current, version)
            assert 0 < metrics["sync/delta_bytes"] < sum(w.numel() * 4 for _, w in current) / 4
            assert 0 < metrics["sync/delta_changed_share"] < 0.1 and metrics["sync/engine_apply_s"] > 0

        # SGLang refuses version 106 (its recorded 400): the push fails naming the engine and SGLang's answer, after
        # trying a snapshot too; the engine keeps serving 105, and the next push brings it to 107.
        (state / "refuse").write_text("106")
        with pytest.raises(WeightSyncError, match=rf"{engine.client.url}.*HTTP 502.*Failed to get weights iterator"):
            push(t, step(current, 106), 106)
        assert engine.client.weight_version() == 105
        (state / "refuse").unlink()
        current = step(current, 107)
        push(t, current, 107)
        assert_serves(engine, current, 107)

        # scancel: the registration goes, then the server and its agent (its record and node-local copies too).
        joiner.send_signal(signal.SIGTERM)
        assert joiner.wait(timeout=30) == 0
    finally:
        if joiner.poll() is None:
            joiner.kill()
    assert not reg_path.exists() and not record_path.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(record.pid, 0)
    with pytest.raises(DeltaAgentUnreachable, match="no disk-delta agent announced itself .*`hpcrl engine join`"):
        find_agent(run_dir, record.engine_url, timeout_s=0.0)


def test_an_agent_that_does_not_answer_is_a_clear_error_naming_the_engine(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on: an agent that died, its record left behind
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    run_dir = tmp_path / "run"
    (run_dir / "engines").mkdir(parents=True)
    engine_url = "http://127.0.0.1:1"
    record = AgentRecord(engine_url, dead, "token", 123, "node-a")
    agent_record_path(run_dir, "engine-0").write_bytes(record.to_json())
    assert find_agent(run_dir, engine_url + "/", timeout_s=0.0) == record
    t = transport(run_dir, [EngineClient(engine_url)], tmp_path / "weights")
    with pytest.raises(
        WeightSyncError, match=rf"agent of the SGLang engine at {engine_url} .*pid 123 on node-a.*cannot be reached"
    ):
        push(t, [("w", torch.zeros(4))], 1)
