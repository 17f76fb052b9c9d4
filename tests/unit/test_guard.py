"""The thermal guard: the policy's exact transitions, trace files, and recorded traces driving real runs.

No NVML here: temperatures come from traces (the recorded-trace source), so every decision time is a
reading time from the trace and can be asserted exactly.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpcrl.config import ConfigError
from hpcrl.guard import (
    Decision,
    GuardConfig,
    ThermalGuard,
    ThermalGuardError,
    ThermalPolicy,
    TraceError,
    TraceSource,
    TraceWriter,
    open_source,
)
from hpcrl.guard.source import GpuInfo, Sample, nvidia_gpus_present
from hpcrl.run_config import load_run_config
from hpcrl.store import load_events, load_metrics

REPO = Path(__file__).resolve().parents[2]


def nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - library missing or no driver: both mean no NVML
        return False


no_nvml = pytest.mark.skipif(nvml_available(), reason="tests the path of a machine without NVML")


def cfg(**kw: Any) -> GuardConfig:
    base: dict[str, Any] = {"warmup_s": 0.0, "min_pause_s": 0.0, "stop_after_s": 5.0, "max_pause_s": 20.0}
    return GuardConfig(**(base | kw))


def feed(policy: ThermalPolicy, readings: list[tuple[float, list[float]]]) -> list[Decision]:
    out = []
    for t_s, temps in readings:
        out += policy.update(t_s, dict(enumerate(temps)))
    return out


def kinds_at(decisions: list[Decision]) -> list[tuple[str, float]]:
    return [(d.kind, d.t_s) for d in decisions]


# ----- policy -----------------------------------------------------------------------------------


def test_rise_past_threshold_pauses_at_the_first_reading_over_it_and_resumes_at_cool() -> None:
    policy = ThermalPolicy(cfg(), {0: None})
    d = feed(policy, [(0, [70]), (1, [83.9]), (2, [84]), (3, [80]), (4, [72.5]), (5, [72]), (6, [83])])
    assert d == [
        Decision("pause", 2, 0, 84, 84),
        Decision("resume", 5, 0, 72, 72, duration_s=3),
    ]
    assert not policy.paused


def test_oscillation_around_the_threshold_gives_one_pause_and_min_pause_holds_it() -> None:
    policy = ThermalPolicy(cfg(min_pause_s=4), {0: None})
    # Around hot_c: one pause, not one per crossing. Around cool_c: no resume before min_pause_s.
    d = feed(policy, [(0, [83]), (1, [85]), (2, [83]), (3, [85]), (4, [71]), (5, [73]), (6, [71]), (7, [85])])
    assert kinds_at(d) == [("pause", 1), ("resume", 6), ("pause", 7)]
    assert d[1].duration_s == 5


def test_warmup_threshold_applies_before_warmup_s_only() -> None:
    policy = ThermalPolicy(cfg(warmup_s=10, warmup_hot_c=80, hot_c=84), {0: None})
    assert policy.threshold_c(0, 9.99) == 80 and policy.threshold_c(0, 10) == 84
    d = feed(policy, [(0, [79]), (5, [80]), (6, [70]), (10, [83]), (11, [84])])
    assert d == [
        Decision("pause", 5, 0, 80, 80),
        Decision("resume", 6, 0, 70, 72, duration_s=1),
        Decision("pause", 11, 0, 84, 84),
    ]


def test_threshold_is_capped_under_the_gpus_slowdown_threshold() -> None:
    policy = ThermalPolicy(cfg(margin_c=5), {0: 95.0, 1: 86.0, 2: None})
    assert [policy.threshold_c(g, 0) for g in range(3)] == [84, 81, 84]
    assert feed(policy, [(0, [83, 81, 60])]) == [Decision("pause", 0, 1, 81, 81)]
    with pytest.raises(ValueError, match=r"GPU 0 slows itself down at 76 °C.*lower guard.cool_c or guard.margin_c"):
        ThermalPolicy(cfg(margin_c=5), {0: 76.0})


def test_resume_waits_for_every_gpu_and_a_missing_reading_keeps_the_last_one() -> None:
    policy = ThermalPolicy(cfg(), {0: None, 1: None})
    d = []
    d += policy.update(0, {0: 90, 1: 60})
    d += policy.update(1, {0: 70})  # GPU 1 unread: still 60, GPU 0 cool -> resume
    d += policy.update(2, {1: 85})
    d += policy.update(3, {0: 60})  # GPU 1 still 85
    d += policy.update(4, {1: 72})
    assert kinds_at(d) == [("pause", 0), ("resume", 1), ("pause", 2), ("resume", 4)]
    assert d[2].gpu == 1 and (d[3].gpu, d[3].temperature_c) == (1, 72)  # the hottest GPU at resume


def test_a_gpu_that_stays_hot_escalates_once_then_overheats_at_max_pause() -> None:
    policy = ThermalPolicy(cfg(stop_after_s=5, max_pause_s=20), {0: None})
    d = feed(policy, [(0.0, [85]), (4.9, [90]), (5.0, [91]), (10.0, [92]), (19.9, [80]), (20.0, [80]), (21.0, [60])])
    assert d == [
        Decision("pause", 0, 0, 85, 84),
        Decision("escalate", 5, 0, 91, 84, duration_s=5),
        Decision("overheat", 20, 0, 80, 72, duration_s=20),
    ]
    assert policy.overheated


def test_escalation_only_while_still_over_the_threshold() -> None:
    policy = ThermalPolicy(cfg(stop_after_s=1.2), {0: None})
    # Times from decimal text: 1.3 - 0.1 is 1.2000000000000002 in binary, still exactly stop_after_s here.
    d = feed(policy, [(0.1, [84]), (1.3, [80]), (1.4, [84]), (1.5, [86]), (2.0, [72])])
    assert kinds_at(d) == [("pause", 0.1), ("escalate", 1.4), ("resume", 2.0)]
    assert d[1].duration_s == 1.3 and d[2].duration_s == 1.9


def test_guard_config_is_validated() -> None:
    with pytest.raises(ValueError, match="cool_c .* must be below the pause threshold"):
        GuardConfig(cool_c=80)
    with pytest.raises(ValueError, match="stop_after_s .* must be below guard.max_pause_s"):
        GuardConfig(stop_after_s=200)
    with pytest.raises(ValueError, match="poll_s must be > 0"):
        GuardConfig(poll_s=0)
    with pytest.warns(UserWarning, match="no effect with guard.mode=off"):
        GuardConfig(mode="off", trace="x.jsonl")
    # A hot_c under the warmup threshold lowers the warmup threshold too.
    assert ThermalPolicy(GuardConfig(hot_c=78), {}).threshold_c(0, 0) == 78


def test_run_config_timeouts_must_outlast_the_longest_pause() -> None:
    qs = REPO / "experiments" / "quickstart.yaml"
    with pytest.raises(ConfigError, match=r"sync.group_timeout_s=300 must be longer than guard.max_pause_s=300"):
        load_run_config(qs, ["guard.max_pause_s=300"])
    with pytest.raises(ConfigError, match=r"rollout.request_timeout_s=100 must be longer than guard.max_pause_s"):
        load_run_config(qs, ["rollout.request_timeout_s=100"])
    assert load_run_config(qs, ["guard.mode=off", "rollout.request_timeout_s=100"]).guard.mode == "off"


# ----- traces -----------------------------------------------------------------------------------


def write_trace(path: Path, gpus: list[dict[str, Any]], readings: list[tuple[float, list[float]]]) -> Path:
    lines = [json.dumps({"hpcrl_trace": 1, "node": "test", "source": "hand-written", "gpus": gpus})]
    lines += [json.dumps({"t_s": t, "temperature_c": temps}) for t, temps in readings]
    path.write_text("# a hand-written trace\n" + "\n".join(lines) + "\n")
    return path


def test_trace_replays_each_reading_once_its_time_has_come(tmp_path: Path) -> None:
    src = TraceSource(
        write_trace(tmp_path / "t.jsonl", [{"index": 0}], [(0, [50]), (0.5, [60]), (0.5, [61]), (2, [70])])
    )
    assert [s.t_s for s in src.read(0.49)] == [0]
    assert [s.temperature_c for s in src.read(1.0)] == [{0: 60}, {0: 61}]
    assert src.read(1.5) == [] and not src.done
    assert [s.t_s for s in src.read(99)] == [2] and src.done


def test_trace_writer_round_trips(tmp_path: Path) -> None:
    gpus = [GpuInfo(0, "A", slowdown_c=90, shutdown_c=95), GpuInfo(3, "B")]
    writer = TraceWriter(tmp_path / "rec.jsonl", gpus, source="nvml", interval_s=1.0)
    writer.write(Sample(0.0, {0: 40.0, 3: 41.0}, {0: 100.04, 3: 90.0}, {0: ("gpu_idle",)}))
    writer.write(Sample(1.0004, {3: 50.0}))
    writer.close()
    src = TraceSource(tmp_path / "rec.jsonl")
    assert src.gpus() == gpus
    a, b = src.read(10)
    assert a == Sample(0.0, {0: 40.0, 3: 41.0}, {0: 100.0, 3: 90.0}, {0: ("gpu_idle",), 3: ()})
    assert (b.t_s, b.temperature_c) == (1.0, {3: 50.0})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"t_s": 0, "temperature_c": [1]}', r"t.jsonl:1: the first record must be the header"),
        ('{"hpcrl_trace": 1, "gpus": [{"index": 0}]}\n{"t_s": 1, "temperature_c": [1]}\n{"t_s": 0.5, '
         '"temperature_c": [1]}', r"t.jsonl:3: t_s=0.5 is before the previous reading's t_s=1"),
        ('{"hpcrl_trace": 1, "gpus": [{"index": 0}]}\n{"t_s": 0, "temperature_c": [1, 2]}',
         r"t.jsonl:2: \"temperature_c\" must be a list with one entry per GPU of the header \(1\)"),
        ('{"hpcrl_trace": 1, "gpus": [{"index": 0}]}\nnot json', r"t.jsonl:2: not a JSON object"),
        ('{"hpcrl_trace": 1, "gpus": [{"index": 0}]}', r"holds a header but no readings"),
    ],
)  # fmt: skip
def test_bad_trace_files_name_the_line_and_the_problem(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "t.jsonl").write_text(text + "\n")
    with pytest.raises(TraceError, match=match):
        TraceSource(tmp_path / "t.jsonl")


@pytest.mark.parametrize("path", sorted((REPO / "tests" / "data").glob("guard_nvml_*.jsonl")), ids=lambda p: p.name)
def test_committed_traces_replay(path: Path) -> None:
    """Traces recorded on real GPUs (tools/gpu/guard_nvml.py) stay readable, and the policy runs on them."""
    src = TraceSource(path)
    policy = ThermalPolicy(GuardConfig(), {g.index: g.slowdown_c for g in src.gpus()})
    samples = src.read(float("inf"))
    assert samples and all(0 < t < 130 for s in samples for t in s.temperature_c.values())
    for s in samples:
        policy.update(s.t_s, s.temperature_c)


# ----- the guard in this process ------------------------------------------------------------------


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_guard_stops_workers_then_stops_the_run_when_a_gpu_never_cools(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "hot.jsonl", [{"index": 0}], [(i / 10, [90 + i / 10]) for i in range(31)])
    c = cfg(poll_s=0.02, stop_after_s=0.2, max_pause_s=0.5)
    events: list[tuple[str, int | None, dict[str, Any]]] = []
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        guard = ThermalGuard(c, TraceSource(trace), say=lambda m: None).start(
            pids=[worker.pid], on_event=lambda kind, *, step, detail, time_s: events.append((kind, step, detail))
        )
        with pytest.raises(ThermalGuardError, match=r"did not cool to guard.cool_c=72 °C within guard.max_pause_s"):
            for step in itertools.count():
                guard.wait_until_cool(step)
                time.sleep(0.01)
        # SIGCONT comes before the error: the worker is never left stopped.
        assert process_state(worker.pid) != "T"
        assert guard.metrics()["guard/paused_s"] > 0
        guard.stop()
    finally:
        worker.kill()
        worker.wait()
    assert [(k, d["t_s"]) for k, _, d in events] == [("thermal_pause", 0.0), ("thermal_overheat", 0.5)]
    assert events[1][2]["stopped_pids"] == [worker.pid] and events[1][2]["duration_s"] == 0.5


KILLED_DRIVER = """
import os, signal, sys, time
from hpcrl.guard import GuardConfig, ThermalGuard, TraceSource
cfg = GuardConfig(warmup_s=0, poll_s=0.02, min_pause_s=0, stop_after_s=0.1, max_pause_s=30)
ThermalGuard(cfg, TraceSource(sys.argv[1])).start(pids=[int(sys.argv[2])])
while open(f"/proc/{sys.argv[2]}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_stopped_by_a_driver_that_is_killed_are_continued(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "hot.jsonl", [{"index": 0}], [(i / 10, [90]) for i in range(300)])
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        driver = subprocess.run([sys.executable, "-c", KILLED_DRIVER, str(trace), str(worker.pid)], timeout=60)
        assert driver.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 30  # a hang guard, not a timing requirement
        while process_state(worker.pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(worker.pid) != "T"
    finally:
        worker.kill()
        worker.wait()


# ----- real runs ----------------------------------------------------------------------------------

RUN = [
    "sft.num_steps=0",
    "data.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "checkpoint.every_steps=100",
]
# Two GPUs; GPU 1 slows down at 88 °C, so with margin 5 it pauses at 83 °C. Warmup (80 °C) until t=1.0.
GPUS = [{"index": 0, "name": "A", "slowdown_c": 95, "shutdown_c": 100}, {"index": 1, "name": "B", "slowdown_c": 88}]
READINGS = [
    (0.0, [60, 60]),
    (0.1, [81, 60]),  # over the warmup threshold: pause
    (0.2, [79, 60]),  # oscillates around the threshold: still one pause
    (0.3, [81, 60]),
    (0.4, [73, 60]),  # under hot, over cool: still paused
    (0.5, [72, 60]),  # <= cool_c and min_pause_s (0.3) passed: resume
    (0.6, [80, 60]),  # warmup threshold again: pause
    (0.7, [70, 60]),  # cool, but min_pause_s not passed
    (0.8, [70, 60]),
    (0.9, [70, 60]),  # resume
    (1.0, [82, 82]),  # after warmup: 84 °C (GPU 0) and 83 °C (GPU 1, capped) -> no pause
    (1.1, [83, 83]),  # GPU 1 at its capped threshold: pause
    (1.2, [84, 85]),
    (1.5, [86, 86]),  # still over after stop_after_s (0.4): SIGSTOP the engine and the follower rank
    (2.0, [70, 70]),  # resume (SIGCONT)
    (2.1, [60, 60]),
]
GUARD = [
    "guard.mode=on",
    "guard.poll_s=0.02",
    "guard.warmup_s=1.0",
    "guard.min_pause_s=0.3",
    "guard.stop_after_s=0.4",
    "guard.max_pause_s=20",
]


def hpcrl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def workdir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    text = (REPO / "experiments" / "quickstart.yaml").read_text()
    (tmp_path / "qs.yaml").write_text(text.replace("path: runs/models/tiny-qwen3", f"path: {tiny_model_dir}"))
    return tmp_path


def test_a_replayed_trace_pauses_a_real_run_exactly_as_the_policy_says(workdir: Path) -> None:
    trace = write_trace(workdir / "trace.jsonl", GPUS, READINGS)
    # Enough steps that the loop still runs when the last pause begins: only ~0.4 s of the trace before it
    # is unpaused, and a step takes well over 0.01 s; later steps run after the trace has ended.
    num_steps = 40
    out = hpcrl("run", "qs.yaml", *RUN, f"num_steps={num_steps}", "train.num_ranks=2", *GUARD,
                f"guard.trace={trace}", "--run-dir", "r", cwd=workdir)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    events = [e for e in load_events(workdir / "r" / "metrics.h5") if e["kind"].startswith("thermal_")]
    got = [(e["kind"], e["detail"]["t_s"], e["detail"]["gpu"], e["detail"]["temperature_c"]) for e in events]
    assert got == [
        ("thermal_pause", 0.1, 0, 81),
        ("thermal_resume", 0.5, 0, 72),
        ("thermal_pause", 0.6, 0, 80),
        ("thermal_resume", 0.9, 0, 70),
        ("thermal_pause", 1.1, 1, 83),
        ("thermal_resume", 2.0, 0, 70),
    ]
    pauses, resumes = [e["detail"] for e in events[::2]], [e["detail"] for e in events[1::2]]
    assert [(p["threshold_c"], p["warmup"]) for p in pauses] == [(80, True), (80, True), (83, False)]
    assert [(r["duration_s"], r["escalated"], r["escalated_t_s"]) for r in resumes] == [
        (0.4, False, None),
        (0.3, False, None),
        (0.9, True, 1.5),
    ]
    assert len(resumes[2]["stopped_pids"]) == 2  # the engine and the trainer follower, continued at resume
    assert all(e["detail"]["node"] == socket.gethostname() for e in events)
    # The same decisions as the pure policy over the same readings.
    policy = ThermalPolicy(GuardConfig(poll_s=0.02, warmup_s=1.0, min_pause_s=0.3, stop_after_s=0.4, max_pause_s=20),
                           {g["index"]: g.get("slowdown_c") for g in GPUS})  # fmt: skip
    expected = [d for t, temps in READINGS for d in policy.update(t, dict(enumerate(temps)))]
    assert [(d.t_s, d.gpu, d.temperature_c) for d in expected if d.kind != "escalate"] == [g[1:] for g in got]
    m = load_metrics(workdir / "r" / "metrics.h5")
    assert list(m["step"]) == list(range(num_steps))
    assert (m["guard/paused_s"] >= 0).all() and m["guard/paused_s"].sum() > 0  # the loop did wait
    assert np.nanmax(m["guard/peak_temp_c/0"]) == 86 and np.nanmax(m["guard/peak_temp_c/1"]) == 86
    assert "stopped 2 worker process(es) (SIGSTOP)" in out.stdout and out.stdout.count("thermal resume") == 3


@no_nvml
@pytest.mark.skipif(nvidia_gpus_present(), reason="tests a CPU-only machine")
def test_cpu_run_says_nothing_about_nvml(workdir: Path) -> None:
    out = hpcrl("run", "qs.yaml", *RUN, "num_steps=1", "--run-dir", "r", cwd=workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    said = (out.stdout + out.stderr).lower()
    assert "nvml" not in said and "guard" not in said, said
    assert not any(k.startswith("guard/") for k in load_metrics(workdir / "r" / "metrics.h5"))


@no_nvml
def test_without_nvml_auto_warns_once_where_gpus_are_present() -> None:
    said: list[str] = []
    assert open_source(GuardConfig(), warn=said.append, gpus_present=lambda: True) is None
    assert len(said) == 1 and said[0].startswith("warning: thermal guard off: NVML is not available"), said
    said.clear()
    assert open_source(GuardConfig(), warn=said.append, gpus_present=lambda: False) is None
    assert said == []  # a CPU-only machine: nothing to watch, nothing to say


@no_nvml
def test_without_nvml_mode_on_is_an_error(workdir: Path) -> None:
    out = hpcrl("run", "qs.yaml", *RUN, "guard.mode=on", "--run-dir", "r", cwd=workdir)
    assert out.returncode == 1
    assert "guard.mode=on but NVML is not available" in out.stderr and "guard.trace=FILE" in out.stderr
    assert not (workdir / "r").exists()  # failed before anything was written


def test_guard_watch_replays_a_trace_and_record_needs_nvml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hpcrl.cli import main

    trace = write_trace(tmp_path / "t.jsonl", GPUS, READINGS)
    assert main(["guard", "watch", "--trace", str(trace), "--interval-s", "0.01", "--count", "3", "warmup_s=0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"trace:{trace}: GPU 0 A (slowdown 95 °C, shutdown 100 °C)")
    assert lines[1:] == [
        "     0.0 s | gpu0 60/84 °C | gpu1 60/83 °C | run",
        "     0.1 s | gpu0 81/84 °C | gpu1 60/83 °C | run",
        "     0.2 s | gpu0 79/84 °C | gpu1 60/83 °C | run",
    ]
    if not nvml_available():
        assert main(["guard", "record", "-o", str(tmp_path / "rec.jsonl"), "--duration-s", "1"]) == 1
        assert "NVML is not available" in capsys.readouterr().err


def test_sigstop_helper_never_targets_this_process() -> None:
    from hpcrl.guard.guard import signal_workers

    assert signal_workers([os.getpid()], signal.SIGSTOP) == []
