"""Engines as processes on this node, and the rendezvous files through which a driver finds them.

Local runs start every engine here. In a Slurm job, `hpcrl role engines` starts the engines of its node
and the driver (trainer rank 0, maybe on another node) waits for their rendezvous files in
run_dir/engines/: address, port, API token, pid and the job incarnation (job id, restart count), so a
requeued job never talks to an engine of its previous life. Each engine gets a random API token: the
address is reachable from the whole cluster, the run directory only by its owner.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from hpcrl.engine.client import EngineClient
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.delta_agent_client import agent_record_path
from hpcrl.engine.launch import API_KEY_ENV, LaunchSlot, launch_for, write_private
from hpcrl.engine.portcheck import PortHolder, port_holder, port_in_use
from hpcrl.store.run_dir import RunDirError, make_subdir, open_no_follow


class EngineStartError(RuntimeError):
    pass


PROGRESS_EVERY_S = 15.0
AGENT_START_S = 120.0
_APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND
PORT_RACE_RETRIES = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def tail(path: Path, num_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except FileNotFoundError:
        return "(no log)"


@dataclass(frozen=True)
class Incarnation:
    """Which life of a job this is: a requeued job has the same id and a higher restart count."""

    job_id: str = "local"
    restart_count: int = 0


@dataclass
class LocalEngine:
    engine_id: str
    url: str
    token: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_s: float = field(default_factory=time.monotonic)
    agent: subprocess.Popen[bytes] | None = None  # its disk-delta agent (SGLang, sync.transport disk_delta)


def signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal an engine's process group, which may be gone already: the fleet's monitor thread polls the
    same process and can reap it between our poll() and this call (seen on the H200 when SGLang's
    scheduler was SIGKILLed during a push: the server exits on its own and the restart's kill found no
    group). A group that is gone has nothing left to signal."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _client(url: str, token: str) -> EngineClient:
    return EngineClient(url, api_key=token, timeout_s=600.0, max_retries=2)


class LocalEngines:
    """Engines `first_index .. first_index+count-1` of a run, started on this node."""

    def __init__(
        self,
        cfg: EngineConfig,
        model_dir: str | Path,
        run_dir: Path,
        *,
        seed: int,
        first_index: int = 0,
        count: int | None = None,
        bind_host: str = "127.0.0.1",
        advertise_host: str = "127.0.0.1",
        incarnation: Incarnation = Incarnation(),
        ignore_sigterm: bool = False,
        delta_agent: bool = False,
        say: Callable[[str], None] = print,
    ) -> None:
        """`delta_agent`: start a disk-delta agent beside each SGLang server (hpcrl/engine/delta_agent_client.py),
        for a run with sync.transport disk_delta; embedded engines read the deltas themselves."""
        self.cfg = cfg
        self.model_dir = str(model_dir)
        self.run_dir = run_dir
        self.seed = seed
        self.first_index = first_index
        self.count = cfg.num_engines if count is None else count
        self.bind_host = bind_host
        self.advertise_host = advertise_host
        self.incarnation = incarnation
        self.ignore_sigterm = ignore_sigterm
        self.delta_agent = delta_agent and cfg.kind == "sglang"
        self.say = say
        self.engines: list[LocalEngine] = []
        # For fault-injection tests: extra environment of the engine processes.
        self.extra_env: dict[str, str] = {}

    def start(self) -> list[EngineClient]:
        """Launch every engine, then wait until each has answered /health (each bounded by the kind's
        start-up timeout, measured from its launch; all start at once, so the wait is the slowest one's)."""
        try:
            make_subdir(self.run_dir / "engines")
            make_subdir(self.run_dir / "logs")
        except RunDirError as exc:
            raise EngineStartError(str(exc)) from None
        self.engines = []
        try:
            for i in range(self.first_index, self.first_index + self.count):
                self.engines.append(self._spawn(i))
        except EngineStartError:
            self.stop()
            raise
        for position in range(len(self.engines)):
            self._write_rendezvous(self._wait_started(position))
        return [_client(e.url, e.token) for e in self.engines]

    def restart(self, position: int) -> EngineClient:
        """Replace engine `position` (0-based among this launcher's engines) by a fresh process."""
        self.kill(position)
        self.engines[position] = self._spawn(self.first_index + position)
        eng = self._wait_started(position, stop_all=False)
        self._write_rendezvous(eng)
        return _client(eng.url, eng.token)

    # ----- what the fleet and the guard may know of the processes -----
    def exit_code(self, position: int) -> int | None:
        """The exit code of engine `position`'s process, None while it runs. An engine whose disk-delta agent exited
        takes no more weights: its agent's code counts as the engine's (the fleet restarts both)."""
        eng = self.engines[position]
        code = eng.proc.poll()
        if code is None and eng.agent is not None:
            code = eng.agent.poll()
        return code

    def kill(self, position: int) -> None:
        """SIGKILL engine `position`'s process group (a hung engine must not linger) and reap it."""
        eng = self.engines[position]
        for proc in (eng.proc, eng.agent):
            if proc is not None and proc.poll() is None:
                signal_group(proc, signal.SIGKILL)
                proc.wait()
        if eng.agent is not None:
            agent_record_path(self.run_dir, eng.engine_id).unlink(missing_ok=True)

    def log_path(self, position: int) -> Path:
        return self.engines[position].log_path

    def pids(self) -> list[int]:
        return [e.proc.pid for e in self.engines]

    def _spawn(self, i: int) -> LocalEngine:
        port = self.cfg.base_port + i if self.cfg.base_port else _free_port()
        held = port_in_use(self.bind_host, port)
        if held is not None:
            raise EngineStartError(
                f"engine-{i} cannot listen on {self.bind_host}:{port}: another process already listens on {held} "
                f"(nothing was sent to it); {_port_fix(self.cfg.base_port)}"
            )
        token = secrets.token_hex(16)
        log_path = self.run_dir / "logs" / f"engine-{i}.log"
        slot = LaunchSlot(
            index=i, position=i - self.first_index, model_dir=self.model_dir, host=self.bind_host, port=port,
            api_key=token, seed=self.seed + i, run_dir=self.run_dir, ignore_sigterm=self.ignore_sigterm,
        )  # fmt: skip
        launch = launch_for(self.cfg, slot)
        cmd = launch.cmd
        inherited = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}  # see API_KEY_ENV
        env = {**inherited, **launch.env, **self.extra_env}
        try:
            log_fd = open_no_follow(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except RunDirError as exc:
            raise EngineStartError(str(exc)) from None
        with os.fdopen(log_fd, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        eng = LocalEngine(f"engine-{i}", f"http://{self.advertise_host}:{port}", token, proc, log_path)
        if self.delta_agent:
            try:
                eng.agent = self._spawn_agent(eng, env)
            except (OSError, RunDirError) as exc:
                signal_group(proc, signal.SIGKILL)
                proc.wait()
                raise EngineStartError(f"{eng.engine_id}: its disk-delta agent could not start: {exc}") from None
        return eng

    def _spawn_agent(self, eng: LocalEngine, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """The engine's disk-delta agent, on this node like the server (its protocol: engine/delta_agent_client.py).
        Its key file and record are 0600: they hold the server's key and the agent's token."""
        engines = self.run_dir / "engines"
        key_file = write_private(engines / f"{eng.engine_id}.agent-key", eng.token)
        record = agent_record_path(self.run_dir, eng.engine_id)
        record.unlink(missing_ok=True)  # a previous life's: found only once this agent wrote its own
        cmd = [
            sys.executable, "-m", "hpcrl.sync.delta_agent_server", "--engine-url", eng.url, "--key-file", str(key_file),
            "--model-dir", self.model_dir, "--record", str(record), "--host", self.advertise_host,
            "--dtype", self.cfg.dtype, "--tp-size", str(self.cfg.tp_size),
        ]  # fmt: skip
        if self.ignore_sigterm:
            cmd.append("--ignore-sigterm")
        log_fd = open_no_follow(self.run_dir / "logs" / f"{eng.engine_id}.agent.log", _APPEND, 0o600)
        with os.fdopen(log_fd, "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _wait_agent(self, eng: LocalEngine, limit_s: float = AGENT_START_S) -> None:
        """Until the engine's agent announced itself (it reads no weights before its first request: seconds)."""
        if eng.agent is None:
            return
        record = agent_record_path(self.run_dir, eng.engine_id)
        deadline = time.monotonic() + limit_s
        while not record.exists():
            log = self.run_dir / "logs" / f"{eng.engine_id}.agent.log"
            if eng.agent.poll() is not None or time.monotonic() > deadline:
                state = f"exited with code {eng.agent.returncode}" if eng.agent.poll() is not None else "is silent"
                raise EngineStartError(
                    f"the disk-delta agent of {eng.engine_id} {state} without announcing itself in {record} "
                    f"(within {limit_s:.0f} s); last lines of {log}:\n{tail(log)}"
                )
            time.sleep(0.1)
        # The agent read the server's key before it announced itself: the copy need not outlive that.
        (self.run_dir / "engines" / f"{eng.engine_id}.agent-key").unlink(missing_ok=True)

    def _wait_started(self, position: int, *, stop_all: bool = True) -> LocalEngine:
        """Engine `position` once it answers /health. With engine.base_port 0 its port is one that was free when
        picked; another process on the node (runs starting side by side) may bind it before the engine does: the
        engine is then started again on another free port, up to PORT_RACE_RETRIES times."""
        for attempt in range(PORT_RACE_RETRIES + 1):
            eng = self.engines[position]
            try:
                wait_started(
                    eng,
                    kind=self.cfg.kind,
                    limit_s=self.cfg.start_timeout_s,
                    say=self.say,
                    base_port=self.cfg.base_port,
                )
                self._wait_agent(eng)
                return eng
            except EngineStartError:
                if self.cfg.base_port or attempt == PORT_RACE_RETRIES or not _lost_port_race(eng):
                    if stop_all:
                        self.stop()
                    raise
            self.say(f"{eng.engine_id}: its port was taken by another process before it listened; another port")
            if eng.agent is not None and eng.agent.poll() is None:
                signal_group(eng.agent, signal.SIGKILL)
                eng.agent.wait()
            self.engines[position] = self._spawn(self.first_index + position)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _write_rendezvous(self, eng: LocalEngine) -> None:
        record = {
            "id": eng.engine_id,
            "url": eng.url,
            "token": eng.token,
            "pid": eng.proc.pid,
            "host": socket.gethostname(),
            "job_id": self.incarnation.job_id,
            "restart_count": self.incarnation.restart_count,
        }
        path = self.run_dir / "engines" / f"{eng.engine_id}.json"
        tmp = path.with_suffix(".json.tmp")
        fd = open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the token is a secret
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)

    def exited(self) -> list[str]:
        """Ids of engines whose process has exited."""
        return [e.engine_id for i, e in enumerate(self.engines) if self.exit_code(i) is not None]

    def stop(self) -> None:
        procs = [p for eng in self.engines for p in (eng.proc, eng.agent) if p is not None]
        for proc in procs:
            if proc.poll() is None:
                # SIGINT: an aiohttp server shuts down on it, also when it was told to ignore SIGTERM.
                signal_group(proc, signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                signal_group(proc, signal.SIGKILL)
                proc.wait()
        for eng in self.engines:
            (self.run_dir / "engines" / f"{eng.engine_id}.json").unlink(missing_ok=True)
            if eng.agent is not None:
                agent_record_path(self.run_dir, eng.engine_id).unlink(missing_ok=True)
        self.engines = []


def _lost_port_race(eng: LocalEngine) -> bool:
    """The engine exited at start-up because its port was already bound (hpcrl's engine says PortInUseError)."""
    return eng.proc.poll() is not None and "PortInUseError" in tail(eng.log_path, 5)


def _start_hint(kind: str, log: str) -> str:
    if kind == "sglang" and "No module named 'sglang'" in log:
        return (
            f": sglang is not installed for {sys.executable}; install it on the engine nodes "
            "(pip install 'hpcrl[sglang]', the verified sglang==0.5.16), or set engine.kind=embedded"
        )
    return ""


def _port_fix(base_port: int) -> str:
    """The fix for a port another process holds: with fixed ports, another range; with picked ports (base_port 0)
    the port was free when picked and was taken before the engine bound it, so starting again picks another.
    A negative base_port (the caller does not know) gives the fixed-ports advice."""
    if base_port:
        return "stop that process, or set engine.base_port to a free range (engine.base_port=0 picks free ports)"
    return "it took the free port picked for this engine before the engine bound it; start the run again"


def _foreign(holder: PortHolder, base_port: int) -> str:
    if holder.state != "foreign":
        return ""
    return (
        f"; another process (not this engine) listens on its port ({holder.where}) and was sent nothing: "
        f"{_port_fix(base_port)}"
    )


def wait_started(
    eng: LocalEngine, *, kind: str, limit_s: float, say: Callable[[str], None], base_port: int = -1
) -> None:
    """Poll until the engine answers /health; it is `starting` meanwhile (a silent port is normal: SGLang takes
    minutes), bounded by `limit_s` from its launch, with a progress line every PROGRESS_EVERY_S."""
    probe = EngineClient(eng.url, api_key=eng.token, timeout_s=2.0, max_retries=0)  # this loop is the retry
    next_say_s = PROGRESS_EVERY_S
    url = httpx.URL(eng.url)
    holder = PortHolder("nobody")
    try:
        while True:
            waited_s = time.monotonic() - eng.started_s
            if eng.proc.poll() is not None:
                log = tail(eng.log_path)
                raise EngineStartError(
                    f"{kind} engine {eng.engine_id} exited with code {eng.proc.returncode} while starting "
                    f"({waited_s:.0f} s after launch){_start_hint(kind, log)}{_foreign(holder, base_port)}; "
                    f"last lines of {eng.log_path}:\n{log}"
                )
            # Nothing (not even the key in a /health probe) goes to a port this engine does not hold.
            holder = port_holder(url.host, url.port or 80, eng.proc.pid)
            if holder.state in ("ours", "unknown"):
                try:
                    healthy = probe.health()
                except Exception:  # noqa: BLE001 - not up yet
                    healthy = False
                if healthy:
                    if waited_s >= PROGRESS_EVERY_S:
                        say(f"{kind} engine {eng.engine_id} is up after {waited_s:.0f} s")
                    return
            if waited_s > limit_s:
                raise EngineStartError(
                    f"{kind} engine {eng.engine_id} did not answer /health within {limit_s:.0f} s of its launch "
                    f"(engine.startup_timeout_s; raise it if the engine is merely slow){_foreign(holder, base_port)}; "
                    f"last lines of {eng.log_path}:\n{tail(eng.log_path)}"
                )
            if waited_s >= next_say_s:
                say(f"{kind} engine {eng.engine_id} starting: {waited_s:.0f} s of at most {limit_s:.0f} s")
                next_say_s += PROGRESS_EVERY_S
            time.sleep(0.1)
    finally:
        probe.close()


def wait_for_rendezvous(
    run_dir: Path, num_engines: int, incarnation: Incarnation, *, timeout_s: float
) -> list[EngineClient]:
    """Clients for engines 0..num_engines-1 of this job incarnation, once all have written their file."""
    deadline = time.monotonic() + timeout_s
    folder = run_dir / "engines"
    while True:
        found: dict[int, dict[str, object]] = {}
        for i in range(num_engines):
            path = folder / f"engine-{i}.json"
            try:
                record = json.loads(path.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            if record.get("job_id") == incarnation.job_id and record.get("restart_count") == incarnation.restart_count:
                found[i] = record
        if len(found) == num_engines:
            return [_client(str(found[i]["url"]), str(found[i]["token"])) for i in range(num_engines)]
        if time.monotonic() > deadline:
            missing = sorted(set(range(num_engines)) - set(found))
            raise EngineStartError(
                f"engines {missing} wrote no rendezvous file in {folder} for job {incarnation.job_id} "
                f"(restart {incarnation.restart_count}) within {timeout_s:.0f} s; see run_dir/logs/engine-*.log "
                "and the engine step's output"
            )
        time.sleep(0.5)


def done_marker(run_dir: Path, incarnation: Incarnation) -> Path:
    """The file rank 0 writes when the run is over, telling engine nodes to stop."""
    return run_dir / "engines" / f"DONE-{incarnation.job_id}-{incarnation.restart_count}"
