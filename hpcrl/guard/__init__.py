"""The thermal guard (docs/thermal-guard.md): pause work while a GPU is too hot, resume when it has cooled.

config.py (GuardConfig), source.py (NVML and recorded traces), policy.py (the pure state machine),
guard.py (ThermalGuard: polling thread, phase-boundary waits, SIGSTOP escalation), cli.py (`hpcrl guard`).
pynvml is imported only when an NVML source is opened.
"""

from hpcrl.guard.config import GuardConfig
from hpcrl.guard.guard import Guard, OffGuard, ThermalGuard, ThermalGuardError
from hpcrl.guard.policy import Decision, ThermalPolicy
from hpcrl.guard.source import (
    GpuInfo,
    GuardUnavailableError,
    NvmlSource,
    Sample,
    TemperatureSource,
    TraceError,
    TraceSource,
    TraceWriter,
    open_source,
)

__all__ = [
    "Decision",
    "GpuInfo",
    "Guard",
    "GuardConfig",
    "GuardUnavailableError",
    "NvmlSource",
    "OffGuard",
    "Sample",
    "TemperatureSource",
    "ThermalGuard",
    "ThermalGuardError",
    "ThermalPolicy",
    "TraceError",
    "TraceSource",
    "TraceWriter",
    "open_source",
]
