"""The command line of a real SGLang server for one engine slot (sglang-contract.md, "Server CLI flags").

hpcrl never imports sglang: it starts `python -m sglang.launch_server` as a process and drives it over
HTTP with the same client as the embedded engine.

The API key never goes on the command line, where `ps` shows it to every user of the node. SGLang 0.5.16
has no environment variable for it, but `prepare_server_args` (srt/server_args.py) expands `--config
FILE.yaml` (yaml.safe_load, srt/server_args_config_parser.py) into arguments inside the process, so the
key goes in a 0600 YAML file named by `--config`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpcrl.engine.client import EngineClient
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.launch import Launch, LaunchSlot, write_private


def sglang_env() -> dict[str, str]:
    """Environment for a stock SGLang server that hpcrl supervises.

    0.5.16's /health runs a one-token generation by default (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION).
    The fleet probes /health every second, also while a colocated engine has released its KV cache for
    the trainer; a probe that generates then schedules a prefill into unmapped memory and the scheduler
    dies (seen on the H200: "Pointer argument cannot be accessed from Triton" at step 26 of the
    quickstart). hpcrl's probe is for liveness; a stuck scheduler shows as requests that time out.
    """
    return {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}


def write_sglang_config(path: Path, *, api_key: str) -> Path:
    """The 0600 YAML file that gives SGLang its key; written whole or not at all (the suffix must be .yaml)."""
    if path.suffix not in (".yaml", ".yml"):
        raise ValueError(f"{path}: SGLang reads --config only from a .yaml or .yml file")
    # A JSON string is a YAML string: a key of digits must not load as a number.
    return write_private(path, f"api-key: {json.dumps(api_key)}\n")


def sglang_command(
    cfg: EngineConfig,
    *,
    python: str,
    model_dir: str,
    host: str,
    port: int,
    config_file: str | Path,
    seed: int,
    weight_version: str,
    base_gpu_id: int = 0,
) -> list[str]:
    cmd = [
        python, "-m", "sglang.launch_server",
        "--model-path", model_dir,
        "--host", host,
        "--port", str(port),
        "--config", str(config_file),  # holds the API key: see write_sglang_config
        "--tp-size", str(cfg.tp_size),
        "--random-seed", str(seed),
        "--weight-version", weight_version,
        "--base-gpu-id", str(base_gpu_id),
        "--dtype", cfg.dtype,
        "--max-running-requests", str(cfg.max_running_requests),
        # hpcrl probes /health itself and pushes weights before the first rollout.
        "--skip-server-warmup",
    ]  # fmt: skip
    if cfg.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.deterministic:
        cmd.append("--enable-deterministic-inference")
    # Sampling supports (top-k/top-p replay) need no launch flag here: 0.5.16's server arguments (its
    # /server_info, tests/golden/sglang-0.5.16/server_info.json) have none for them; each request's top_k
    # bounds its supports, and SGLang refuses return_sampling_mask without a finite top_k.
    return cmd + list(cfg.sglang_args)


def sglang_launch(cfg: EngineConfig, slot: LaunchSlot) -> Launch:
    """A stock SGLang server for one slot: its key in a 0600 --config file, /health without generation."""
    check_sglang_loads_head(slot.model_dir)
    config_file = write_sglang_config(
        slot.run_dir / "engines" / f"engine-{slot.index}.sglang.yaml", api_key=slot.api_key
    )
    cmd = sglang_command(
        cfg, python=sys.executable, model_dir=slot.model_dir, host=slot.host, port=slot.port,
        config_file=config_file, seed=slot.seed, weight_version="0", base_gpu_id=slot.position * cfg.tp_size,
    )  # fmt: skip
    return Launch(cmd, {"OMP_NUM_THREADS": str(cfg.num_threads), **sglang_env()})


def check_sglang_loads_head(model_dir: str | Path) -> None:
    """Refuse a tied Qwen3-MoE checkpoint: SGLang 0.5.16's Qwen3MoeForCausalLM builds its own lm_head whatever
    tie_word_embeddings says and loads it only from an `lm_head.weight` a tied checkpoint does not store, so it would
    sample from all-equal logits (every log-prob -ln(vocab)) while its routes look right."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return  # not readable from here; SGLang reports a missing model itself
    config = json.loads(config_file.read_text())
    if "Qwen3MoeForCausalLM" in (config.get("architectures") or []) and config.get("tie_word_embeddings", False):
        raise ValueError(
            f"{model_dir} is a Qwen3-MoE checkpoint with tie_word_embeddings: true, whose output head SGLang 0.5.16 "
            "leaves unloaded (every token's log-prob would be -ln(vocab)): write it untied (tie_word_embeddings: "
            "false and an lm_head.weight, e.g. a copy of model.embed_tokens.weight), as published Qwen3-MoE models "
            "and `hpcrl model init-tiny --moe` are, or serve it with engine.kind: embedded"
        )


ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
"""The SGLang 0.5.16 server flag without which /generate's return_routed_experts answers no routes."""


class RoutesNotCapturedError(RuntimeError):
    """An engine serving a mixture-of-experts model was started without routed-expert capture."""


def captures_routed_experts(info: dict[str, Any]) -> bool | None:
    """Whether a /server_info answer says the server returns routed experts: hpcrl's embedded engine always does;
    SGLang lists its `enable_return_routed_experts` server argument at the top level and in each scheduler's
    `internal_states`. None when the answer does not say (an older server)."""
    if info.get("engine") == "hpcrl-embedded":
        return True
    key = "enable_return_routed_experts"
    if key in info:
        return bool(info[key])
    states = [s for s in info.get("internal_states") or () if isinstance(s, dict) and key in s]
    return all(bool(s[key]) for s in states) if states else None


def check_routed_experts_capture(engines: Sequence[EngineClient], *, replay: str, timeout_s: float = 30.0) -> None:
    """At start-up, before any rollout: each engine must return the routed experts that train.routing_replay
    (`replay`: observe or rollout) asks of a mixture-of-experts model; a server that says it will not is refused
    here, naming the flag, rather than at the first step's /generate."""
    for engine in engines:
        if captures_routed_experts(engine.server_info(timeout_s=timeout_s)) is False:
            raise RoutesNotCapturedError(
                f"the SGLang server at {engine.url} was started without {ROUTED_EXPERTS_FLAG}, so it returns no "
                f"routed experts, which train.routing_replay: {replay} needs for this mixture-of-experts model: add "
                f"{ROUTED_EXPERTS_FLAG} to engine.sglang_args (or to the server's command line), or set "
                "train.routing_replay: off"
            )
