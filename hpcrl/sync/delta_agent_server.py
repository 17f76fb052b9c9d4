"""The disk-delta agent process of one stock SGLang server, on the server's node (protocol and discovery:
hpcrl/engine/delta_agent_client.py; the patching itself: hpcrl/sync/delta_agent.py).

    python -m hpcrl.sync.delta_agent_server --engine-url URL --key-file F --model-dir D --record R [...]

Started by the launcher that starts the server (hpcrl/engine/local.py), so it runs wherever the server runs: on the
driver's node, on an engine node of the run's job, or in a job that joined the run. It reads the run's weight
directory (shared storage), keeps a CPU copy of the weights (read from the model directory at the first request),
and per `POST /apply` brings the copy to the version and has its server load it (`/update_weights_from_disk`).
Requests are served one at a time: versions are applied strictly in order. It exits on SIGINT/SIGTERM or when the
launcher that started it is gone, removing its record and its node-local copies.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from hpcrl.engine.client import EngineClient
from hpcrl.engine.delta_agent_client import APPLY_PATH, AgentRecord
from hpcrl.store.run_dir import write_file_atomically
from hpcrl.sync.delta_agent import MODES, DeltaAgentError, SglangDeltaAgent
from hpcrl.weightwire.delta import DeltaFormatError


class AgentState:
    """The agent of one server, made at the first request (reading the model takes a while; start-up must not)."""

    def __init__(self, args: argparse.Namespace, engine_key: str) -> None:
        self.args, self.engine_key = args, engine_key
        self.lock = threading.Lock()
        self.agent: SglangDeltaAgent | None = None
        self.version: str | None = None

    def apply(self, manifest: Path, version: str, timeout_s: float, mode: str | None = None) -> dict[str, Any]:
        with self.lock:
            if self.agent is None:
                client = EngineClient(self.args.engine_url, api_key=self.engine_key, timeout_s=timeout_s, max_retries=0)
                self.agent = SglangDeltaAgent(
                    client, model_dir=Path(self.args.model_dir), local_dir=Path(self.args.local_dir),
                    dtype=getattr(torch, self.args.dtype), mode=self.args.mode, tp_size=self.args.tp_size,
                    timeout_s=timeout_s,
                )  # fmt: skip
            self.agent.timeout_s = timeout_s
            if mode is not None:
                self.agent.mode = "tensor" if mode == "tensor" else "disk"
            done = self.agent.load(manifest, version)
            self.version = version
            return {k: v for k, v in done.items() if isinstance(v, int | float | str | list)}

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


def make_handler(state: AgentState, token: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            print(f"{self.address_string()} {format % args}", flush=True)

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return True
            self._answer(401, {"error": "missing or wrong bearer token (the agent's record holds it)"})
            return False

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if not self._authorized():
                return
            if self.path != "/health":
                self._answer(404, {"error": f"no GET {self.path}; the agent answers GET /health, POST {APPLY_PATH}"})
                return
            self._answer(200, {"engine_url": state.args.engine_url, "weight_version": state.version})

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if not self._authorized():
                return
            if self.path != APPLY_PATH:
                self._answer(404, {"error": f"no POST {self.path}; the agent answers POST {APPLY_PATH}"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                manifest, version = Path(body["manifest"]), str(body["weight_version"])
                timeout_s = float(body.get("timeout_s", 600.0))
                mode = body.get("mode")
                if mode is not None and mode not in MODES:
                    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
            except (ValueError, KeyError, TypeError) as exc:
                self._answer(400, {"error": f"the body must be JSON {{manifest, weight_version, timeout_s}}: {exc}"})
                return
            try:
                self._answer(200, state.apply(manifest, version, timeout_s, mode))
            except DeltaFormatError as exc:
                self._answer(409, {"error": str(exc)})
            except DeltaAgentError as exc:
                self._answer(502, {"error": str(exc)})
            except Exception as exc:  # noqa: BLE001 - the caller gets the cause; the agent keeps serving
                self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})

    return Handler


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcrl.sync.delta_agent_server", description=__doc__.split("\n")[0])
    p.add_argument("--engine-url", required=True, help="the SGLang server this agent loads weights into")
    p.add_argument("--key-file", required=True, type=Path, help="0600 file holding the server's API key")
    p.add_argument("--model-dir", required=True, help="the server's launch weights (safetensors)")
    p.add_argument("--record", required=True, type=Path, help="where to announce the agent (RUN_DIR/engines/...)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on and announce")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mode", default="disk", choices=MODES)
    p.add_argument("--local-dir", default="", help="node-local directory of the copies (default: a temp dir)")
    p.add_argument(
        "--ignore-sigterm", action="store_true", help="serve on after TERM, as its server does (Slurm steps)"
    )
    args = p.parse_args(argv)
    if not args.local_dir:
        args.local_dir = str(Path(tempfile.gettempdir()) / f"hpcrl-delta-agent-{os.getpid()}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        engine_key = args.key_file.read_text().strip()
    except OSError as exc:
        print(f"delta agent: cannot read the engine's key file {args.key_file}: {exc}", file=sys.stderr)
        return 2
    token = secrets.token_hex(16)
    state = AgentState(args, engine_key)
    server = ThreadingHTTPServer((args.host, 0), make_handler(state, token))
    server.daemon_threads = True
    port = int(server.server_address[1])
    record = AgentRecord(args.engine_url, f"http://{args.host}:{port}", token, os.getpid(), socket.gethostname())
    write_file_atomically(args.record, record.to_json(), mode=0o600)
    print(f"delta agent for {args.engine_url} listening on {record.url}", flush=True)
    parent = os.getppid()

    def watch_parent() -> None:  # an agent whose launcher died must not hold the node's memory
        while os.getppid() == parent:
            time.sleep(1.0)
        server.shutdown()

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else stop)
    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        args.record.unlink(missing_ok=True)
        state.close()
        try:
            Path(args.local_dir).rmdir()
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
