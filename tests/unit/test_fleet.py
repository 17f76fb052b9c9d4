"""Engine faults injected into real runs: SIGKILL, SIGSTOP, an engine that cannot start again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from hpcrl.store import load_events, load_metrics
from tests.support import (
    first_event,
    read_until,
    sigkill_mid_push,
    start_run,
)


def engine_pid(workdir: Path, index: int) -> int:
    return int(json.loads((workdir / "r" / "engines" / f"engine-{index}.json").read_text())["pid"])


def test_sigkill_mid_rollout_is_detected_restarted_and_loses_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = start_run(tmp_path, tiny_model_dir, "num_steps=6")
    lines: list[str] = []
    read_until(proc, "step    2/6", lines)
    time.sleep(0.3)  # into step 3's rollout (each takes ~0.7 s here)
    killed_s = time.time()
    os.kill(engine_pid(tmp_path, 1), signal.SIGKILL)
    out = "".join(lines) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    dead = first_event(tmp_path, "engine_dead")
    detected_s = dead["time_s"] - killed_s
    print(f"SIGKILL -> engine_dead after {detected_s:.2f} s ({dead['detail']['cause'][:60]})")
    assert detected_s <= 10
    assert first_event(tmp_path, "engine_restarted")["detail"]["engine"] == 1
    m = load_metrics(tmp_path / "r" / "metrics.h5")
    assert list(m["step"]) == list(range(6))
    assert (m["rollout/num_samples"] == 16).all()  # nothing lost, nothing duplicated
    # Every token of every step came from the weights the driver had pushed for that step.
    assert (m["rollout/stale_token_share"] == 0).all()
    assert m["fleet/live_engines"][-1] == 2


def test_sigstop_is_detected_as_hung(tmp_path: Path, tiny_model_dir: Path) -> None:
    # Hung after 10 s without an answer instead of the default 20 s: the test waits that long for the verdict.
    proc = start_run(tmp_path, tiny_model_dir, "num_steps=4", "engine.hung_after_s=10")
    lines: list[str] = []
    read_until(proc, "step    1/4", lines)
    stopped_s = time.time()
    pid = engine_pid(tmp_path, 0)
    os.kill(pid, signal.SIGSTOP)
    try:
        out = "".join(lines) + proc.communicate(timeout=300)[0]
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out
    dead = first_event(tmp_path, "engine_dead")
    detected_s = dead["time_s"] - stopped_s
    print(f"SIGSTOP -> engine_dead after {detected_s:.2f} s ({dead['detail']['cause'][:60]})")
    assert detected_s <= 30 and "hung" in dead["detail"]["cause"]
    assert (load_metrics(tmp_path / "r" / "metrics.h5")["rollout/num_samples"] == 16).all()


def test_engine_that_cannot_restart_stops_the_run_with_a_clear_message(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    proc = start_run(tmp_path, model, "num_steps=20", "engine.num_engines=1", "engine.max_restarts=2")
    lines: list[str] = []
    read_until(proc, "step    2/20", lines)
    # The weights vanish from the shared filesystem: every restart of the engine fails to load.
    (model / "model.safetensors").unlink()
    killed_s = time.time()
    os.kill(engine_pid(tmp_path, 0), signal.SIGKILL)
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    stopped_after_s = time.time() - killed_s
    print(f"engine lost for good -> run stopped after {stopped_after_s:.1f} s")
    assert proc.returncode != 0
    assert stopped_after_s <= 60
    assert "engine 0" in out and "gave up after 2 restart(s)" in out and "model.safetensors" in out
    kinds = [e["kind"] for e in load_events(tmp_path / "r" / "metrics.h5")]
    assert "engine_dead" in kinds and "engine_gave_up" in kinds
    # The last finished step was checkpointed on the way out: a rerun resumes there.
    assert "checkpointed step" in out
    # metrics.h5 stores the 0-based step index; a checkpoint file is named by the steps done.
    steps_done = int(load_metrics(tmp_path / "r" / "metrics.h5")["step"][-1]) + 1
    assert (tmp_path / "r" / "checkpoints" / f"step_{steps_done:08d}.h5").exists()
    assert np.isfinite(load_metrics(tmp_path / "r" / "metrics.h5")["train/loss"]).all()


def test_memory_release_is_verified(engine_factory) -> None:
    from hpcrl.engine.client import EngineClient
    from hpcrl.engine.config import EngineConfig
    from hpcrl.engine.fleet import EngineFleet, FleetError

    eng = engine_factory()
    events: list[tuple[str, dict]] = []
    fleet = EngineFleet(
        EngineConfig(), [EngineClient(eng.url)], launcher=None, on_event=lambda k, d: events.append((k, d))
    )
    try:
        freed = fleet.release_memory(["kv_cache", "weights"])["fleet/released_bytes"]
        print(f"released {freed / 2**20:.1f} MiB")
        assert freed > 0
        # Releasing again frees nothing: exactly the silent failure the check exists for.
        with pytest.raises(FleetError, match="freed nothing"):
            fleet.release_memory(["kv_cache"])
        fleet.resume_memory(["kv_cache", "weights"])
    finally:
        fleet.close()


def test_groups_go_to_the_least_loaded_engine_deterministically() -> None:
    from hpcrl.rollout.generate import assign_least_loaded

    items = [(p, s) for p in range(5) for s in range(2)]
    equal = assign_least_loaded(items, [4] * 5, 2)
    assert [p for p, _ in equal[0]][::2] == [0, 2, 4] and [p for p, _ in equal[1]][::2] == [1, 3]
    # A long prompt weighs more: the next groups go elsewhere until the loads even out.
    skewed = assign_least_loaded(items, [40, 4, 4, 4, 4], 2)
    assert {p for p, _ in skewed[0]} == {0} and {p for p, _ in skewed[1]} == {1, 2, 3, 4}
    assert assign_least_loaded(items, [4] * 5, 2) == equal


def test_abort_all_reaches_every_engine_directly(engine_factory) -> None:
    import threading

    from hpcrl.engine.client import EngineClient
    from hpcrl.engine.config import EngineConfig
    from hpcrl.engine.fleet import EngineFleet

    engines = [engine_factory(), engine_factory()]
    clients = [EngineClient(e.url) for e in engines]
    fleet = EngineFleet(EngineConfig(), clients, launcher=None, on_event=lambda k, d: None)
    results: list = []
    from hpcrl.engine.protocol.requests import SamplingParams

    threads = [
        threading.Thread(
            target=lambda c=c: results.append(
                c.generate([1, 2, 3], SamplingParams(max_new_tokens=1000, ignore_eos=True), return_logprob=False)
            )
        )
        for c in clients
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(c.server_info()["internal_states"][0]["num_reqs"] for c in clients):
        time.sleep(0.02)
    fleet.abort_all()
    for t in threads:
        t.join(30)
    fleet.close()
    assert len(results) == 2 and all(r.finish_reason.type == "abort" for r in results)


def test_sigkill_during_a_weight_push_restarts_the_engine_and_pushes_all_weights(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """On CPU: an engine killed in the middle of a gloo weight push."""
    sigkill_mid_push(tmp_path, tiny_model_dir, 1)


def test_a_late_failure_from_before_a_restart_leaves_the_restarted_engine_live() -> None:
    from hpcrl.engine.client import EngineClient
    from hpcrl.engine.config import EngineConfig
    from hpcrl.engine.errors import EngineUnreachableError
    from hpcrl.engine.fleet import EngineFleet

    events: list[str] = []
    old, new = EngineClient("http://127.0.0.1:9"), EngineClient("http://127.0.0.1:10")
    fleet = EngineFleet(EngineConfig(), [old], launcher=None, on_event=lambda k, d: events.append(k))
    slot = fleet.slots[0]
    slot.client = new  # what a restart does while a request to the old process is still in flight
    fleet.report_failure(slot, EngineUnreachableError("connection refused", url=old.url), client=old)
    assert slot.state == "live" and events == []
    fleet.report_failure(slot, EngineUnreachableError("connection refused", url=new.url), client=new)
    fleet.close()
    assert slot.state == "dead" and events == ["engine_dead"]


def test_a_probe_that_outlasts_a_restart_leaves_the_restarted_engine_live() -> None:
    """The monitor's probe of a killed engine retries for seconds; a restart can land meanwhile (CI saw the
    trainer's thread restore the engines twice): the probe's verdict is about the old process only."""
    import socket
    import threading

    from hpcrl.engine.client import EngineClient
    from hpcrl.engine.config import EngineConfig
    from hpcrl.engine.fleet import EngineFleet

    with socket.socket() as sock:  # a port that nothing listens on: connections are refused, as to a killed engine
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    events: list[str] = []
    old, new = EngineClient(f"http://127.0.0.1:{port}"), EngineClient(f"http://127.0.0.1:{port}")
    cfg = EngineConfig(health_interval_s=3600.0)  # the test probes; the monitor thread stays asleep
    fleet = EngineFleet(cfg, [old], launcher=None, on_event=lambda k, d: events.append(k))
    slot = fleet.slots[0]
    probe = threading.Thread(target=fleet.probe_all)
    t0 = time.monotonic()
    probe.start()
    time.sleep(0.2)  # the probe is in its retries (0.5 + 1 + 2 s)
    slot.client = new  # what a restart does (restart_dead, or the publisher's restore)
    probe.join(timeout=30)
    print(f"probe of the refused port took {time.monotonic() - t0:.2f} s")
    assert not probe.is_alive() and time.monotonic() - t0 > 0.5, "the probe ended before the swap"
    assert slot.state == "live" and events == [], (slot.state, slot.cause)
    fleet.probe_all()  # the same evidence about the slot's own engine still counts
    fleet.close()
    assert slot.state == "dead" and events == ["engine_dead"] and "refused" in slot.cause
