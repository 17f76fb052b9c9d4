"""The command line of hpcrl's embedded engine for one slot (`hpcrl engine serve`)."""

from __future__ import annotations

import os
import sys

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.launch import Launch, LaunchSlot

API_KEY_ENV = "HPCRL_ENGINE_API_KEY"  # server.API_KEY_ENV; that module is slow to import


def embedded_launch(cfg: EngineConfig, slot: LaunchSlot) -> Launch:
    cmd = [
        sys.executable, "-m", "hpcrl.cli", "engine", "serve",
        "--model", slot.model_dir, "--host", slot.host, "--port", str(slot.port),
        "--device", cfg.device, "--dtype", cfg.dtype,
        "--max-running-requests", str(cfg.max_running_requests),
        "--decode-mode", cfg.decode_mode, "--decode-overlap", cfg.decode_overlap,
        "--decode-profile" if cfg.decode_profile else "--no-decode-profile",
        "--random-seed", str(slot.seed), "--num-threads", str(cfg.num_threads),
        "--parent-pid", str(os.getpid()),
        # Engines load the run's initial weights: version "0", what the driver calls them before a push.
        "--weight-version", "0",
    ]  # fmt: skip
    if cfg.deterministic:
        cmd.append("--deterministic")
    if cfg.logprobs != "sampled":
        cmd += ["--logprobs", cfg.logprobs]
    if cfg.batch_invariant:
        cmd.append("--batch-invariant")
    if cfg.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    if slot.ignore_sigterm:
        cmd.append("--ignore-sigterm")
    return Launch(cmd, {API_KEY_ENV: slot.api_key, "OMP_NUM_THREADS": str(cfg.num_threads)})
