"""Engines that join a running run from a process (a Slurm job) of their own, through the run directory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import hpcrl
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.fleet import EngineFleet
from hpcrl.engine.joined import (
    JoinError,
    JoinWatcher,
    Registration,
    RunIdentity,
    SharedCheck,
    joined_dir,
    model_identity,
    refusal_path,
    this_identity,
)
from hpcrl.report.build import build_report
from hpcrl.report.plots import DEFAULT_MAX_POINTS, PLOTTERS, plot_fleet
from hpcrl.report.run import load_run
from hpcrl.rollout.ledger import ledger_problems
from hpcrl.slurm.join import check_joinable
from hpcrl.store import load_events, load_metrics
from tests.support import read_until, start_run


def registration(engine_id: str, model: str, version: str = hpcrl.__version__) -> Registration:
    return Registration(
        id=engine_id, url="http://127.0.0.1:9", token="secret", model=model, hpcrl_version=version,
        job_id="4242", host="node7", pid=123, time_s=1.5e9, weight_version=3,
    )  # fmt: skip


def test_a_registration_round_trips_and_a_foreign_model_or_hpcrl_is_refused_naming_both(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = RunIdentity(model_identity(tiny_model_dir), hpcrl.__version__, str(tmp_path / "weights"))
    reg = registration("4242-1", run.model)
    path = reg.write(tmp_path)
    assert Registration.from_file(path) == reg
    assert path.stat().st_mode & 0o777 == 0o600  # the API token is a secret
    assert reg.mismatch(run) is None
    why = registration("4242-1", "0123abcd", version="0.0.9").mismatch(run)
    assert why is not None and "model 0123abcd" in why and run.model in why
    assert "hpcrl 0.0.9" in why and hpcrl.__version__ in why

    # The run's side: a foreign engine is refused in a file its job reads, and never enters the fleet.
    events: list[tuple[str, dict]] = []
    watcher = JoinWatcher(tmp_path, run, on_event=lambda k, d: events.append((k, d)), load_timeout_s=5)
    path.unlink()
    registration("4242-2", "0123abcd").write(tmp_path)
    fleet = EngineFleet(EngineConfig(), [], launcher=None, on_event=lambda k, d: None)
    try:
        assert watcher.update(fleet, 3) is False
    finally:
        fleet.close()
    assert fleet.slots == [] and events[0][0] == "engine_join_refused"
    assert "model 0123abcd" in refusal_path(tmp_path, "4242-2").read_text()
    assert RunIdentity.read(tmp_path) == run
    watcher.close()
    assert (joined_dir(tmp_path) / "DONE").exists()  # the run ended: joined engines leave


def test_joining_needs_a_disk_delta_run_with_the_same_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "config.yaml").write_text(f"name: x\nmodel:\n  path: {tiny_model_dir}\n")
    with pytest.raises(JoinError, match="sync.transport=auto.*start the run with sync.transport=disk_delta"):
        check_joinable(tmp_path)
    (tmp_path / "config.yaml").write_text(
        f"name: x\nmodel:\n  path: {tiny_model_dir}\nsync:\n  transport: disk_delta\n"
    )
    with pytest.raises(JoinError, match="RUN.json not found"):
        check_joinable(tmp_path)
    RunIdentity("0123abcd", "0.0.9", str(tmp_path / "weights")).write(tmp_path)
    with pytest.raises(JoinError, match=r"model \w+ \(the run's: 0123abcd\) and hpcrl .* \(the run's: 0\.0\.9\)"):
        check_joinable(tmp_path)


def test_a_weight_directory_the_engine_node_does_not_share_is_refused_at_start_naming_it_and_the_fix(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Two processes that see different directories at the same path (the second in a mount namespace of its own,
    with a private tmpfs over the weight directory, as a node-local /tmp would be): the second is refused."""
    run_dir, weights = tmp_path / "run", tmp_path / "run-weights"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(
        f"name: x\nmodel:\n  path: {tiny_model_dir}\nsync:\n  transport: disk_delta\n  delta_dir: {weights}\n"
    )
    this_identity(tiny_model_dir, weights).write(run_dir)  # what the run writes when it starts
    check = (
        "import sys; from pathlib import Path; from hpcrl.slurm.join import check_joinable, JoinError\n"
        "try:\n    check_joinable(Path(sys.argv[1]), probe_wait_s=0.5)\n"
        "except JoinError as exc:\n    sys.exit(f'refused: {exc}')\nprint('joinable')"
    )
    assert check_joinable(run_dir, probe_wait_s=0)[1].weights_dir == str(weights)  # this process shares it
    # An engine node of the job polls it; an announcement older than its start is a previous run's, not proof.
    assert SharedCheck(run_dir, probe_wait_s=0).poll()
    assert not SharedCheck(run_dir, probe_wait_s=0, newer_than=time.time() + 60).poll()
    private = f'mount -t tmpfs none "{weights}" && exec "{sys.executable}" -c "$0" "$1"'
    other = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", private, check, str(run_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert other.returncode == 1, other.stderr
    assert f"refused: the weight directory {weights} is not shared between the trainer's node and this node" in (
        other.stderr
    )
    assert "no probe file there" in other.stderr and "Put sync.delta_dir on a file system both nodes mount" in (
        other.stderr
    )
    # A leftover of another run in a node-local directory at that path is no proof of sharing either.
    RunIdentity(model_identity(tiny_model_dir), hpcrl.__version__, str(weights), "0" * 32).write(run_dir)
    with pytest.raises(JoinError, match=r"this node .* sees another run's probe \(written on"):
        check_joinable(run_dir, probe_wait_s=0)


def test_the_join_job_script_runs_the_runs_engines_on_another_partition(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpcrl.cli import main

    run = tmp_path / "r"
    run.mkdir()
    config = f"name: demo\nmodel:\n  path: {tiny_model_dir}\nsync:\n  transport: disk_delta\nslurm:\n  partition: gpu\n"
    (run / "config.yaml").write_text(config + "  engines:\n    gpus_per_node: 2\n")
    out = tmp_path / "join.sbatch"
    argv = ["sbatch", "--engines-only", "--join", str(run), "slurm.partition=scavenger", "-o", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert "#SBATCH --partition=scavenger" in text and "#SBATCH --gpus-per-node=2" in text
    assert "#SBATCH --no-requeue" in text and "#SBATCH --job-name=demo-join" in text
    assert f"RUN_DIR={run}\n" in text and text.rstrip().endswith('-m hpcrl.cli engine join "$RUN_DIR"')
    capsys.readouterr()
    # The engines must be the run's: only the slurm section may change; and only a disk_delta run takes them.
    assert main(["sbatch", "--engines-only", "--join", str(run), "engine.tp_size=2"]) == 2
    assert "only slurm.* may be changed (got ['engine.tp_size=2'])" in capsys.readouterr().err
    (run / "config.yaml").write_text(config.replace("disk_delta", "distributed"))
    assert main(["submit", "--engines-only", "--join", str(run)]) == 2
    assert "start the run with sync.transport=disk_delta" in capsys.readouterr().err


STEPS = 8


def test_an_engine_joins_an_async_run_mid_way_serves_the_current_version_and_its_death_loses_no_group(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    proc = start_run(
        tmp_path, tiny_model_dir, f"num_steps={STEPS}", "engine.num_engines=1", "rollout.max_new_tokens=8",
        "sync.transport=disk_delta", "rollout.mode=async",
    )  # fmt: skip
    lines: list[str] = []
    joiner = None
    try:
        # Started with the run, as soon as it has claimed its directory (its config is there, written atomically):
        # both engines start at once, and the run announces itself once its own is up.
        _wait_for(lambda: (tmp_path / "r" / "config.yaml").is_file(), 120)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        joiner = subprocess.Popen(
            [sys.executable, "-m", "hpcrl.cli", "engine", "join", "r"], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        read_until(proc, f"step    1/{STEPS}", lines)
        # Hold the run (its process stopped, its engine up) until the new engine has registered: here an engine
        # starts in ~15 s, a step takes ~0.3 s.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            _wait_for(lambda: any(p.name != "RUN.json" for p in joined_dir(tmp_path / "r").glob("*.json")), 120)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        read_until(proc, "engine_joined", lines)
        record = json.loads((tmp_path / "r" / "engines" / "engine-1.json").read_text())
        served = _generated_tokens(record, deadline_s=60)
        os.kill(record["pid"], signal.SIGKILL)  # mid-rollout: the joined engine had requests
        out = "".join(lines) + proc.communicate(timeout=300)[0]
        joined_out = joiner.communicate(timeout=60)[0]
    finally:
        for p in (proc, joiner):
            if p is not None and p.poll() is None:
                p.kill()
    assert proc.returncode == 0, out
    assert joiner.returncode == 1 and "exited" in joined_out, joined_out  # it saw its engine die and left
    assert served > 0
    events = {e["kind"]: e for e in reversed(load_events(tmp_path / "r" / "metrics.h5"))}
    m = load_metrics(tmp_path / "r" / "metrics.h5")
    # It joined at the version the run had just pushed: the one every engine served from then on.
    joined = events["engine_joined"]["detail"]
    assert joined["version"] in set(m["sync/weight_version"].astype(int))
    assert "engine_left" in events and events["engine_left"]["detail"]["engine"] == joined["engine"]
    assert m["fleet/engines_joined"].sum() == 1 and m["fleet/engines_left"].sum() == 1
    assert m["fleet/engines_live"].max() == 2 and m["fleet/engines_live"][-1] == 1
    assert list(m["step"]) == list(range(STEPS)) and (m["rollout/num_samples"] == 16).all()
    ledger = json.loads((tmp_path / "r" / "prompt_ledger.json").read_text())
    assert ledger_problems(ledger, num_drawn=ledger["next_position"], prompts_per_step=4) == []
    assert not np.isnan(m["fleet/engines_live"]).any()
    # `hpcrl report`: its summary counts the engines, and its fleet plot (one of the report's plots, drawn alone
    # here: the run's other plots take seconds and show nothing about engines) draws them over time.
    report = build_report(tmp_path / "r", tmp_path / "report", plots=False)
    assert plot_fleet in PLOTTERS
    fleet_png = plot_fleet(load_run(tmp_path / "r"), tmp_path / "report", DEFAULT_MAX_POINTS)
    assert fleet_png is not None and fleet_png.name == "fleet.png" and fleet_png.stat().st_size > 0
    assert re.search(r"\| engines joined +\| 1 ", report.markdown) and re.search(
        r"\| engines left +\| 1 ", report.markdown
    )
    print(f"joined at version {joined['version']} after {joined['catch_up_s']} s of catch-up; {served} tokens served; "
          f"{int(m['fleet/reissued_requests'].sum())} requests re-issued after its SIGKILL")  # fmt: skip


def _wait_for(ready: Callable[[], bool], timeout_s: float) -> None:
    end = time.time() + timeout_s
    while not ready():
        assert time.time() < end, "timed out"
        time.sleep(0.1)


def _generated_tokens(record: dict, *, deadline_s: float) -> int:
    """Tokens the engine has generated, once it has generated some (polled through its /server_info)."""
    import urllib.request

    req = urllib.request.Request(record["url"] + "/server_info", headers={"Authorization": f"Bearer {record['token']}"})
    end = time.time() + deadline_s
    while time.time() < end:
        with urllib.request.urlopen(req, timeout=5) as r:
            n = int(json.loads(r.read())["internal_states"][0]["num_generated_tokens"])
        if n > 0:
            return n
        time.sleep(0.05)
    return 0
