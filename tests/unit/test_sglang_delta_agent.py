"""The disk-delta agent of a stock SGLang server, as the launcher starts it: beside the server, as its own process.

No GPU here, so the server is a stand-in: a real process started by the real launcher (`python -m
sglang.launch_server`, found first on PYTHONPATH) that listens on the slot's port, checks the slot's API key and
answers /update_weights_from_disk with SGLang 0.5.16's recorded bodies (tests/golden/sglang-0.5.16/disk/): the
success body when the model directory holds weights (it then keeps a copy of what it loaded, as SGLang would serve
it, and reports the body's weight_version in /model_info, as recorded), the recorded 400 body when the directory
is missing or when the test tells it to refuse a version (SGLang then keeps the weights it had, as recorded).
Everything of hpcrl's is real: the launcher, the agent process and its HTTP endpoint, the driver's transport.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

import hpcrl
from hpcrl.engine.client import EngineClient
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.delta_agent_client import AgentRecord, DeltaAgentUnreachable, agent_record_path, find_agent
from hpcrl.engine.fleet import EngineFleet
from hpcrl.engine.joined import JoinWatcher, Registration, RunIdentity, model_identity
from hpcrl.engine.local import LocalEngines
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
    launcher: LocalEngines
    client: EngineClient
    run_dir: Path
    state: Path


@pytest.fixture
def sglang_engine(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Engine]:
    for case in ("update_weights_from_disk_weight_version", "update_weights_from_disk_missing_path"):
        recorded(case)
    package = tmp_path / "standin" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(STANDIN)
    state = tmp_path / "state"
    state.mkdir()
    run_dir = tmp_path / "run"
    launcher = LocalEngines(
        EngineConfig(kind="sglang", num_engines=1), tiny_model_dir, run_dir, seed=0, delta_agent=True,
        say=lambda line: None,
    )  # fmt: skip
    launcher.extra_env = {
        "PYTHONPATH": os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")]),
        "STANDIN_GOLDEN": str(GOLDEN), "STANDIN_STATE": str(state),
    }  # fmt: skip
    (client,) = launcher.start()
    try:
        yield Engine(launcher, client, run_dir, state)
    finally:
        launcher.stop()


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


def transport(engine: Engine, engines: list[EngineClient], delta_dir: Path, kind: str = "sglang") -> DiskDeltaTransport:
    t = DiskDeltaTransport(
        TransportContext(
            cfg=SyncConfig(transport="disk_delta", delta_dir=str(delta_dir), snapshot_every=10, group_timeout_s=60.0),
            engines=engines,
            device=torch.device("cpu"),
            pool=ThreadPoolExecutor(1),
            each=lambda fn, what: [fn(e) for e in engines],
            engine_kind=kind,
            engine_tp_size=1,
            run_dir=engine.run_dir,
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


def test_an_sglang_engine_catches_up_and_takes_pushes_through_its_agent_on_its_node(
    sglang_engine: Engine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = sglang_engine
    record = AgentRecord.read(agent_record_path(engine.run_dir, "engine-0"))
    assert record.engine_url == engine.client.url and record.pid in {p.pid for p in [engine.launcher.engines[0].agent]}
    assert oct(agent_record_path(engine.run_dir, "engine-0").stat().st_mode & 0o777) == "0o600"
    # The agent answers only with its token.
    assert httpx.get(record.url + "/health", trust_env=False).status_code == 401

    # A joining engine: the run wrote versions 100..102 before it came; it catches up from the snapshot and the
    # deltas through its agent, and serves exactly the newest version.
    weights = trainer_weights(tiny_model_dir)
    writer = transport(engine, [], tmp_path / "earlier", kind="embedded")
    history = [weights, step(weights, 1), step(step(weights, 1), 2)]
    for offset, w in enumerate(history):
        push(writer, w, 100 + offset)
    # The run's watcher admits its registration: catch-up through the agent, then the version check.
    identity = RunIdentity(model_identity(tiny_model_dir), hpcrl.__version__, str(tmp_path / "earlier"))
    events: list[tuple[str, dict]] = []
    watcher = JoinWatcher(
        engine.run_dir, identity, on_event=lambda kind, detail: events.append((kind, detail)), load_timeout_s=60.0,
        engine_kind="sglang",
    )  # fmt: skip
    Registration(
        id="job-0", url=engine.client.url, token=engine.launcher.engines[0].token, model=identity.model,
        hpcrl_version=hpcrl.__version__, job_id="job", host="node", pid=os.getpid(), time_s=0.0, weight_version=None,
    ).write(engine.run_dir)  # fmt: skip
    fleet = EngineFleet(EngineConfig(kind="sglang"), [], launcher=None, on_event=lambda kind, detail: None)
    try:
        assert watcher.update(fleet, 102), events
    finally:
        fleet.close()
    assert [s.joined for s in fleet.slots] == ["job-0"] and events[-1][0] == "engine_joined"
    assert events[-1][1]["version"] == 102
    assert_serves(engine, history[-1], 102)

    # The driver's push: it writes the delta and asks the engine's agent to load it, waiting for the answer.
    t = transport(engine, [engine.client], tmp_path / "weights")
    metrics = push(t, weights, 1)
    assert_serves(engine, weights, 1)
    current = weights
    for version in (2, 3):
        current = step(current, version)
        metrics = push(t, current, version)
        assert_serves(engine, current, version)
        assert 0 < metrics["sync/delta_bytes"] < sum(w.numel() * 4 for _, w in current) / 4
        assert 0 < metrics["sync/delta_changed_share"] < 0.1 and metrics["sync/engine_apply_s"] > 0

    # SGLang refuses version 4 (its recorded 400): the push fails naming the engine and SGLang's answer, after
    # trying a snapshot too; the engine keeps serving version 3, and the next push brings it to version 5.
    (engine.state / "refuse").write_text("4")
    with pytest.raises(WeightSyncError, match=rf"{engine.client.url}.*HTTP 502.*Failed to get weights iterator"):
        push(t, step(current, 4), 4)
    assert engine.client.weight_version() == 3
    (engine.state / "refuse").unlink()
    current = step(current, 5)
    push(t, current, 5)
    assert_serves(engine, current, 5)

    # The launcher stops the agent with its server: its record and node-local copies go with it.
    agent = engine.launcher.engines[0].agent
    assert agent is not None
    engine.launcher.stop()
    assert agent.poll() is not None and not agent_record_path(engine.run_dir, "engine-0").exists()
    with pytest.raises(DeltaAgentUnreachable, match="no disk-delta agent announced itself .*`hpcrl engine join`"):
        find_agent(engine.run_dir, record.engine_url, timeout_s=0.0)


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
    engine = Engine(launcher=None, client=EngineClient(engine_url), run_dir=run_dir, state=tmp_path)  # type: ignore[arg-type]
    t = transport(engine, [engine.client], tmp_path / "weights")
    with pytest.raises(
        WeightSyncError, match=rf"agent of the SGLang engine at {engine_url} .*pid 123 on node-a.*cannot be reached"
    ):
        push(t, [("w", torch.zeros(4))], 1)
