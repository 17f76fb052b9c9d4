"""What the launcher needs to start one engine of a kind: its command line and environment.

Each kind has its own module (`engine/embedded/launch.py`, `engine/sglang.py`), imported only when that kind
is started. Every kind gets its API key from a 0600 file in the run directory, never on the command line (`ps`
shows those to every user of the node) nor in the environment, and never NVLink multicast (it can take a shared
host's GPUs out of service).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from hpcrl.engine.config import EngineConfig
from hpcrl.loader import load_object

KINDS = {"embedded": "hpcrl.engine.embedded.launch:embedded_launch", "sglang": "hpcrl.engine.sglang:sglang_launch"}
# The engine key's variable (server_config.API_KEY_ENV, slow to import): an engine is never started with it, since
# /proc/<pid>/environ keeps a process's start-up environment for its life; each kind gets its key from a file.
API_KEY_ENV = "HPCRL_ENGINE_API_KEY"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class LaunchSlot:
    """One engine slot of a run: which engine, where it listens, its key and seed."""

    index: int
    position: int  # among the engines of this node: they take consecutive GPUs
    model_dir: str
    host: str
    port: int
    api_key: str
    seed: int
    run_dir: Path
    ignore_sigterm: bool = False


@dataclass(frozen=True)
class Launch:
    cmd: list[str]
    env: dict[str, str]  # added to the launcher's environment


class LaunchFn(Protocol):
    def __call__(self, cfg: EngineConfig, slot: LaunchSlot) -> Launch: ...


def launch_for(cfg: EngineConfig, slot: LaunchSlot) -> Launch:
    fn = cast(LaunchFn, load_object(KINDS[cfg.kind], key="engine.kind"))
    launch = fn(cfg, slot)
    return Launch(launch.cmd, {**NO_MULTICAST, **launch.env})


def write_private(path: Path, text: str) -> Path:
    """`text` at `path`, mode 0600, written whole or not at all, through no link: the temporary file is created
    afresh (O_EXCL with O_NOFOLLOW: a file or link planted at its name is removed, never opened), and the rename
    replaces a link at `path` rather than writing where it points."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink()  # unlinks a link itself, never its target
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)
    os.replace(tmp, path)
    return path
