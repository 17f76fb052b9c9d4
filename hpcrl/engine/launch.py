"""What the launcher needs to start one engine of a kind: its command line and environment.

Each kind has its own module (`engine/embedded/launch.py`, `engine/sglang.py`), imported only when that kind
is started. Every kind gets its API key without the command line (`ps` shows those to every user of the
node) and never NVLink multicast (it can take a shared host's GPUs out of service).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from hpcrl.engine.config import EngineConfig
from hpcrl.loader import load_object

KINDS = {"embedded": "hpcrl.engine.embedded.launch:embedded_launch", "sglang": "hpcrl.engine.sglang:sglang_launch"}
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
