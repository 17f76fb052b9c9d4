"""The command line of hpcrl's embedded engine for one slot (`hpcrl engine serve`).

The engine section travels whole, as a 0600 YAML file in the run directory that `hpcrl engine serve --config`
reads; only what differs between slots (model, address, seed) goes on the command line. The slot's API key goes in
a 0600 file beside it (`--api-key-file`): on the command line `ps` would show it to every user of the node, and in
the environment `/proc/<engine pid>/environ` would keep it for the engine's life, whatever the engine unsets.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hpcrl.config import dump_yaml
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.launch import Launch, LaunchSlot, write_private


def write_engine_config(path: Path, cfg: EngineConfig) -> Path:
    """The engine section as YAML at `path` (mode 0600, like every file of the run's engines), written whole or not
    at all."""
    return write_private(path, dump_yaml(cfg))


def write_key_file(path: Path, api_key: str) -> Path:
    """The slot's API key alone on one line at `path` (mode 0600), what `hpcrl engine serve --api-key-file` reads."""
    return write_private(path, api_key + "\n")


def embedded_launch(cfg: EngineConfig, slot: LaunchSlot) -> Launch:
    config_file = write_engine_config(slot.run_dir / "engines" / f"engine-{slot.index}.yaml", cfg)
    key_file = write_key_file(slot.run_dir / "engines" / f"engine-{slot.index}.key", slot.api_key)
    cmd = [
        sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--config", str(config_file),
        "--api-key-file", str(key_file),
        "--model", slot.model_dir, "--host", slot.host, "--port", str(slot.port),
        "--random-seed", str(slot.seed), "--parent-pid", str(os.getpid()),
        # Engines load the run's initial weights: version "0", what the driver calls them before a push.
        "--weight-version", "0",
    ]  # fmt: skip
    if slot.ignore_sigterm:
        cmd.append("--ignore-sigterm")
    return Launch(cmd, {"OMP_NUM_THREADS": str(cfg.num_threads)})
