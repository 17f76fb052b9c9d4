"""The command line of hpcrl's embedded engine for one slot (`hpcrl engine serve`).

The engine section travels whole, as a 0600 YAML file in the run directory that `hpcrl engine serve --config`
reads; only what differs between slots (model, address, seed) goes on the command line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hpcrl.config import dump_yaml
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.launch import Launch, LaunchSlot

API_KEY_ENV = "HPCRL_ENGINE_API_KEY"  # server_config.API_KEY_ENV; that package is slow to import


def write_engine_config(path: Path, cfg: EngineConfig) -> Path:
    """The engine section as YAML at `path` (mode 0600, like every file of the run's engines), written whole or not
    at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(dump_yaml(cfg))
    os.replace(tmp, path)
    return path


def embedded_launch(cfg: EngineConfig, slot: LaunchSlot) -> Launch:
    config_file = write_engine_config(slot.run_dir / "engines" / f"engine-{slot.index}.yaml", cfg)
    cmd = [
        sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--config", str(config_file),
        "--model", slot.model_dir, "--host", slot.host, "--port", str(slot.port),
        "--random-seed", str(slot.seed), "--parent-pid", str(os.getpid()),
        # Engines load the run's initial weights: version "0", what the driver calls them before a push.
        "--weight-version", "0",
    ]  # fmt: skip
    if slot.ignore_sigterm:
        cmd.append("--ignore-sigterm")
    return Launch(cmd, {API_KEY_ENV: slot.api_key, "OMP_NUM_THREADS": str(cfg.num_threads)})
