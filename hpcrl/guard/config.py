"""Thermal guard settings (the `guard:` section of a run config)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, frozen=True)
class GuardConfig:
    """The thermal guard: pauses training and generation while a GPU of the node is too hot, and stops the run
    if it stays hot."""

    mode: Literal["auto", "on", "off"] = "auto"
    """`auto`: guard when NVML finds GPUs (or `trace` is set), else off with one warning line; `on`: a run
    without NVML (and without `trace`) stops with an error; `off`: no guard."""
    hot_c: float = 84.0
    """Pause when a GPU reaches this temperature (°C)."""
    warmup_hot_c: float = 80.0
    """The pause threshold during the first `warmup_s` seconds (never above `hot_c`): a machine's cooling
    lags the load at first."""
    warmup_s: float = 1800.0
    """How long the warmup threshold applies, from the start of the guard."""
    cool_c: float = 72.0
    """Resume when every GPU of the node is at or below this temperature (hysteresis)."""
    min_pause_s: float = 10.0
    """A pause lasts at least this long, so a reading that dips under `cool_c` once does not flap."""
    margin_c: float = 5.0
    """The pause threshold of a GPU is never above its own slowdown threshold (NVML) minus this margin."""
    poll_s: float = 1.0
    """Seconds between temperature reads."""
    stop_after_s: float = 60.0
    """When a GPU is still at or above its pause threshold this long after a pause began, SIGSTOP the local
    worker processes (engines, trainer followers) until it cools; SIGCONT at resume."""
    max_pause_s: float = 120.0
    """The longest one pause may last: a GPU that has not cooled to `cool_c` by then stops the run with an
    error (rerun to resume). sync.group_timeout_s and rollout.request_timeout_s must be longer."""
    trace: str | None = None
    """Replay a recorded temperature trace (JSON lines, docs/thermal-guard.md) instead of reading NVML."""

    def __post_init__(self) -> None:
        for name in ("hot_c", "warmup_hot_c", "cool_c"):
            if not 0 < getattr(self, name) < 150:
                raise ValueError(f"guard.{name} must be a temperature in (0, 150) °C, got {getattr(self, name)}")
        lowest_hot = min(self.warmup_hot_c, self.hot_c) if self.warmup_s > 0 else self.hot_c
        if self.cool_c >= lowest_hot:
            raise ValueError(
                f"guard.cool_c ({self.cool_c}) must be below the pause threshold ({lowest_hot}), or a pause could "
                "never end: lower cool_c or raise hot_c/warmup_hot_c"
            )
        for name in ("poll_s", "stop_after_s", "max_pause_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"guard.{name} must be > 0, got {getattr(self, name)}")
        for name in ("warmup_s", "min_pause_s", "margin_c"):
            if getattr(self, name) < 0:
                raise ValueError(f"guard.{name} must be >= 0, got {getattr(self, name)}")
        if self.min_pause_s >= self.max_pause_s:
            raise ValueError(
                f"guard.min_pause_s ({self.min_pause_s}) must be below guard.max_pause_s ({self.max_pause_s})"
            )
        if self.stop_after_s >= self.max_pause_s:
            raise ValueError(
                f"guard.stop_after_s ({self.stop_after_s}) must be below guard.max_pause_s ({self.max_pause_s}), "
                "or a GPU that keeps heating would stop the run before its workers are ever stopped"
            )
        if self.poll_s > self.stop_after_s:
            raise ValueError(f"guard.poll_s ({self.poll_s}) must not exceed guard.stop_after_s ({self.stop_after_s})")
        if self.mode == "off" and self.trace is not None:
            warnings.warn(f"guard.trace={self.trace} has no effect with guard.mode=off", stacklevel=2)
