"""Shared fixtures: a tiny model made once per session, and real embedded engine servers on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Two shared cores: keep every process to one thread unless a test says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcrl.model.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@dataclass
class EngineProcess:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_engine(model_dir: Path, log_dir: Path, *extra: str, timeout_s: float = 60.0) -> EngineProcess:
    port = free_port()
    log_path = log_dir / f"engine-{port}.log"
    # --no-deterministic: requests join a running batch, as a serving engine's do (a test may still pass
    # --deterministic after it: the last flag wins); a run's engines keep engine.deterministic's default.
    cmd = [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model_dir), "--port", str(port),
           "--no-deterministic", *extra]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    eng = EngineProcess(url=url, port=port, proc=proc, log_path=log_path)
    # The launcher's own wait (starting until the first healthy answer, bounded, the log's tail on failure).
    from hpcrl.engine.local import LocalEngine, wait_started

    token = extra[extra.index("--api-key") + 1] if "--api-key" in extra else ""
    try:
        wait_started(LocalEngine("engine", url, token, proc, log_path), kind="embedded", limit_s=timeout_s, say=print)
    except BaseException:
        eng.stop()
        raise
    return eng


@pytest.fixture
def engine_factory(tiny_model_dir: Path, tmp_path: Path) -> Iterator:
    started: list[EngineProcess] = []

    def make(*extra: str, model_dir: Path | None = None) -> EngineProcess:
        eng = start_engine(model_dir or tiny_model_dir, tmp_path, *extra)
        started.append(eng)
        return eng

    yield make
    for eng in started:
        eng.stop()


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """One engine for a whole test module (read-only tests: generation, shapes, bad requests)."""
    eng = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine"), "--random-seed", "7")
    yield eng
    eng.stop()


def quickstart_dir(path: Path, tiny_model_dir: Path) -> Path:
    """`path` with the quickstart config (qs.yaml) pointed at the tiny model."""
    text = (Path(__file__).resolve().parents[1] / "experiments" / "quickstart.yaml").read_text()
    lines = [line for line in text.splitlines() if not line.strip().startswith("#")]
    cfg = "\n".join(lines).replace("path: runs/models/tiny-qwen3", f"path: {tiny_model_dir}")
    (path / "qs.yaml").write_text(cfg)
    return path


@pytest.fixture
def workdir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A directory with the quickstart config pointed at the session's tiny model."""
    return quickstart_dir(tmp_path, tiny_model_dir)


@pytest.fixture(scope="session")
def small_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, str]:
    """`hpcrl run qs.yaml SMALL` to its end, once: its run dir (tests read it or change a copy, never it) and
    its stdout."""
    from tests.support import SMALL, hpcrl

    workdir = quickstart_dir(tmp_path_factory.mktemp("small"), tiny_model_dir)
    out = hpcrl("run", "qs.yaml", *SMALL, "--run-dir", "run", cwd=workdir)
    return workdir / "run", out.stdout


# Session fixtures that make a run: their tests share a worker under xdist, so each is made once.
SHARED_RUNS = ("small_run",)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Under pytest-xdist (`-n 2 --dist loadgroup`, what CI runs) the Slurm tests share one worker: they share one
    # cluster, and the preemption tests requeue every job of a partition, a concurrent test's job too.
    # The tests of a module that use one of its module-scoped fixtures (an engine, a finished run) share a worker
    # too: spread over both, each worker would start the fixture again.
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif item.get_closest_marker("xdist_group") is None:
            group = next((f"fixture:{name}" for name in SHARED_RUNS if name in item.fixturenames), None)
            if group is None and _uses_a_module_fixture(item):
                group = f"module-fixture:{item.nodeid.split('::')[0]}"
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())
