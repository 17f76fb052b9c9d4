"""`hpcrl engine join RUN_DIR`: an engine that joins a running run from a job (or a shell) of its own.

    hpcrl submit --engines-only --join RUN_DIR      (a Slurm job on any partition running the line below)
    hpcrl engine join RUN_DIR

It reads RUN_DIR/config.yaml and the run's identity (RUN_DIR/engines/joined/RUN.json, hpcrl/engine/joined.py),
refuses to start when the run's weights do not travel through shared storage (sync.transport disk_delta) or when
its model or hpcrl version differs from the run's (naming both), starts one engine of the run's engine section
(a SGLang server with its disk-delta agent beside it, hpcrl/engine/delta_agent_client.py), brings it to the newest
weight version on disk, and registers it. It then serves until the run ends (DONE), the run
refuses it, its engine exits, or a signal comes (scancel, preemption): the registration goes first, so that the
run stops routing to it, then the engine. The run re-issues whatever the engine still had in flight.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import hpcrl
from hpcrl import preemption
from hpcrl.engine.joined import (
    PROBE_WAIT_S,
    JoinError,
    Registration,
    RunIdentity,
    catch_up,
    done_path,
    joined_dir,
    model_identity,
    newest_version,
    refusal_path,
    wait_shared,
)
from hpcrl.engine.local import Incarnation, LocalEngines
from hpcrl.model.prepare import prepare_model_dir
from hpcrl.run_config import RunConfig, load_run_config
from hpcrl.slurm.env import LaunchEnv
from hpcrl.store.run_dir import make_subdir
from hpcrl.weightwire.delta import DeltaDirNotShared

# How long a join started with the run (or before it) waits for the run to announce itself.
RUN_WAIT_S = 900.0


def joinable_config(run_dir: Path) -> RunConfig:
    """The run's config, when engines can join it at all; JoinError with the fix otherwise."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise JoinError(f"{path} not found: {run_dir} is not the directory of a started run")
    cfg = load_run_config(path)
    if cfg.sync.transport != "disk_delta":
        raise JoinError(
            f"the run in {run_dir} pushes weights with sync.transport={cfg.sync.transport}, which reaches only the "
            "engines it started; engines join a run whose weights go through shared storage: start the run with "
            "sync.transport=disk_delta"
        )
    return cfg


def check_joinable(
    run_dir: Path, *, wait_s: float = 0.0, probe_wait_s: float = PROBE_WAIT_S
) -> tuple[RunConfig, RunIdentity]:
    """The run's config and identity, when an engine built here may join it; JoinError with the fix otherwise.
    `wait_s`: how long to wait for the run to announce itself (RUN.json, written when its engines are up);
    `probe_wait_s`: how long then for this node to see the probe the run wrote into its weight directory."""
    cfg = joinable_config(run_dir)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            run = RunIdentity.read(run_dir)
            break
        except JoinError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    model_dir = prepare_model_dir(Path(cfg.model.path), cfg.model.init_tiny)
    mine = Registration(
        id="this job", url="", token="", model=model_identity(model_dir), hpcrl_version=hpcrl.__version__,
        job_id=os.environ.get("SLURM_JOB_ID", "local"), host="", pid=0, time_s=0.0, weight_version=None,
    )  # fmt: skip
    why = mine.mismatch(run)
    if why is not None:
        raise JoinError(why)
    try:
        run = wait_shared(run_dir, wait_s=wait_s, probe_wait_s=probe_wait_s)  # this node's view of its weights
    except DeltaDirNotShared as exc:
        raise JoinError(str(exc)) from None
    return cfg, run


def claim_index(run_dir: Path, first: int) -> int:
    """An engine index no other engine of the run has (its log and port follow it): taken with O_EXCL."""
    folder = make_subdir(joined_dir(run_dir))
    index = first
    while True:
        try:
            os.close(os.open(folder / f"index-{index}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return index
        except FileExistsError:
            index += 1


def join_run(run_dir: Path, *, poll_s: float = 0.5) -> int:
    run_dir = run_dir.absolute()
    cfg = joinable_config(run_dir)
    preemption.watch()
    slurm = LaunchEnv.from_environ()
    host = socket.gethostbyname(slurm.node_name) if slurm else "127.0.0.1"
    job = slurm.job_id if slurm else f"local-{os.getpid()}"
    index = claim_index(run_dir, cfg.engine.num_engines)
    engines = LocalEngines(
        cfg.engine, cfg.model.path, run_dir, seed=cfg.seed, first_index=index, count=1, bind_host=host,
        advertise_host=host, incarnation=Incarnation(job, 0), ignore_sigterm=True, delta_agent=True,
    )  # fmt: skip
    (client,) = engines.start()  # meanwhile the run may still be starting: its identity is checked after
    reg_path: Path | None = None
    try:
        _, run = check_joinable(run_dir, wait_s=RUN_WAIT_S)
        weights_dir = Path(run.weights_dir)
        version = newest_version(weights_dir)
        if version is not None:  # the run checks again before the first request, and catches up what came since
            catch_up(
                client, weights_dir, version, timeout_s=cfg.sync.group_timeout_s, engine_kind=cfg.engine.kind,
                run_dir=run_dir,
            )  # fmt: skip
        engine_id = f"{job}-{index}"
        reg = Registration(
            id=engine_id, url=engines.engines[0].url, token=engines.engines[0].token, model=run.model,
            hpcrl_version=hpcrl.__version__, job_id=job, host=socket.gethostname(), pid=os.getpid(),
            time_s=time.time(), weight_version=version,
        )  # fmt: skip
        reg_path = reg.write(run_dir)
        print(f"engine {engine_id} at {reg.url} joined the run in {run_dir} at weight version {version}", flush=True)
        return _serve(run_dir, engines, engine_id, poll_s=poll_s)
    finally:
        if reg_path is not None:
            reg_path.unlink(missing_ok=True)  # first: the run stops routing here before the engine goes
        engines.stop()


def _serve(run_dir: Path, engines: LocalEngines, engine_id: str, *, poll_s: float) -> int:
    refused = refusal_path(run_dir, engine_id)
    while True:
        if done_path(run_dir).exists():
            print(f"engine {engine_id}: the run ended; leaving", flush=True)
            return 0
        if refused.exists():
            print(f"engine {engine_id}: the run refused it: {refused.read_text()}", file=sys.stderr, flush=True)
            return 2
        if preemption.received():
            print(f"engine {engine_id}: signal {preemption.received()}; leaving the run", flush=True)
            return 0
        if engines.exited():
            print(f"engine {engine_id} exited; see {engines.log_path(0)}", file=sys.stderr, flush=True)
            return 1
        time.sleep(poll_s)
