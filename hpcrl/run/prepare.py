"""What a run checks before it writes anything to its run dir: the devices it names (model dir: model/prepare.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from hpcrl.run.errors import RunError
from hpcrl.run_config import RunConfig


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def check_devices(cfg: RunConfig, *, engines_here: bool) -> None:
    """A CUDA device the config names must exist on this machine (checked here, not at config load:
    `hpcrl sbatch` renders GPU configs on machines without one)."""
    keys = [("train.device", cfg.train.device)] + ([("engine.device", cfg.engine.device)] if engines_here else [])
    for key, device in keys:
        if not device.startswith("cuda"):
            continue
        try:
            index = torch.device(device).index or 0
        except RuntimeError as exc:
            raise RunError(f"{key}={device!r} is not a device name ({exc}); use cpu, cuda or cuda:N") from None
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= num_gpus:
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise RunError(
                f"{key}={device} but this machine shows {num_gpus} CUDA device(s) to torch {torch.__version__} "
                f"({build}); set {key}=cpu, or run on a GPU node with a CUDA build of torch"
            )
