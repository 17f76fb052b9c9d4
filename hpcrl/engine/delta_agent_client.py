"""How the run reaches the disk-delta agent of a stock SGLang server (the agent: hpcrl/sync/delta_agent_server.py).

SGLang reads no hpcrl delta, so the launcher that starts a SGLang server for a disk_delta run (engine/local.py,
on whatever node and in whatever job the server runs) starts an agent process beside it. The agent listens on a
port of its own and announces itself in RUN_DIR/engines/<engine id>.agent.json (0600: its token is a secret):
{engine_url, url, token, pid, host}. Whoever asks an engine to load a weight version (the driver's push, the run's
join watcher, a joining job) looks the agent up by the engine's URL and posts
    POST /apply {manifest, weight_version, timeout_s[, mode]}
(mode: "disk" or "tensor", how the agent hands the weights over, see hpcrl/sync/delta_agent.py), which answers
when SGLang serves that version: 200 {version, applied, bytes, seconds, patch_s, handover_s}; 409 {error} when
the delta failed its checks (nothing of it was applied: ask again with a snapshot); 502 {error} when SGLang refused
the weights (it keeps serving the version before); 400/401 for a bad request or token.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

AGENT_SUFFIX = ".agent.json"
APPLY_PATH = "/apply"


class DeltaAgentUnreachable(RuntimeError):
    """No agent answers for an engine, or it did not bring the engine to the version (the message says why)."""


class DeltaRejected(DeltaAgentUnreachable):
    """The agent found the delta corrupt or out of order and applied nothing of it: a snapshot is needed."""


@dataclass(frozen=True)
class AgentRecord:
    engine_url: str
    url: str
    token: str
    pid: int
    host: str

    @classmethod
    def read(cls, path: Path) -> AgentRecord:
        data = json.loads(path.read_text())
        return cls(str(data["engine_url"]), str(data["url"]), str(data["token"]), int(data["pid"]), str(data["host"]))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def agent_record_path(run_dir: Path, engine_id: str) -> Path:
    return run_dir / "engines" / f"{engine_id}{AGENT_SUFFIX}"


def _same_url(a: str, b: str) -> bool:
    return a.strip().rstrip("/") == b.strip().rstrip("/")


def find_agent(run_dir: Path, engine_url: str, *, timeout_s: float = 30.0) -> AgentRecord:
    """The agent record of the engine at `engine_url`, waited for up to `timeout_s` (a shared file system may show
    a new file late); DeltaAgentUnreachable naming the folder and the fix otherwise."""
    folder = run_dir / "engines"
    deadline = time.monotonic() + timeout_s
    while True:
        for path in sorted(folder.glob(f"*{AGENT_SUFFIX}")):
            try:
                record = AgentRecord.read(path)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced, or not a record
            if _same_url(record.engine_url, engine_url):
                return record
        if time.monotonic() >= deadline:
            raise DeltaAgentUnreachable(
                f"no disk-delta agent announced itself for the SGLang engine at {engine_url} in {folder}/*"
                f"{AGENT_SUFFIX} within {timeout_s:.0f} s: SGLang engines of a disk_delta run must be started by "
                "hpcrl (`hpcrl run`, `hpcrl role engines` or `hpcrl engine join`), which starts the agent beside "
                "each server; see run_dir/logs/engine-*.agent.log"
            )
        time.sleep(0.2)


def apply_version(
    record: AgentRecord,
    manifest: Path,
    version: int | str,
    *,
    timeout_s: float,
    mode: str | None = None,
    connect_timeout_s: float = 5.0,
) -> dict[str, Any]:
    """Ask the agent to bring its SGLang server to the version of `manifest` and wait for the answer (`mode`: None
    keeps the agent's own)."""
    body: dict[str, Any] = {"manifest": str(manifest), "weight_version": str(version), "timeout_s": timeout_s}
    if mode is not None:
        body["mode"] = mode
    where = (
        f"the disk-delta agent of the SGLang engine at {record.engine_url} ({record.url}, pid {record.pid} on "
        f"{record.host})"
    )
    try:
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(timeout_s + 30.0, connect=connect_timeout_s)) as http:
            reply = http.post(
                record.url.rstrip("/") + APPLY_PATH, json=body, headers={"Authorization": f"Bearer {record.token}"}
            )
    except httpx.TimeoutException as exc:
        raise DeltaAgentUnreachable(
            f"{where} did not answer within {timeout_s + 30.0:.0f} s for {manifest.name} ({type(exc).__name__}); "
            "raise sync.group_timeout_s if loading the weights is merely slow"
        ) from exc
    except httpx.HTTPError as exc:
        raise DeltaAgentUnreachable(
            f"{where} cannot be reached ({type(exc).__name__}: {exc}); its process may have died: see "
            "run_dir/logs/engine-*.agent.log"
        ) from exc
    try:
        answer = reply.json()
    except ValueError:
        answer = {"error": reply.text[:2000]}
    if reply.status_code == 200 and isinstance(answer, dict):
        return answer
    error = answer.get("error") if isinstance(answer, dict) else answer
    cls = DeltaRejected if reply.status_code == 409 else DeltaAgentUnreachable
    raise cls(f"{where} did not load {manifest.name} (HTTP {reply.status_code}): {error}")
