"""All engines of a run under supervision: health, death, bounded restarts, routing.

A monitor thread probes every engine each `health_interval_s` and watches its process:
- dead: the process exited or the connection is refused -> declared at the next probe (~1 s);
- hung: a live engine with no successful probe for `hung_after_s` (one failed probe is not death: /health
  can be slow during a long prefill) -> the process is killed and the engine is dead. An engine being
  (re)started is `starting`, not live: the launcher bounds that by the kind's start-up timeout instead
  (SGLang's port is silent for minutes while it starts).
The rollout stops waiting on a dead engine's requests and re-issues them, with the same seeds, to live
engines. At the next phase boundary `restart_dead()` restarts dead engines (at most `max_restarts` each); a
restarted engine is routable only after it has the current weights and version (radixark/miles#1724):
`restart_dead` returns the engines that need them and the caller pushes before the next rollout. When an
engine has used up its restarts, or no engine is left, `FleetError` names the engine, the cause and
its last log lines. No loop here retries without a bound.

Engines that join from a job of their own (hpcrl/engine/joined.py) are added with `add_joined` between steps and
are never restarted from here: a dead one has left (its requests re-issued like any dead engine's).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from hpcrl.engine.client import EngineClient
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.local import EngineStartError, LocalEngines, tail


class FleetError(RuntimeError):
    pass


@dataclass
class EngineSlot:
    index: int
    client: EngineClient
    state: str = "live"  # live | dead | starting (a restart under way) | gave_up | left (a joined engine gone)
    restarts: int = 0
    last_ok_s: float = field(default_factory=time.monotonic)
    died_s: float | None = None
    cause: str = ""
    lent: set[str] = field(default_factory=set)  # memory tags released to a colocated trainer
    joined: str = ""  # the registration id of an engine that joined from another job ("": one of the run's own)


EventFn = Callable[[str, dict[str, Any]], None]


class EngineFleet:
    def __init__(
        self, cfg: EngineConfig, clients: list[EngineClient], *, launcher: LocalEngines | None, on_event: EventFn
    ) -> None:
        self.cfg = cfg
        self.launcher = launcher  # None: engines started elsewhere (Slurm); they cannot be restarted from here
        self.slots = [EngineSlot(i, c) for i, c in enumerate(clients)]
        self.on_event = on_event
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.num_reissued = 0
        self.num_errors = 0
        self.num_joined = self.num_left = 0
        self._thread = threading.Thread(target=self._monitor, name="hpcrl-fleet", daemon=True)
        self._thread.start()

    # ----- views -----
    def live(self) -> list[EngineSlot]:
        with self._lock:
            return [s for s in self.slots if s.state == "live"]

    def pop_metrics(self) -> dict[str, float]:
        """The fleet's counters since the last call; reading them resets them (one row per step)."""
        live = float(len(self.live()))
        out = {
            "fleet/live_engines": live,
            "fleet/reissued_requests": float(self.num_reissued),
            "fleet/engine_errors": float(self.num_errors),
            "fleet/engines_live": live,
            "fleet/engines_joined": float(self.num_joined),
            "fleet/engines_left": float(self.num_left),
        }
        self.num_reissued = self.num_errors = self.num_joined = self.num_left = 0
        return out

    def add_joined(self, engine_id: str, client: EngineClient) -> EngineSlot:
        """A joined engine that serves the current weights: routable from the next request on."""
        with self._lock:
            slot = EngineSlot(len(self.slots), client, joined=engine_id)
            self.slots.append(slot)
        self.num_joined += 1
        return slot

    # ----- detection -----
    def _monitor(self) -> None:
        while not self._stop.wait(self.cfg.health_interval_s):
            for slot in self.live():
                self._probe(slot)

    def probe_all(self) -> None:
        """Probe every live engine now (after a failed push: find out who died)."""
        for slot in self.live():
            self._probe(slot)

    def _process_exit(self, slot: EngineSlot) -> int | None:
        if self.launcher is None or slot.joined:
            return None
        return self.launcher.exit_code(slot.index)

    def _probe(self, slot: EngineSlot) -> None:
        # A probe of a dying engine takes seconds (the client's retries); the slot may hold a restarted engine by
        # the time it ends, which its verdict must not reach (a second, needless restart; with a launcher, a kill).
        client = slot.client
        code = self._process_exit(slot)
        if code is not None:
            self.mark_dead(slot, f"process exited with code {code}", client=client)
            return
        try:
            ok = client.health(timeout_s=self.cfg.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 - classified below
            name = type(exc).__name__
            if name == "EngineUnreachableError" and "refused" in str(exc).lower():
                self.mark_dead(slot, f"connection refused: {exc}", client=client)
                return
            ok = False
        now = time.monotonic()
        if ok:
            slot.last_ok_s = now
        elif now - slot.last_ok_s > self.cfg.hung_after_s:
            self.mark_dead(slot, f"hung: no answer to /health for {now - slot.last_ok_s:.1f} s", client=client)

    def mark_dead(self, slot: EngineSlot, cause: str, *, client: EngineClient | None = None) -> None:
        """`client`: the engine the evidence is about; a slot that holds another one since (restarted) stays."""
        with self._lock:
            if slot.state != "live" or (client is not None and slot.client is not client):
                return
            slot.state, slot.died_s, slot.cause = "dead", time.monotonic(), cause
        silent_s = time.monotonic() - slot.last_ok_s
        if self.launcher is not None and not slot.joined:
            self.launcher.kill(slot.index)  # a hung engine must not linger
        self.num_errors += 1
        self.on_event(
            "engine_dead",
            {"engine": slot.index, "url": slot.client.url, "cause": cause, "seconds_since_last_ok": round(silent_s, 3)},
        )

    def report_failure(self, slot: EngineSlot, exc: BaseException, *, client: EngineClient | None = None) -> None:
        """A request failed: if the engine is gone, mark it dead now instead of at the next probe.

        `client`: the one the request went to. A request sent before a restart fails late, against the old
        process; the slot then holds the restarted engine, which must not be declared dead (and killed)."""
        self.num_errors += 1
        if self._process_exit(slot) is not None or type(exc).__name__ == "EngineUnreachableError":
            self.mark_dead(slot, f"request failed: {type(exc).__name__}: {exc}", client=client)

    def abort_all(self) -> None:
        """Abort every request on every live engine, each addressed directly: routers have not forwarded
        /abort_request (THUDM/slime PR #2340)."""
        for slot in self.live():
            try:
                slot.client.abort_request(abort_all=True, timeout_s=self.cfg.health_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the probe will classify that engine
                self.report_failure(slot, exc)

    # ----- colocated memory -----
    def release_memory(self, tags: list[str]) -> dict[str, float]:
        """Release `tags` on every live engine, one tag at a time, and check that each freed memory.

        `/release_memory_occupation` has silently freed nothing for some models (radixark/miles#860): a
        colocated trainer would then run out of memory much later, far from the cause. The embedded engine
        reports its freed bytes; for an engine that reports nothing the GPU's used memory (NVML) must drop.
        """
        freed_total = 0.0
        for slot in self.live():
            for tag in tags:
                before = _gpu_used_bytes()
                reply = slot.client.release_memory_occupation([tag])
                report = (reply or {}).get("freed_bytes")
                if isinstance(report, dict):  # an engine that reports what it freed; a missing tag freed nothing
                    freed: float | None = float(report.get(tag, 0))
                else:
                    freed = _drop(before, _gpu_used_bytes())
                if freed is not None and freed <= 0:
                    raise FleetError(
                        f"engine {slot.index} ({slot.client.url}): release_memory_occupation(['{tag}']) freed nothing "
                        "(radixark/miles#860); a colocated trainer would run out of memory: check the engine's "
                        "memory-saver support for this model, or run disaggregated"
                    )
                freed_total += freed or 0.0
                slot.lent.add(tag)
        return {"fleet/released_bytes": freed_total}

    def resume_memory(self, tags: list[str]) -> None:
        """Resume, on every live engine, those of `tags` it has released. An engine that fails here is
        reported (and marked dead when it is gone): restart_dead() restarts it with all its memory."""
        for slot in self.live():
            wanted = [t for t in tags if t in slot.lent]
            if not wanted:
                continue
            try:
                slot.client.resume_memory_occupation(wanted)
            except Exception as exc:
                self.report_failure(slot, exc)
                if slot.state == "live":
                    raise
                continue
            slot.lent.difference_update(wanted)

    # ----- recovery -----
    def restart_dead(self) -> list[EngineSlot]:
        """Restart dead engines (bounded); returns the restarted ones, which need the current weights."""
        restarted = []
        for slot in list(self.slots):
            if slot.state != "dead":
                continue
            if slot.joined:  # its own job started it and owns it: it has left the run
                self._left(slot)
                continue
            if self.launcher is None or slot.restarts >= self.cfg.max_restarts:
                self._give_up(slot)
            client = self._restart(slot)
            if client is None:
                self._give_up(slot)
            with self._lock:
                slot.client, slot.state, slot.last_ok_s = client, "live", time.monotonic()
                slot.lent = set()  # a fresh process holds all its memory
            restarted.append(slot)
        if not self.live():
            raise FleetError("no engine is left: " + "; ".join(f"engine {s.index}: {s.cause}" for s in self.slots))
        return restarted

    def _left(self, slot: EngineSlot) -> None:
        with self._lock:
            slot.state = "left"
        self.num_left += 1
        self.on_event("engine_left", {"engine": slot.joined, "url": slot.client.url, "cause": slot.cause})

    def _restart(self, slot: EngineSlot) -> EngineClient | None:
        """Up to the remaining restarts of this engine; None when none of them brought it up."""
        assert self.launcher is not None
        while slot.restarts < self.cfg.max_restarts:
            slot.restarts += 1
            t0 = time.monotonic()
            with self._lock:
                slot.state = "starting"  # the monitor probes live engines only: a start is never a hang
            try:
                client = self.launcher.restart(slot.index)
            except EngineStartError as exc:
                slot.cause = f"restart {slot.restarts} failed: {exc}"
                self.on_event("engine_restart_failed", {"engine": slot.index, "cause": str(exc)[:2000]})
                continue
            self.on_event(
                "engine_restarted",
                {"engine": slot.index, "restarts": slot.restarts, "start_s": round(time.monotonic() - t0, 3)},
            )
            return client
        return None

    def _give_up(self, slot: EngineSlot) -> NoReturn:
        slot.state = "gave_up"
        log = tail(self.launcher.log_path(slot.index)) if self.launcher else "(log on the engine's node)"
        self.on_event("engine_gave_up", {"engine": slot.index, "restarts": slot.restarts, "cause": slot.cause})
        raise FleetError(
            f"engine {slot.index} ({slot.client.url}) gave up after {slot.restarts} restart(s) "
            f"(engine.max_restarts={self.cfg.max_restarts}); cause: {slot.cause}; last log lines:\n{log}"
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _gpu_used_bytes() -> int | None:
    """Used memory of GPU 0 of this node through NVML, None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # noqa: BLE001 - no NVML on this node: nothing to measure with
        return None


def _drop(before: int | None, after: int | None) -> float | None:
    return None if before is None or after is None else float(before - after)
