"""Engines that join a running run from a job of their own, through the shared run directory.

The run (its driver) writes RUN_DIR/engines/joined/RUN.json when it starts with sync.transport disk_delta: the
identity of its model, the hpcrl version, the weight directory and the nonce of the probe it wrote there (every
process that reads weights on another node checks it sees that nonce: `SharedCheck`). A joining process
(`hpcrl engine join RUN_DIR`, hpcrl/slurm/join.py) checks that identity against its own, starts its engine, brings
it to the newest weight version on disk, and writes one registration file per engine, atomically:
RUN_DIR/engines/joined/<id>.json (URL, API token, model identity, hpcrl version, job id, host, pid, time, weight
version). It removes the file when it leaves
(scancel, preemption, the end of its job).

Between steps (inside the weight push, hpcrl/sync/publisher.py) the run's `JoinWatcher` reads the folder:
- a new registration is checked (model identity and hpcrl version equal the run's: otherwise `<id>.refused` names
  both, and the joining process exits with it), probed, and brought to the run's current weight version from the
  weight directory (snapshot + deltas) when it holds another one; only an engine that then reports exactly the
  current version joins the fleet (routable from the next request on), one that does not is tried again later;
- a registration that disappeared marks its engine dead: the rollout re-issues its requests to the live engines
  and the fleet counts it as left (a joined engine is never restarted from here: its job owns it).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hpcrl
from hpcrl.engine.client import EngineClient
from hpcrl.engine.delta_agent_client import apply_version, find_agent
from hpcrl.engine.protocol.control import UpdateWeightsFromDelta
from hpcrl.store.run_dir import make_subdir, write_file_atomically
from hpcrl.weightwire.delta import DeltaDirNotShared, check_probe, manifest_name, write_probe

if TYPE_CHECKING:
    from hpcrl.engine.fleet import EngineFleet

RUN_FILE = "RUN.json"
EventFn = Callable[[str, dict[str, Any]], None]


class JoinError(RuntimeError):
    """A joining engine cannot join this run (the message names the difference and the fix)."""


def joined_dir(run_dir: Path) -> Path:
    return run_dir / "engines" / "joined"


def model_identity(model_dir: Path) -> str:
    """A short hash of what makes two model directories the same model for an engine: config.json's content and
    the names and sizes of the weight files (reading every weight would take minutes on a large model)."""
    h = hashlib.sha256()
    config = model_dir / "config.json"
    h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode() if config.is_file() else b"{}")
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{path.name}:{path.stat().st_size};".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class RunIdentity:
    """What a joining engine must match, written by the run as RUN.json."""

    model: str
    hpcrl_version: str
    weights_dir: str
    probe_nonce: str = ""
    """The nonce in the weight directory's probe file ("" when none was written)."""

    def write(self, run_dir: Path) -> None:
        folder = make_subdir(joined_dir(run_dir))
        write_file_atomically(folder / RUN_FILE, json.dumps(asdict(self)).encode())

    @classmethod
    def read(cls, run_dir: Path) -> RunIdentity:
        path = joined_dir(run_dir) / RUN_FILE
        try:
            data = json.loads(path.read_text())
            return cls(
                str(data["model"]), str(data["hpcrl_version"]), str(data["weights_dir"]), str(data["probe_nonce"])
            )
        except FileNotFoundError:
            raise JoinError(
                f"{path} not found: the run in {run_dir} has not started, or does not take joining engines (it "
                "needs sync.transport=disk_delta); start the run first, then join"
            ) from None
        except (ValueError, KeyError, TypeError) as exc:
            raise JoinError(f"{path} is not a run identity ({exc}); is {run_dir} a run directory?") from None


@dataclass(frozen=True)
class Registration:
    """One joined engine, as its job announces it."""

    id: str
    url: str
    token: str
    model: str
    hpcrl_version: str
    job_id: str
    host: str
    pid: int
    time_s: float
    weight_version: int | None

    def write(self, run_dir: Path) -> Path:
        """Atomically (a reader sees no file or the whole one); mode 0600: the token is a secret."""
        path = make_subdir(joined_dir(run_dir)) / f"{self.id}.json"
        write_file_atomically(path, json.dumps(asdict(self)).encode(), mode=0o600)
        return path

    @classmethod
    def from_file(cls, path: Path) -> Registration:
        data = json.loads(path.read_text())
        version = data.get("weight_version")
        return cls(
            id=str(data["id"]), url=str(data["url"]), token=str(data["token"]), model=str(data["model"]),
            hpcrl_version=str(data["hpcrl_version"]), job_id=str(data["job_id"]), host=str(data["host"]),
            pid=int(data["pid"]), time_s=float(data["time_s"]),
            weight_version=None if version is None else int(version),
        )  # fmt: skip

    def mismatch(self, run: RunIdentity) -> str | None:
        """Why this engine cannot serve that run (None: it can)."""
        problems = []
        if self.model != run.model:
            problems.append(f"model {self.model} (the run's: {run.model})")
        if self.hpcrl_version != run.hpcrl_version:
            problems.append(f"hpcrl {self.hpcrl_version} (the run's: {run.hpcrl_version})")
        if not problems:
            return None
        return (
            f"engine {self.id} of job {self.job_id} has " + " and ".join(problems) + ": join with the run's model "
            "directory and the hpcrl version the run uses"
        )


def done_path(run_dir: Path) -> Path:
    """Written when the run process ends: joined engines then stop and remove their registrations."""
    return joined_dir(run_dir) / "DONE"


def refusal_path(run_dir: Path, engine_id: str) -> Path:
    return joined_dir(run_dir) / f"{engine_id}.refused"


def catch_up(
    client: EngineClient,
    weights_dir: Path,
    version: int,
    *,
    timeout_s: float,
    engine_kind: str = "embedded",
    run_dir: Path | None = None,
) -> None:
    """Bring an engine to weight `version` from the weight directory: the newest snapshot at or before it and the
    deltas after it (hpcrl/engine/embedded/delta_load.py plans the order and checks every checksum). A SGLang engine
    is brought there by its disk-delta agent (found through `run_dir`, hpcrl/engine/delta_agent_client.py), which
    stamps the version as SGLang loads it."""
    for kind in ("delta", "snapshot"):
        manifest = weights_dir / manifest_name(kind, version)
        if manifest.exists():
            break
    else:
        raise JoinError(f"weight version {version} has no manifest in {weights_dir}")
    if engine_kind == "sglang":
        if run_dir is None:
            raise JoinError("a SGLang engine catches up through its agent, which the run directory names")
        apply_version(find_agent(run_dir, client.url), manifest, version, timeout_s=timeout_s)
        return
    request = UpdateWeightsFromDelta(manifest=str(manifest), weight_version=str(version))
    client.call(request.endpoint, request, timeout_s=timeout_s)
    client.update_weight_version(version, abort_all_requests=False)


def newest_version(weights_dir: Path) -> int | None:
    """The newest version with a manifest (a delta or a snapshot) in the weight directory."""
    from hpcrl.weightwire.delta import published

    have = published(weights_dir)
    versions = have["delta"] + have["snapshot"]
    return max(versions) if versions else None


class JoinWatcher:
    """The run's side: admits registered engines into the fleet between steps and notices those that left."""

    def __init__(
        self,
        run_dir: Path,
        identity: RunIdentity,
        *,
        on_event: EventFn,
        load_timeout_s: float,
        probe_s: float = 5.0,
        engine_kind: str = "embedded",
    ) -> None:
        self.run_dir, self.identity, self.on_event, self.engine_kind = run_dir, identity, on_event, engine_kind
        self.load_timeout_s, self.probe_s = load_timeout_s, probe_s
        self.refused: set[str] = set()
        identity.write(run_dir)
        done_path(run_dir).unlink(missing_ok=True)  # a resumed run takes engines again

    def close(self) -> None:
        """The run process ends (finished, failed or preempted): joined engines leave."""
        done_path(self.run_dir).touch()

    def registrations(self) -> dict[str, Path]:
        folder = joined_dir(self.run_dir)
        if not folder.is_dir():
            return {}
        return {p.stem: p for p in folder.glob("*.json") if p.name != RUN_FILE and not p.is_symlink()}

    def update(self, fleet: EngineFleet, version: int) -> bool:
        """Admit new registrations at weight `version`, mark engines whose registration is gone dead; whether the
        fleet's live engines changed."""
        present = self.registrations()
        changed = False
        for slot in list(fleet.slots):
            if slot.joined and slot.state == "live" and slot.joined not in present:
                fleet.mark_dead(slot, "its registration was removed (the engine's job left the run)")
                changed = True
        known = {s.joined for s in fleet.slots if s.joined}
        for engine_id, path in sorted(present.items()):
            if engine_id in known or engine_id in self.refused:
                continue
            changed |= self._admit(fleet, path, version)
        return changed

    def _admit(self, fleet: EngineFleet, path: Path, version: int) -> bool:
        try:
            reg = Registration.from_file(path)
        except (OSError, ValueError, KeyError, TypeError):
            return False  # removed meanwhile, or written by something else: looked at again next time
        why = reg.mismatch(self.identity)
        if why is not None:
            self.refused.add(reg.id)
            write_file_atomically(refusal_path(self.run_dir, reg.id), why.encode())
            self.on_event("engine_join_refused", {"engine": reg.id, "job_id": reg.job_id, "cause": why})
            return False
        client = EngineClient(reg.url, api_key=reg.token, timeout_s=self.load_timeout_s, max_retries=1)
        t0 = time.monotonic()
        try:
            held = client.weight_version(timeout_s=self.probe_s)
            if held != version:
                catch_up(
                    client, Path(self.identity.weights_dir), version, timeout_s=self.load_timeout_s,
                    engine_kind=self.engine_kind, run_dir=self.run_dir,
                )  # fmt: skip
                held = client.weight_version(timeout_s=self.probe_s)
        except Exception as exc:  # noqa: BLE001 - an engine that cannot be brought to the version does not join now
            self.on_event("engine_join_skipped", {"engine": reg.id, "cause": f"{type(exc).__name__}: {exc}"[:2000]})
            return False
        if held != version:
            self.on_event("engine_join_skipped", {"engine": reg.id, "cause": f"holds version {held}, not {version}"})
            return False
        fleet.add_joined(reg.id, client)
        self.on_event(
            "engine_joined",
            {"engine": reg.id, "url": reg.url, "job_id": reg.job_id, "host": reg.host, "version": version,
             "catch_up_s": round(time.monotonic() - t0, 3)},
        )  # fmt: skip
        return True


def this_identity(model_dir: Path, weights_dir: Path) -> RunIdentity:
    """The run's identity, with a fresh probe written into the weight directory (created if needed)."""
    weights_dir = weights_dir.absolute()
    weights_dir.mkdir(parents=True, exist_ok=True)
    nonce = write_probe(weights_dir)
    return RunIdentity(model_identity(model_dir), hpcrl.__version__, str(weights_dir), nonce)


PROBE_WAIT_S = 30.0
"""How long a process that sees the run's identity waits to see the probe too (a shared file system may show a
new file late); past it the weight directory is taken as not shared."""


class SharedCheck:
    """Whether this process sees the probe the run wrote into its weight directory, polled without blocking (an
    engine node's role checks it between its other duties). A requeued run rewrites RUN.json and the probe: the
    pair is read again until it agrees."""

    def __init__(self, run_dir: Path, *, probe_wait_s: float = PROBE_WAIT_S, newer_than: float | None = None) -> None:
        """`newer_than`: a wall-clock time; an announcement written before it is a previous run's (the engines of
        a job start before its driver announces the run) and is waited past."""
        self.run_dir, self.probe_wait_s, self.newer_than = run_dir, probe_wait_s, newer_than
        self.probe_deadline: float | None = None
        self.run: RunIdentity | None = None

    def poll(self) -> bool:
        """True once the probe is seen; False while the run has not announced itself or the probe may still show;
        DeltaDirNotShared (the directory, this node, the fix) once `probe_wait_s` passed after the announcement."""
        try:
            if self.newer_than is not None and (joined_dir(self.run_dir) / RUN_FILE).stat().st_mtime < self.newer_than:
                return False
            run = RunIdentity.read(self.run_dir)
        except (JoinError, OSError):
            return False
        if self.probe_deadline is None:
            self.probe_deadline = time.monotonic() + self.probe_wait_s
        try:
            check_probe(Path(run.weights_dir), run.probe_nonce)
        except DeltaDirNotShared:
            if time.monotonic() >= self.probe_deadline:
                raise
            return False
        self.run = run
        return True


def wait_shared(
    run_dir: Path, *, wait_s: float, probe_wait_s: float = PROBE_WAIT_S, poll_s: float = 0.5
) -> RunIdentity:
    """The run's identity once this process sees its probe (SharedCheck); JoinError when the run does not announce
    itself within `wait_s`."""
    deadline = time.monotonic() + wait_s
    check = SharedCheck(run_dir, probe_wait_s=probe_wait_s)
    while not check.poll():
        if check.probe_deadline is None and time.monotonic() >= deadline:
            RunIdentity.read(run_dir)  # raises the JoinError that names the missing file
        time.sleep(poll_s)
    assert check.run is not None
    return check.run


def job_id() -> str:
    return os.environ.get("SLURM_JOB_ID", "local")
