"""Weight transports are found by name in one registry and see a push through three hooks; the wire format sits
below both ends (the engine imports nothing of sync/, sync/ nothing of trainer/)."""

from __future__ import annotations

import ast
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from hpcrl.config import ConfigError
from hpcrl.engine.client import EngineClient
from hpcrl.engine.portcheck import listeners
from hpcrl.model.hf import load_model
from hpcrl.run_config import load_run_config
from hpcrl.sync import transport
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.push import WeightSync
from hpcrl.sync.tensor_handover import TensorSender
from hpcrl.sync.transport import TransportContext, make_transport
from hpcrl.weightwire.buckets import Bucket
from tests.conftest import EngineProcess

HPCRL = Path(__file__).resolve().parents[2] / "hpcrl"
CALLS: list[tuple[str, object]] = []


class Recording(TensorSender):
    """A transport of this test module: the same-host handover, with every hook recorded."""

    def begin(self, version: int) -> None:
        CALLS.append(("begin", version))

    def send(self, bucket: Bucket) -> None:
        CALLS.append(("send", [name for name, _ in bucket]))
        super().send(bucket)

    def finish(self, version: int) -> None:
        CALLS.append(("finish", version))


def test_an_unknown_transport_is_refused_with_the_registered_names(tmp_path: Path) -> None:
    ctx = TransportContext(
        cfg=SyncConfig(), engines=[], device=torch.device("cpu"), pool=ThreadPoolExecutor(1),
        each=lambda fn, what: [], engine_kind="embedded", engine_tp_size=1,
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"sync.transport 'nccl' is not one of \['distributed', 'tensor', 'mpi', 'disk_delta'\]"
    ):
        make_transport("nccl", ctx)
    with pytest.raises(
        ValueError, match=r"'nccl' is not one of \['auto', 'distributed', 'tensor', 'mpi', 'disk_delta'\]"
    ):
        SyncConfig(transport="nccl")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {path: m}\n")
    with pytest.raises(
        ConfigError, match=r"sync.*'nccl' is not one of \['auto', 'distributed', 'tensor', 'mpi', 'disk_delta'\]"
    ):
        load_run_config(cfg, ["sync.transport=nccl"])


def test_a_registered_transport_sees_begin_every_bucket_then_finish(
    shared_engine: EngineProcess, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new transport is one module and this one line.
    monkeypatch.setitem(transport.TRANSPORTS, "recording", f"{__name__}:Recording")
    named = list(load_model(tiny_model_dir).state_dict().items())
    sync = WeightSync(
        SyncConfig(transport="recording", bucket_mb=0.01), [EngineClient(shared_engine.url)], device=torch.device("cpu")
    )
    CALLS.clear()
    try:
        metrics = sync.push(named, 5)
    finally:
        sync.close()
    assert CALLS[0] == ("begin", 5) and CALLS[-1] == ("finish", 5)
    sent = [names for hook, names in CALLS[1:-1] if hook == "send"]
    assert len(sent) == len(CALLS) - 2 == metrics["sync/num_buckets"] > 1
    assert [n for names in sent for n in names] == [n for n, _ in named]  # every tensor once, in order
    assert EngineClient(shared_engine.url).weight_version() == 5


def test_a_local_run_pushes_over_a_weight_group_whose_store_listens_on_loopback_only(
    shared_engine: EngineProcess, tiny_model_dir: Path
) -> None:
    named = list(load_model(tiny_model_dir).state_dict().items())
    engines = [EngineClient(shared_engine.url)]
    sync = WeightSync(SyncConfig(transport="distributed"), engines, device=torch.device("cpu"))
    try:
        sync.connect()
        metrics = sync.push(named, 3)
        port = sync.transport.port  # type: ignore[attr-defined]
        bound = listeners(port)
    finally:
        sync.close()
    assert metrics["sync/num_buckets"] >= 1
    # Not 0.0.0.0 or [::]: no other host reaches the rendezvous of a run whose engines are all on this one.
    assert bound is not None and [b.describe() for b in bound] == [f"127.0.0.1:{port}"]


def _hpcrl_imports(package: str) -> dict[str, set[str]]:
    """Every hpcrl module that a module of `package` imports, lazily or for type checking included."""
    found: dict[str, set[str]] = {}
    for path in sorted((HPCRL / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        found[str(path.relative_to(HPCRL.parent))] = {n for n in names if n.startswith("hpcrl.")}
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("engine", ("hpcrl.sync", "hpcrl.trainer")), ("sync", ("hpcrl.trainer",)), ("weightwire", ("hpcrl.",))],
)
def test_the_wire_format_sits_below_the_engine_and_sync(package: str, forbidden: tuple[str, ...]) -> None:
    bad = {
        module: sorted(n for n in names if n.startswith(forbidden) and not n.startswith(f"hpcrl.{package}"))
        for module, names in _hpcrl_imports(package).items()
    }
    assert not {m: names for m, names in bad.items() if names}, f"hpcrl/{package} imports {forbidden}"


class NotSent(Recording):
    """Recording, with nothing handed to the engine (a stand-in server has no weights to take)."""

    def send(self, bucket: Bucket) -> None:
        CALLS.append(("send", [name for name, _ in bucket]))


class _StandInSGLang(BaseHTTPRequestHandler):
    """The control endpoints of a push as stock SGLang answers them; /flush_cache as SGLang does while requests
    wait (400) when `busy` is set."""

    busy = False
    version = "0"

    def _reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._reply(200, {"weight_version": self.version})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        CALLS.append(("http", self.path))
        if self.path == "/flush_cache" and self.busy:
            self._reply(400, {"message": "Cache not flushed because there are pending requests."})
            return
        if self.path == "/update_weight_version":
            type(self).version = str(body["new_version"])
        self._reply(200, {"success": True, "message": "ok"})

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("pause_mode, busy", [("retract", False), ("retract", True), ("in_place", False)])
def test_a_push_into_sglang_empties_its_prefix_cache_before_the_weights_change(
    monkeypatch: pytest.MonkeyPatch, pause_mode: str, busy: bool
) -> None:
    # SGLang keeps finished requests' K/V across a weight update unless flushed: measured on a real 0.5.16
    # server, a prompt asked again after a tensor push was served from the old prefix.
    monkeypatch.setitem(transport.TRANSPORTS, "not-sent", f"{__name__}:NotSent")
    monkeypatch.setattr(_StandInSGLang, "busy", busy)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandInSGLang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    sync = WeightSync(SyncConfig(transport="not-sent", pause_mode=pause_mode), [EngineClient(url)],  # type: ignore[arg-type]
                      device=torch.device("cpu"), engine_kind="sglang")  # fmt: skip
    CALLS.clear()
    try:
        metrics = sync.push([("w", torch.zeros(4))], 7)
    finally:
        sync.close()
        server.shutdown()
        server.server_close()
    order = [c[1] if c[0] == "http" else c[0] for c in CALLS]
    if pause_mode == "in_place":  # the paused requests keep their K/V by design: SGLang would refuse the flush
        assert order == [
            "/pause_generation",
            "begin",
            "send",
            "finish",
            "/update_weight_version",
            "/continue_generation",
        ]
        assert "sync/prefix_cache_flushed" not in metrics
        return
    assert order == ["/pause_generation", "/flush_cache", "begin", "send", "finish", "/update_weight_version",
                     "/continue_generation"]  # fmt: skip
    # Requests that retract put back in the queue block the flush: counted, and the push still lands.
    assert metrics["sync/prefix_cache_flushed"] == (0.0 if busy else 1.0)  # and push() checked version 7 landed
