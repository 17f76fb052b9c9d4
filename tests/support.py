"""Helpers shared by the test modules of every tier: test modules import these, never each other.

Sections: paths; `hpcrl run` as a subprocess (tiny configs, signals, metric comparison); engine faults in a
run; Megatron ranks as processes; Slurm configs, jobs and the dev cluster (tests/e2e/conftest.py starts it).
Fixtures stay in the conftest.py files (tests/conftest.py: tiny model, engines; tests/e2e/conftest.py: the
cluster).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpcrl.config import from_dict
from hpcrl.run_config import RunConfig
from hpcrl.store import load_events, load_metrics

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"


def tcp_server(handle: Callable[[socket.socket], None]) -> socket.socket:
    """A loopback listener whose every connection `handle` serves in a thread of its own; closing the
    listener stops accepting. For servers that misbehave at the byte level, as no HTTP framework will."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------------------
# `hpcrl run` as a subprocess


SMALL = [
    "num_steps=6",
    "sft.num_steps=20",
    "sft.batch_size=16",
    "data.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "checkpoint.every_steps=2",
]


def assert_unfinished_heads_are_dropped(url: str, timeout_s: float) -> None:
    """A client that connects and sends nothing, and one that sends its request head a byte every 0.2 s, each hold a
    socket of the server at `url` only until its head timeout (`timeout_s`); /health answers other clients all along."""
    import select
    import urllib.parse

    import httpx

    address = urllib.parse.urlsplit(url)
    silent = socket.create_connection((address.hostname, address.port), timeout=5)
    dribble = socket.create_connection((address.hostname, address.port), timeout=5)
    start = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 1000
    closed_after: dict[str, float] = {}
    health_answers = sent = 0
    try:
        while len(closed_after) < 2 and time.monotonic() - start < timeout_s + 10:
            if "dribble" not in closed_after:
                try:
                    dribble.send(head[sent : sent + 1])
                    sent += 1
                except OSError:  # reset by the server
                    closed_after["dribble"] = time.monotonic() - start
            readable, _, _ = select.select([s for s in (silent, dribble) if s.fileno() >= 0], [], [], 0.2)
            for sock in readable:
                name = "silent" if sock is silent else "dribble"
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                assert data == b"", f"the server answered the {name} client's unfinished request: {data!r}"
                closed_after.setdefault(name, time.monotonic() - start)
                sock.close()
            if int((time.monotonic() - start) / 2) > health_answers:
                assert httpx.get(url + "/health", timeout=5).status_code == 200
                health_answers += 1
    finally:
        silent.close()
        dribble.close()
    assert sent < len(head), "the whole head was sent: make it longer"
    assert set(closed_after) == {"silent", "dribble"}, f"still open after {timeout_s + 10} s: {closed_after}"
    for name, seconds in closed_after.items():
        assert timeout_s - 1 <= seconds <= timeout_s + 3, (name, seconds)
    assert health_answers >= timeout_s // 2 - 1


def hpcrl(*args: str, cwd: Path, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if check and out.returncode != 0:
        raise AssertionError(f"hpcrl {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def signal_at_step(workdir: Path, args: list[str], run_dir: str, step: int, sig: int) -> subprocess.Popen[str]:
    """Start `hpcrl run` and send `sig` once it prints the line of `step` (1-based); the caller waits."""
    return signal_at_line(workdir, args, run_dir, f"step {step:>4}/", sig)


def signal_at_line(workdir: Path, args: list[str], run_dir: str, prefix: str, sig: int) -> subprocess.Popen[str]:
    """Start `hpcrl run` and send `sig` once it prints a line starting with `prefix`; the caller waits."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "run", "qs.yaml", *args, "--run-dir", run_dir],
        cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            proc.send_signal(sig)
            break
    return proc


def non_timing(metrics: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    timing = ("sync/seconds", "rollout/tokens_per_s")
    return {k: v for k, v in metrics.items() if not k.startswith("timing/") and k not in timing}


def assert_same_metrics(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    a, b = non_timing(a), non_timing(b)
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# --------------------------------------------------------------------------------------------------
# Engine faults injected into a run


# Untrained tiny models rarely stop early, so rollouts last long enough to be hit mid-flight.
LONG = [
    "sft.num_steps=0", "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=200",
    "engine.num_engines=2",
]  # fmt: skip


def start_run(workdir: Path, model_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "hpcrl.cli", "run", str(REPO / "experiments" / "quickstart.yaml"),
        f"model.path={model_dir}", *LONG, *overrides, "--run-dir", "r",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen[str], marker: str, lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            return
    raise AssertionError(f"never saw {marker!r}:\n{''.join(lines)}")


def first_event(workdir: Path, kind: str) -> dict:
    return next(e for e in load_events(workdir / "r" / "metrics.h5") if e["kind"] == kind)


def sigkill_mid_push(tmp_path: Path, model_dir: Path, engine: int, *overrides: str) -> None:
    """Run, SIGKILL engine `engine` while it is paused for a push, and check that the run heals: the
    trainer's broadcast fails instead of hanging, the fleet restarts the engine and pushes every weight."""
    import urllib.request

    # One tensor per bucket: a push is many HTTP calls + broadcasts, long enough to be hit mid-way.
    proc = start_run(
        tmp_path, model_dir, "num_steps=4", "rollout.max_new_tokens=8", "sync.transport=distributed",
        "sync.bucket_mb=0.0001", "sync.flattened=false", "sync.group_timeout_s=150", *overrides,
    )  # fmt: skip
    lines: list[str] = []
    read_until(proc, "step    1/4", lines)
    record = json.loads((tmp_path / "r" / "engines" / f"engine-{engine}.json").read_text())
    req = urllib.request.Request(record["url"] + "/server_info", headers={"Authorization": f"Bearer {record['token']}"})
    deadline = time.time() + 60
    try:
        while time.time() < deadline:  # the engine is paused only while a push is in flight
            with urllib.request.urlopen(req, timeout=5) as r:
                if json.loads(r.read())["internal_states"][0]["paused"]:
                    break
            time.sleep(0.002)
        else:
            raise AssertionError(f"never saw engine {engine} paused for a push")
    except (OSError, AssertionError) as exc:
        proc.kill()
        logs = sorted((tmp_path / "r" / "logs").glob("engine-*.log"))
        tail = "".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)
        raise AssertionError(f"{exc}\n--- run\n{''.join(lines)}{proc.communicate()[0][-3000:]}\n{tail}") from exc
    killed_s = time.time()
    os.kill(record["pid"], signal.SIGKILL)
    out = "".join(lines) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    dead = first_event(tmp_path, "engine_dead")
    cause = dead["detail"]["cause"][:90]
    print(f"SIGKILL mid-push -> engine_dead after {dead['time_s'] - killed_s:.2f} s; cause: {cause}")
    assert dead["time_s"] - killed_s <= 30  # far inside the 150 s collective timeout: no hang
    assert first_event(tmp_path, "engine_restarted")["detail"]["engine"] == engine
    m = load_metrics(tmp_path / "r" / "metrics.h5")
    assert list(m["step"]) == list(range(4))
    assert (m["rollout/stale_token_share"] == 0).all()
    # The restarted engine began from the model dir; only a full push makes its log-probs the trainer's.
    assert m["train/train_rollout_logprob_abs_diff"].max() < 1e-4


# --------------------------------------------------------------------------------------------------
# Megatron ranks as processes (tests/unit/megatron_ranks.py)


def run_ranks(scenario: str, model_dir: Path, out: Path, tp: int, pp: int, world: int) -> dict:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "unit" / "megatron_ranks.py"), scenario, str(model_dir), str(out),
             str(tp), str(pp)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))  # fmt: skip
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-3000:]}"
    return json.loads((out / "result.json").read_text())


# --------------------------------------------------------------------------------------------------
# Slurm: configs, jobs, the dev cluster


TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL")


@dataclass(frozen=True)
class SlurmCluster:
    prefix: Path
    conf: Path
    start_s: float
    """Seconds start.sh took (0 when the cluster was already up)."""

    def states(self, job_id: str) -> dict[str, str]:
        """{'12': 'RUNNING'} or, for a het job, {'12+0': ..., '12+1': ...}, from sacct (what submitit reads)."""
        out = subprocess.run(
            ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State"], capture_output=True, text=True, timeout=30
        )
        states = {}
        for line in out.stdout.splitlines():
            jid, _, state = line.partition("|")
            states[jid] = state.split()[0] if state else ""
        return states

    def wait_state(self, job_id: str, wanted: tuple[str, ...], timeout_s: float) -> str:
        """Poll until every component of the job is in one of `wanted`; the state, or fail with the job log."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.states(job_id)
            if states and all(s in wanted for s in states.values()):
                return next(iter(states.values()))
            time.sleep(0.5)
        show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        pytest.fail(f"job {job_id} not {wanted} after {timeout_s} s: {states}\n{show}")

    def wait_done(self, job_id: str, timeout_s: float = 60) -> str:
        return self.wait_state(job_id, TERMINAL_STATES, timeout_s)

    def _show_job(self, job_id: str, field: str) -> str:
        """One `Field=value` of `scontrol show job` (the controller's view); "" when it is not there."""
        show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        for token in show.split():
            if token.startswith(f"{field}="):
                return token.split("=", 1)[1]
        return ""

    def job_state(self, job_id: str) -> str:
        """The controller's JobState (RUNNING, PENDING, ...): after `scontrol requeue` it leaves RUNNING at once,
        where sacct may still list the dying incarnation."""
        return self._show_job(job_id, "JobState")

    def restart_count(self, job_id: str) -> int:
        return int(self._show_job(job_id, "Restarts") or 0)


def skip_or_fail(reason: str, *, missing: str = "no Slurm cluster") -> None:
    """Skip on a laptop; fail in CI (HPCRL_REQUIRE_SLURM=1, which runs as root with the dev cluster up),
    so that nothing the suite claims to check is skipped there."""
    if os.environ.get("HPCRL_REQUIRE_SLURM") == "1":
        pytest.fail(f"HPCRL_REQUIRE_SLURM=1 but {missing}: {reason}")
    pytest.skip(reason)


STUB = str(REPO / "tests" / "e2e" / "stub_role.sh")


HOSTILE_NAME = "rl $(touch PWNED) `touch PWNED2` \"dq\" 'sq' #hash \\back\nHPCRL_CONFIG_EOF\n; rm -rf x"


def make_config(overrides: dict[str, Any] | None = None, *, model_path: str = "/models/tiny") -> RunConfig:
    """A RunConfig from a plain dict: the settings each test names, defaults for the rest."""
    data: dict[str, Any] = {"name": "t", "model": {"path": model_path}}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return from_dict(RunConfig, data)


def sbatch(script: Path) -> str:
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, cwd=script.parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def records(run_dir: Path, role: str, job_id: str, restart: int = 0) -> list[str]:
    return [p.read_text() for p in sorted((run_dir / "stub").glob(f"{role}-{job_id}-{restart}-*.txt"))]


def result(job: Any, cluster: SlurmCluster, timeout_s: float = 120) -> Any:
    """job.result(), after sacct says the job ended (submitit's own polling backs off to minutes)."""
    cluster.wait_done(job.job_id, timeout_s)
    job.done(force_check=True)
    return job.result()


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


NUM_REAL_STEPS = 240
"""Enough steps (~0.03-0.05 s each once running) that the tests interrupt a run in its middle twice, not after its
end: with 120, a CI run (2026-12-03) had the requeued-twice test's USR2 arrive after the resumed run's last step."""


def real_config(model_dir: Path, **overrides: Any) -> RunConfig:
    """The quickstart, small: a tiny model, 20 SFT steps, NUM_REAL_STEPS GRPO steps, a checkpoint every step."""
    base: dict[str, Any] = {
        "name": "e2e-quickstart",
        "num_steps": NUM_REAL_STEPS,
        "data.digits": 1,
        "data.num_examples": 200,
        "data.prompts_per_step": 4,
        "sft": {"num_steps": 20, "batch_size": 16, "lr": 3e-3, "log_every_steps": 10},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 4},
        "reward.fn": "arithmetic_answer",
        "train": {"lr": 5e-4, "micro_batch_size": 16},
        "checkpoint.every_steps": 1,
        "slurm.python": sys.executable,
        "slurm.time_limit": "00:20:00",
    }
    return make_config(base | overrides, model_path=str(model_dir))


def _logged_steps(run_dir: Path) -> int | None:
    """GRPO steps the run has logged, 0 before the metrics file exists, None while it cannot be read."""
    from hpcrl.store import load_metrics
    from hpcrl.store.metrics import StoreError

    if not (run_dir / "metrics.h5").exists():
        return 0
    try:
        return len(load_metrics(run_dir / "metrics.h5").get("step", []))
    except (OSError, StoreError):  # the writer is creating or rewriting it
        return None


def progress(run_dir: Path) -> int:
    """GRPO steps the run has logged (0 before the metrics file exists or while it is being written)."""
    return _logged_steps(run_dir) or 0


def progress_now(run_dir: Path, timeout_s: float = 60) -> int:
    """The steps logged so far, read once the metrics file is readable: a baseline to count new steps from
    (`progress` reads 0 while a dying job rewrites the file, which would make any later count look new)."""
    deadline = time.monotonic() + timeout_s
    while (steps := _logged_steps(run_dir)) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"{run_dir / 'metrics.h5'} stayed unreadable for {timeout_s} s")
        time.sleep(0.2)
    return steps


def final_weights(run_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in sorted((run_dir / "model").glob("*.safetensors")):
        tensors |= load_file(path)
    assert tensors, f"no final model in {run_dir / 'model'}"
    return tensors


def check_metrics(run_dir: Path, num_steps: int) -> list[dict[str, Any]]:
    from hpcrl.store import load_events, load_metrics

    steps = list(load_metrics(run_dir / "metrics.h5")["step"])
    assert steps == sorted(set(steps)) and len(steps) == num_steps, f"missing or duplicated rows: {steps}"
    return load_events(run_dir / "metrics.h5")


MPI_LAYOUT = {
    "sync.transport": "mpi",
    "engine.num_engines": 2,
    "slurm.engines.nodes": 2,
    "slurm.trainer.tasks_per_node": 2,
    "train.num_ranks": 2,
}
"""Two engine nodes (an agent and an engine each) and two trainer ranks: 4 MPI processes, 3 virtual nodes."""


def host_weight_group(url: str) -> tuple[Any, str]:
    """Act as trainer rank 0: host a gloo weight group that the engine at `url` joins as rank 1.
    Returns (group, its name); the name is new each call (torch refuses a name twice in one process)."""
    import threading

    import httpx

    from hpcrl.weightwire.group import init_weight_group

    port = free_port()
    name = f"g{port}"
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo"}  # fmt: skip
    box: dict[str, httpx.Response] = {}
    join = threading.Thread(target=lambda: box.update(r=httpx.post(url + "/init_weights_update_group", json=body)))
    join.start()
    pg = init_weight_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name=name, backend="gloo",
        timeout_s=30,
    )  # fmt: skip
    join.join(30)
    assert box["r"].json()["success"], box["r"].text
    return pg, name
