"""Rollout engine settings (the engines a run starts and drives)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    kind: Literal["embedded"] = "embedded"
    """`embedded` runs hpcrl's own engine; real `sglang` servers arrive with the engine-fleet issue."""
    num_engines: int = 1
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_running_requests: int = 256
    deterministic: bool = True
    """Batches form only on an idle engine: a resumed run regenerates exactly what it would have."""
    onpolicy_logprobs: bool = False
    """Engines score finished sequences with the trainer's forward (pair with train.onpolicy)."""
    num_threads: int = 1
    startup_timeout_s: float = 120.0
    base_port: int = 0
    """First port; 0 picks free ports."""

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {self.num_engines}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be > 0")
