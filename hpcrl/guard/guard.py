"""ThermalGuard: watch the node's GPUs in a background thread, hold the run while one is too hot.

Built by the run (hpcrl/run/run.py `Run`) after the engines start; the driver calls `guard.wait_until_cool(step)` at
the top of every step and merges `guard.metrics()` into the step's row.

How a pause works
1. The polling thread feeds every reading to ThermalPolicy. On `pause` it only records the pause: work
   stops cooperatively at the next phase boundary, where `wait_until_cool` pauses the engines
   (`pause_generation(mode="in_place")`), blocks until the policy resumes, then `continue_generation`.
   Engine pause/continue calls are made from the driver thread only, because WeightSync pauses and
   continues the same engines around a weight push and the two must never interleave.
2. On `escalate` (a GPU still at or above its threshold `stop_after_s` into the pause, e.g. because a
   long phase has not reached a boundary yet) the thread SIGSTOPs the local worker processes: the engine
   servers (their process groups) and the trainer follower ranks. Rank 0 (this process) is not stopped:
   it blocks by itself on the first HTTP call or collective that needs a stopped worker. On `resume` the
   thread sends SIGCONT first, then wakes the driver.
3. On `overheat` (a pause reached `max_pause_s`) the thread sends SIGCONT and `wait_until_cool` raises
   ThermalGuardError: the run stops non-zero and resumes from its last checkpoint when rerun.

Cross-rank coordination (why one hot GPU cannot make another rank or the driver time out)
- Rank 0's driver loop is the only place that decides phases; the guard lives in rank 0 and holds the
  loop there. Trainer followers never look at temperatures: they wait in the broadcast of the next train
  command (`hpcrl.trainer.ranks._recv`), whose timeout is sync.group_timeout_s. Engines are servers and
  wait for requests without any timeout.
- Every wait a pause can add is bounded by max_pause_s: the driver's boundary wait ends at resume or at
  max_pause_s (then the run stops), and SIGSTOPped workers get SIGCONT by then too. A generate call or a
  weight-push call waiting on a stopped engine, and a collective waiting on a stopped follower, therefore
  waits at most max_pause_s longer than usual. RunConfig checks sync.group_timeout_s > max_pause_s and
  rollout.request_timeout_s > max_pause_s, so no such wait times out. Keep headroom above the usual work
  of a step: a follower's broadcast wait spans everything rank 0 does between two train phases.
- Across nodes (Slurm), each node's guard holds only its local workers; the job's driver (rank 0 of the
  trainer) is still the one place that decides phases, so a pause on any node shows up at the driver as
  a slower HTTP call or collective, bounded the same way.

Thread safety: MetricsWriter is not thread-safe, so the polling thread only queues events and messages;
the driver thread writes them (through `on_event`, i.e. MetricsWriter.event, with the decision's own
time) in `wait_until_cool`, `metrics` and `stop`.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from hpcrl.guard.config import GuardConfig
from hpcrl.guard.policy import Decision, ThermalPolicy
from hpcrl.guard.source import Sample, TemperatureSource


class ThermalGuardError(RuntimeError):
    """A GPU did not cool within guard.max_pause_s, or the guard's thread failed; the run must stop."""


class PausableEngine(Protocol):
    def pause_generation(self, mode: Any = ..., *, timeout_s: float | None = None) -> Any: ...

    def continue_generation(self, torch_empty_cache: bool = ..., *, timeout_s: float | None = None) -> Any: ...


class EventSink(Protocol):
    def __call__(self, kind: str, *, step: int | None, detail: Mapping[str, Any], time_s: float) -> None: ...


class Guard(Protocol):
    """What the driver and the session use; ThermalGuard and OffGuard implement it."""

    def wait_until_cool(self, step: int | None) -> None: ...

    def metrics(self) -> dict[str, float]: ...

    def stop(self) -> None: ...


class OffGuard:
    """No guard (mode off, or auto without NVML): every call returns at once, no metrics."""

    def wait_until_cool(self, step: int | None) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def stop(self) -> None:
        pass


def signal_workers(pids: Sequence[int], sig: int) -> list[int]:
    """Sends `sig` to each worker (its whole process group when it leads one); returns the pids reached."""
    reached = []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            # Engines run in their own session (so their helpers stop with them); followers share ours.
            if os.getpgid(pid) == pid and pid != os.getpgrp():
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            continue  # already exited: nothing to stop or continue
        reached.append(pid)
    return reached


# A stopped worker cannot run its own parent watch: if this process dies (SIGKILL) during an escalated
# pause, this helper (started before the SIGSTOP, killed at SIGCONT) continues the workers so they notice
# their parent is gone and exit instead of staying stopped with their ports and memory.
_CONTINUE_ON_EXIT = """
import os, signal, sys, time
parent, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
while os.getppid() == parent:
    time.sleep(0.2)
for pid in pids:
    try:
        os.killpg(pid, signal.SIGCONT) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
"""


def _start_continue_on_exit(pids: Sequence[int]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-S", "-c", _CONTINUE_ON_EXIT, str(os.getpid()), *map(str, pids)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


class ThermalGuard:
    def __init__(
        self,
        cfg: GuardConfig,
        source: TemperatureSource,
        *,
        say: Callable[[str], None] = print,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> None:
        """Checks the thresholds against the source's GPUs (ValueError); `start` attaches the workers."""
        self.cfg = cfg
        self.source = source
        self.engines: list[PausableEngine] = []
        self.pids: list[int] = []
        self.on_event: EventSink | None = None
        self.say = say
        self.interrupted = interrupted
        self.node = socket.gethostname()
        self.policy = ThermalPolicy(cfg, {g.index: g.slowdown_c for g in source.gpus()})
        # An engine stopped by escalation answers only after SIGCONT, which comes within max_pause_s.
        self._engine_timeout_s = cfg.max_pause_s + 30.0
        self._cond = threading.Condition()  # an RLock inside: helpers may nest
        self._stop_event = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcrl-thermal-guard", daemon=True)
        self._t0 = 0.0
        self._wall0 = 0.0
        self._step: int | None = None
        self._paused = False
        self._escalated = False
        self._escalated_t_s: float | None = None
        self._stopped: list[int] = []
        self._helper: subprocess.Popen[bytes] | None = None
        self._error: BaseException | None = None
        self._pending: list[tuple[str, Any]] = []
        self._holds = 0
        self._hold_since = 0.0
        self._held_s = 0.0
        self._peaks: dict[int, float] = {}
        self._last: dict[int, float] = {}

    # ----- lifecycle -----
    def start(
        self,
        *,
        engines: Sequence[PausableEngine] = (),
        pids: Sequence[int] = (),
        on_event: EventSink | None = None,
    ) -> ThermalGuard:
        """Starts polling. `engines` are paused at boundaries, `pids` (local worker processes) stopped on
        escalation, `on_event` (e.g. MetricsWriter.event) receives thermal_* events in the driver thread."""
        self.engines, self.pids, self.on_event = list(engines), list(pids), on_event
        gpus = ", ".join(
            f"{g.index}" + (f" (slowdown {g.slowdown_c:g} °C)" if g.slowdown_c else "") for g in self.source.gpus()
        )
        warmup_c = min(self.cfg.warmup_hot_c, self.cfg.hot_c)
        warmup = (
            f" ({warmup_c:g} °C for the first {self.cfg.warmup_s:g} s)"
            if self.cfg.warmup_s and warmup_c < self.cfg.hot_c
            else ""
        )
        self.say(
            f"thermal guard on ({self.source.name}): GPU {gpus}; pause at {self.cfg.hot_c:g} °C{warmup}, "
            f"resume at {self.cfg.cool_c:g} °C"
        )
        self._t0, self._wall0 = time.monotonic(), time.time()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops polling, continues any stopped worker, writes what is still queued. Safe to call twice."""
        self._stop_event.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.cfg.poll_s + 10.0)
        self._release_workers()
        self._flush()
        self.source.close()

    # ----- driver thread -----
    def wait_until_cool(self, step: int | None) -> None:
        """Phase boundary: returns at once unless paused; while paused, holds the engines and blocks until
        the GPUs have cooled. `step` is the GRPO step about to run (None outside the GRPO loop, e.g. SFT)."""
        with self._cond:
            if step is not None and self._step is None:
                self._held_s = 0.0  # holds before the GRPO loop (SFT) are in the events, not in step 0's row
            self._step = step
            paused = self._paused
        self._flush()
        self._raise_if_failed()
        if not paused or self.interrupted():
            return
        self._each_engine(lambda e: e.pause_generation("in_place", timeout_s=self._engine_timeout_s))
        self._hold(+1)
        try:
            with self._cond:
                # Wake every poll interval: a preemption signal must not wait for the GPU to cool.
                while self._paused and self._error is None and not self.interrupted():
                    self._cond.wait(timeout=self.cfg.poll_s)
                    if not self._thread.is_alive() and self._error is None:
                        self._error = ThermalGuardError("the thermal guard's polling thread stopped unexpectedly")
        finally:
            self._hold(-1)
            self._flush()
        self._raise_if_failed()
        self._each_engine(lambda e: e.continue_generation(timeout_s=self._engine_timeout_s))

    def metrics(self) -> dict[str, float]:
        """This step's `guard/paused_s` (seconds work was held: boundary wait or workers stopped) and
        `guard/peak_temp_c/<gpu>` (hottest reading since the last call, else the last reading)."""
        self._flush()
        with self._cond:
            now = time.monotonic()
            held = self._held_s + (now - self._hold_since if self._holds else 0.0)
            self._held_s, self._hold_since = 0.0, now
            peaks = {g: self._peaks.get(g, t) for g, t in self._last.items()}
            self._peaks = {}
        return {"guard/paused_s": held, **{f"guard/peak_temp_c/{g}": t for g, t in sorted(peaks.items())}}

    def _each_engine(self, call: Callable[[PausableEngine], Any]) -> None:
        for engine in self.engines:
            call(engine)

    def _raise_if_failed(self) -> None:
        with self._cond:
            error = self._error
        if error is not None:
            if isinstance(error, ThermalGuardError):
                raise error
            raise ThermalGuardError(f"the thermal guard's polling thread failed: {error!r}") from error

    def _flush(self) -> None:
        with self._cond:
            pending, self._pending = self._pending, []
        for what, item in pending:
            if what == "say":
                self.say(item)
            elif self.on_event is not None:
                kind, step, detail, time_s = item
                self.on_event(kind, step=step, detail=detail, time_s=time_s)

    # ----- polling thread -----
    def _run(self) -> None:
        try:
            while not self._stop_event.is_set():
                for sample in self.source.read(time.monotonic() - self._t0):
                    self._on_sample(sample)
                if self.interrupted():
                    self._release_workers()  # a preempted run must reach its checkpoint
                self._stop_event.wait(self.cfg.poll_s)
        except BaseException as exc:  # noqa: BLE001 - handed to the driver thread, which raises it
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            self._release_workers()

    def _on_sample(self, sample: Sample) -> None:
        with self._cond:
            for gpu, temp in sample.temperature_c.items():
                self._peaks[gpu] = max(self._peaks.get(gpu, -math.inf), temp)
                self._last[gpu] = temp
        for decision in self.policy.update(sample.t_s, sample.temperature_c):
            getattr(self, f"_on_{decision.kind}")(decision)

    def _on_pause(self, d: Decision) -> None:
        warmup = d.t_s < self.cfg.warmup_s
        with self._cond:
            self._paused, self._escalated, self._escalated_t_s = True, False, None
            self._queue_say(
                f"thermal pause: GPU {d.gpu} on {self.node} at {d.temperature_c:g} °C >= {d.threshold_c:g} °C"
                f"{' (warmup threshold)' if warmup else ''}; work holds at the next phase boundary until every "
                f"GPU is <= {self.cfg.cool_c:g} °C"
            )
            self._queue_event("thermal_pause", d, {"threshold_c": d.threshold_c, "warmup": warmup})

    def _on_escalate(self, d: Decision) -> None:
        if self.interrupted():
            return
        helper = _start_continue_on_exit(self.pids)
        stopped = signal_workers(self.pids, signal.SIGSTOP)
        with self._cond:
            self._stopped, self._escalated, self._escalated_t_s = stopped, True, d.t_s
            self._helper = helper
            if stopped:
                self._hold(+1)
            self._queue_say(
                f"thermal pause: GPU {d.gpu} still at {d.temperature_c:g} °C after {d.duration_s:.1f} s; "
                f"stopped {len(stopped)} worker process(es) (SIGSTOP) until it cools"
            )

    def _on_resume(self, d: Decision) -> None:
        continued = self._release_workers()
        with self._cond:
            escalated = self._escalated
            self._queue_say(
                f"thermal resume: every GPU <= {d.threshold_c:g} °C (hottest GPU {d.gpu}: {d.temperature_c:g} °C) "
                f"after {d.duration_s:.2f} s{'; worker processes continued (SIGCONT)' if escalated else ''}"
            )
            self._queue_event(
                "thermal_resume",
                d,
                {
                    "threshold_c": d.threshold_c,
                    "duration_s": d.duration_s,
                    "escalated": escalated,
                    "escalated_t_s": self._escalated_t_s,
                    "stopped_pids": continued,
                },
            )
            self._paused = False
            self._cond.notify_all()

    def _on_overheat(self, d: Decision) -> None:
        continued = self._release_workers()
        message = (
            f"GPU {d.gpu} on {self.node} did not cool to guard.cool_c={self.cfg.cool_c:g} °C within "
            f"guard.max_pause_s={self.cfg.max_pause_s:g} s of pause (now {d.temperature_c:g} °C): its cooling cannot "
            "keep up with this load. Check the fans, the airflow and other jobs on the GPU, then rerun the same "
            "command to resume from the last checkpoint; to wait longer, raise guard.max_pause_s together with "
            "sync.group_timeout_s and rollout.request_timeout_s"
        )
        with self._cond:
            self._queue_event(
                "thermal_overheat",
                d,
                {"threshold_c": d.threshold_c, "duration_s": d.duration_s, "stopped_pids": continued},
            )
            self._error = ThermalGuardError(message)
            self._cond.notify_all()

    # ----- shared helpers -----
    def _release_workers(self) -> list[int]:
        with self._cond:
            stopped, self._stopped = self._stopped, []
            helper, self._helper = self._helper, None
            if stopped:
                signal_workers(stopped, signal.SIGCONT)
                self._hold(-1)
        if helper is not None:
            helper.kill()
            helper.wait()
        return stopped

    def _hold(self, delta: int) -> None:
        """Counts what holds work (the driver's boundary wait, stopped workers); time with any hold is paused."""
        with self._cond:
            now = time.monotonic()
            if self._holds == 0 and delta > 0:
                self._hold_since = now
            self._holds += delta
            if self._holds == 0:
                self._held_s += now - self._hold_since

    def _queue_say(self, message: str) -> None:
        self._pending.append(("say", message))

    def _queue_event(self, kind: str, d: Decision, extra: Mapping[str, Any]) -> None:
        detail = {"node": self.node, "gpu": d.gpu, "temperature_c": d.temperature_c, "t_s": d.t_s, **extra}
        self._pending.append(("event", (kind, self._step, detail, self._wall0 + d.t_s)))
