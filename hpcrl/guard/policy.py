"""The thermal policy: a pure state machine from (time, temperature of each GPU) to pause/resume decisions.

One policy per node; the node is either running or paused.
- Pause when any GPU reaches its threshold: `warmup_hot_c` while t < `warmup_s` (never above `hot_c`),
  then `hot_c`; either capped at the GPU's own slowdown threshold minus `margin_c`.
- Resume when every GPU is at or below `cool_c` (hysteresis: a GPU hovering around the pause threshold
  does not flap) and the pause has lasted `min_pause_s`.
- Escalate (once per pause) when a GPU is still at or above its threshold `stop_after_s` into the pause:
  the cooperative pause did not stop the heat.
- Overheat when a pause reaches `max_pause_s` without resuming: the run must stop.
Decisions happen at reading times only, so a replayed trace gives the same decisions at the same times.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from hpcrl.guard.config import GuardConfig

DecisionKind = Literal["pause", "escalate", "resume", "overheat"]


@dataclass(frozen=True)
class Decision:
    kind: DecisionKind
    t_s: float
    """The reading's time (seconds since the guard started) at which the policy decided."""
    gpu: int
    """pause/escalate: the GPU over its threshold; resume/overheat: the hottest GPU."""
    temperature_c: float
    threshold_c: float
    """pause/escalate: that GPU's pause threshold; resume/overheat: cool_c."""
    duration_s: float = 0.0
    """Seconds since the pause began (0 for pause)."""


class ThermalPolicy:
    def __init__(self, cfg: GuardConfig, slowdown_c: Mapping[int, float | None]) -> None:
        """`slowdown_c`: each GPU's NVML slowdown threshold (None where unknown)."""
        self.cfg = cfg
        self.slowdown_c = dict(slowdown_c)
        for gpu, slowdown in self.slowdown_c.items():
            if slowdown is not None and slowdown - cfg.margin_c <= cfg.cool_c:
                raise ValueError(
                    f"GPU {gpu} slows itself down at {slowdown:g} °C, so its pause threshold is capped at "
                    f"{slowdown - cfg.margin_c:g} °C (guard.margin_c={cfg.margin_c:g}), which is not above "
                    f"guard.cool_c={cfg.cool_c:g}: lower guard.cool_c or guard.margin_c"
                )
        self.temps: dict[int, float] = {}
        self.paused = False
        self.escalated = False
        self.overheated = False
        self.pause_start_s = 0.0

    def threshold_c(self, gpu: int, t_s: float) -> float:
        base = min(self.cfg.warmup_hot_c, self.cfg.hot_c) if t_s < self.cfg.warmup_s else self.cfg.hot_c
        slowdown = self.slowdown_c.get(gpu)
        return base if slowdown is None else min(base, slowdown - self.cfg.margin_c)

    def update(self, t_s: float, temps: Mapping[int, float]) -> list[Decision]:
        """Feed one reading; GPUs missing from it keep their last temperature."""
        self.temps.update(temps)
        if not self.temps or self.overheated:
            return []
        if not self.paused:
            return self._maybe_pause(t_s)
        # Rounded so that readings at decimal times compare exactly (1.5 - 1.1 is 0.3999... in binary).
        duration = round(t_s - self.pause_start_s, 9)
        hottest = max(self.temps, key=lambda g: (self.temps[g], -g))
        if duration >= self.cfg.min_pause_s and self.temps[hottest] <= self.cfg.cool_c:
            self.paused, self.escalated = False, False
            return [Decision("resume", t_s, hottest, self.temps[hottest], self.cfg.cool_c, duration)]
        if duration >= self.cfg.max_pause_s:
            self.overheated = True
            return [Decision("overheat", t_s, hottest, self.temps[hottest], self.cfg.cool_c, duration)]
        if not self.escalated and duration >= self.cfg.stop_after_s:
            over = self._over_threshold(t_s)
            if over is not None:
                self.escalated = True
                return [Decision("escalate", t_s, over, self.temps[over], self.threshold_c(over, t_s), duration)]
        return []

    def _over_threshold(self, t_s: float) -> int | None:
        """The GPU furthest over its threshold (lowest index on a tie), None when none is over."""
        over = [g for g, temp in self.temps.items() if temp >= self.threshold_c(g, t_s)]
        if not over:
            return None
        return max(over, key=lambda g: (self.temps[g] - self.threshold_c(g, t_s), -g))

    def _maybe_pause(self, t_s: float) -> list[Decision]:
        gpu = self._over_threshold(t_s)
        if gpu is None:
            return []
        self.paused, self.escalated, self.pause_start_s = True, False, t_s
        return [Decision("pause", t_s, gpu, self.temps[gpu], self.threshold_c(gpu, t_s))]

    def describe(self, t_s: float) -> str:
        """What the policy is doing now, in words (for `hpcrl guard watch`)."""
        if self.overheated:
            return f"OVERHEAT: paused over max_pause_s={self.cfg.max_pause_s:g} s, a run would stop"
        if self.paused:
            stopped = ", workers stopped" if self.escalated else ""
            return f"PAUSED {t_s - self.pause_start_s:.0f} s{stopped}; resume at <= {self.cfg.cool_c:g} °C"
        return "run"
