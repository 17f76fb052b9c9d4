"""Start embedded engines as local processes and tear them down; each writes run_dir/engines/<id>.json."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.engine.client import EngineClient
from hpcrl.engine.config import EngineConfig


class EngineStartError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, num_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except FileNotFoundError:
        return "(no log)"


@dataclass
class LocalEngine:
    engine_id: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path


class LocalEngines:
    """The engines of one run on this machine."""

    def __init__(self, cfg: EngineConfig, model_dir: str | Path, run_dir: Path, *, seed: int) -> None:
        self.cfg = cfg
        self.model_dir = str(model_dir)
        self.run_dir = run_dir
        self.seed = seed
        self.engines: list[LocalEngine] = []

    def start(self) -> list[EngineClient]:
        (self.run_dir / "engines").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for i in range(self.cfg.num_engines):
            port = self.cfg.base_port + i if self.cfg.base_port else _free_port()
            log_path = self.run_dir / "logs" / f"engine-{i}.log"
            cmd = [
                sys.executable, "-m", "hpcrl.cli", "engine", "serve",
                "--model", self.model_dir, "--port", str(port),
                "--device", self.cfg.device, "--dtype", self.cfg.dtype,
                "--max-running-requests", str(self.cfg.max_running_requests),
                "--random-seed", str(self.seed + i), "--num-threads", str(self.cfg.num_threads),
                "--parent-pid", str(os.getpid()),
            ]  # fmt: skip
            if self.cfg.deterministic:
                cmd.append("--deterministic")
            if self.cfg.onpolicy_logprobs:
                cmd.append("--onpolicy-logprobs")
            env = {**os.environ, "OMP_NUM_THREADS": str(self.cfg.num_threads)}
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self.engines.append(LocalEngine(f"engine-{i}", f"http://127.0.0.1:{port}", proc, log_path))
        clients = []
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        for eng in self.engines:
            client = EngineClient(eng.url, timeout_s=600.0, max_retries=2)
            probe = EngineClient(eng.url, timeout_s=2.0, max_retries=0)  # polling is the retry loop here
            while True:
                if eng.proc.poll() is not None:
                    self.stop()
                    raise EngineStartError(
                        f"{eng.engine_id} exited with code {eng.proc.returncode} while starting; "
                        f"last lines of {eng.log_path}:\n{_tail(eng.log_path)}"
                    )
                try:
                    if probe.health():
                        break
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise EngineStartError(
                        f"{eng.engine_id} was not healthy within engine.startup_timeout_s="
                        f"{self.cfg.startup_timeout_s}; last lines of {eng.log_path}:\n{_tail(eng.log_path)}"
                    )
                time.sleep(0.1)
            probe.close()
            rendezvous = {"id": eng.engine_id, "url": eng.url, "pid": eng.proc.pid, "host": socket.gethostname()}
            path = self.run_dir / "engines" / f"{eng.engine_id}.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(rendezvous))
            os.replace(tmp, path)
            clients.append(client)
        return clients

    def stop(self) -> None:
        for eng in self.engines:
            if eng.proc.poll() is None:
                os.killpg(eng.proc.pid, signal.SIGTERM)
        for eng in self.engines:
            try:
                eng.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(eng.proc.pid, signal.SIGKILL)
                eng.proc.wait()
            (self.run_dir / "engines" / f"{eng.engine_id}.json").unlink(missing_ok=True)
        self.engines = []
