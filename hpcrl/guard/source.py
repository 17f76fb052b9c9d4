"""Where GPU temperatures come from: NVML on a GPU node, or a recorded trace replayed with its own times.

Trace format (JSON lines, UTF-8, one record per line; blank lines and lines starting with `#` are skipped;
the header is wrapped here for width only):

    {"hpcrl_trace": 1, "node": "gpu-017", "source": "nvml", "interval_s": 1.0,
     "gpus": [{"index": 0, "name": "NVIDIA H200", "slowdown_c": 90, "shutdown_c": 95}]}
    {"t_s": 0.0, "temperature_c": [41], "power_w": [118.2], "throttle": [["gpu_idle"]]}
    {"t_s": 1.0, "temperature_c": [55], "power_w": [650.9], "throttle": [[]]}

The first record is the header: `gpus` lists every GPU of the node with its NVML slowdown/shutdown
thresholds (null where NVML does not report one). Every other record is one reading of all GPUs, in
the header's order: `t_s` (seconds since the first reading, non-decreasing) and `temperature_c`
(null for a GPU that could not be read), optionally `power_w` and `throttle` (NVML clock-event reasons,
named as in THROTTLE_REASONS). A replay hands the guard each reading once its `t_s` has passed on the
guard's clock, so a trace drives the policy at exactly the recorded times, however the poll falls.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from hpcrl.guard.config import GuardConfig

TRACE_VERSION = 1
# NVML's clock-event ("throttle") reason bits, by the names used in traces and `hpcrl guard watch`.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "app_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock",
}


class GuardUnavailableError(RuntimeError):
    """No temperature source: NVML is missing, broken or finds no GPU."""


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    slowdown_c: float | None = None
    """NVML's slowdown threshold: the GPU throttles its clocks here (None: not reported)."""
    shutdown_c: float | None = None
    """NVML's shutdown threshold: the GPU powers off here (None: not reported)."""


@dataclass(frozen=True)
class Sample:
    t_s: float
    """Seconds since the source's start (NVML: the read time; trace: the recorded time)."""
    temperature_c: dict[int, float]
    """By GPU index; a GPU that could not be read is missing."""
    power_w: dict[int, float] = field(default_factory=dict)
    throttle: dict[int, tuple[str, ...]] = field(default_factory=dict)


class TemperatureSource(Protocol):
    """A node's GPUs and their readings."""

    name: str

    def gpus(self) -> list[GpuInfo]: ...

    def read(self, t_s: float) -> list[Sample]:
        """The readings taken up to `t_s` (seconds since start) that were not returned before, oldest first."""
        ...

    def close(self) -> None: ...


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_REASONS.items() if mask & bit)


class NvmlSource:
    """Every GPU NVML sees on this node (nvidia-ml-py). Raises GuardUnavailableError when there is none."""

    name = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml
        except ModuleNotFoundError as exc:
            raise GuardUnavailableError(
                "NVML is not available: the nvidia-ml-py package is not installed (pip install 'hpcrl[guard]')"
            ) from exc
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GuardUnavailableError(
                f"NVML is not available ({exc}): this machine has no NVIDIA driver, or it is not visible here"
            ) from exc
        try:
            self._handles, self._gpus = self._open_devices()
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        # Newer drivers renamed "clock throttle reasons" to "clock event reasons"; older bindings lack the new name.
        self._reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )

    def _open_devices(self) -> tuple[dict[int, Any], list[GpuInfo]]:
        nv = self._nvml
        count = nv.nvmlDeviceGetCount()
        handles: dict[int, Any] = {}
        gpus: list[GpuInfo] = []
        skipped: list[str] = []
        for index in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
            except nv.NVMLError as exc:
                # Slurm's device cgroup hides GPUs of other jobs: NVML lists them but cannot open them.
                skipped.append(f"{index} ({exc})")
                continue
            name = nv.nvmlDeviceGetName(handle)
            handles[index] = handle
            gpus.append(
                GpuInfo(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    slowdown_c=self._threshold(handle, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                    shutdown_c=self._threshold(handle, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
                )
            )
        if not gpus:
            extra = f" (could not open: {', '.join(skipped)})" if skipped else ""
            raise GuardUnavailableError(f"NVML finds no GPU on this node{extra}")
        return handles, gpus

    def _threshold(self, handle: Any, which: int) -> float | None:
        try:
            return float(self._nvml.nvmlDeviceGetTemperatureThreshold(handle, which))
        except self._nvml.NVMLError:
            return None

    def gpus(self) -> list[GpuInfo]:
        return list(self._gpus)

    def read(self, t_s: float) -> list[Sample]:
        nv = self._nvml
        temps: dict[int, float] = {}
        power: dict[int, float] = {}
        throttle: dict[int, tuple[str, ...]] = {}
        for index, handle in self._handles.items():
            # One failed read (a GPU fallen off the bus, a busy driver) must not blind the guard to the others.
            try:
                temps[index] = float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
            except nv.NVMLError:
                continue
            try:
                power[index] = nv.nvmlDeviceGetPowerUsage(handle) / 1000.0
            except nv.NVMLError:
                pass
            if self._reasons is not None:
                try:
                    throttle[index] = throttle_names(int(self._reasons(handle)))
                except nv.NVMLError:
                    pass
        return [Sample(t_s=t_s, temperature_c=temps, power_w=power, throttle=throttle)]

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


class TraceSource:
    """Replays a trace file (format in the module docstring): each reading once its time has come."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.name = f"trace:{self.path}"
        self.header, self.samples = read_trace(self.path)
        self._gpus = [
            GpuInfo(
                index=int(g["index"]),
                name=str(g.get("name", f"gpu{g['index']}")),
                slowdown_c=_opt_float(g.get("slowdown_c")),
                shutdown_c=_opt_float(g.get("shutdown_c")),
            )
            for g in self.header["gpus"]
        ]
        self._next = 0

    def gpus(self) -> list[GpuInfo]:
        return list(self._gpus)

    def read(self, t_s: float) -> list[Sample]:
        # After the last reading nothing new arrives: the policy keeps the last state it saw.
        start = self._next
        while self._next < len(self.samples) and self.samples[self._next].t_s <= t_s:
            self._next += 1
        return self.samples[start : self._next]

    @property
    def done(self) -> bool:
        """True once every reading has been returned."""
        return self._next >= len(self.samples)

    def close(self) -> None:
        pass


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def read_trace(path: Path) -> tuple[dict[str, Any], list[Sample]]:
    """Parses and checks a trace file; returns its header and readings."""
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist; record one with `hpcrl guard record -o {path}`")
    header: dict[str, Any] | None = None
    samples: list[Sample] = []
    indices: list[int] = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not a JSON object ({exc}); each line of a trace is one JSON object") from exc
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if header is None:
            header = _check_header(record, where)
            indices = [int(g["index"]) for g in header["gpus"]]
            continue
        samples.append(_parse_sample(record, indices, where, samples[-1].t_s if samples else None))
    if header is None:
        raise TraceError(f"{path} holds no header; the first record must be {{'hpcrl_trace': {TRACE_VERSION}, ...}}")
    if not samples:
        raise TraceError(f"{path} holds a header but no readings")
    return header, samples


def _check_header(record: dict[str, Any], where: str) -> dict[str, Any]:
    if record.get("hpcrl_trace") != TRACE_VERSION:
        raise TraceError(
            f'{where}: the first record must be the header with "hpcrl_trace": {TRACE_VERSION} '
            f"(got {json.dumps(record)[:120]}); see docs/thermal-guard.md for the format"
        )
    gpus = record.get("gpus")
    if not isinstance(gpus, list) or not gpus or not all(isinstance(g, dict) and "index" in g for g in gpus):
        raise TraceError(f'{where}: the header needs "gpus": a non-empty list of {{"index": N, ...}}')
    indices = [g["index"] for g in gpus]
    if len(set(indices)) != len(indices) or not all(isinstance(i, int) and i >= 0 for i in indices):
        raise TraceError(f"{where}: GPU indices must be distinct integers >= 0, got {indices}")
    return record


def _parse_sample(record: dict[str, Any], indices: list[int], where: str, last_t_s: float | None) -> Sample:
    t_s = record.get("t_s")
    if not isinstance(t_s, int | float) or isinstance(t_s, bool) or not math.isfinite(t_s) or t_s < 0:
        raise TraceError(f'{where}: "t_s" must be a number >= 0 (seconds since the first reading), got {t_s!r}')
    if last_t_s is not None and t_s < last_t_s:
        raise TraceError(f"{where}: t_s={t_s} is before the previous reading's t_s={last_t_s}; times must not decrease")
    columns: dict[str, list[Any]] = {}
    for key in ("temperature_c", "power_w", "throttle"):
        value = record.get(key)
        if value is None and key != "temperature_c":
            continue
        if not isinstance(value, list) or len(value) != len(indices):
            raise TraceError(
                f'{where}: "{key}" must be a list with one entry per GPU of the header ({len(indices)}), got {value!r}'
            )
        columns[key] = value
    temps = {i: float(v) for i, v in zip(indices, columns["temperature_c"], strict=True) if v is not None}
    power = {i: float(v) for i, v in zip(indices, columns.get("power_w", []), strict=False) if v is not None}
    throttle = {i: tuple(v) for i, v in zip(indices, columns.get("throttle", []), strict=False) if v is not None}
    return Sample(t_s=float(t_s), temperature_c=temps, power_w=power, throttle=throttle)


class TraceWriter:
    """Writes a trace as it is recorded; every line is flushed, so a killed recorder leaves a valid prefix."""

    def __init__(
        self, path: str | os.PathLike[str], gpus: Iterable[GpuInfo], *, source: str, interval_s: float
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._indices = [g.index for g in gpus]
        self._file: IO[str] = open(self.path, "w")  # noqa: SIM115 - closed in close()
        header = {
            "hpcrl_trace": TRACE_VERSION,
            "node": socket.gethostname(),
            "source": source,
            "interval_s": interval_s,
            "started_unix_s": round(time.time(), 3),
            "gpus": [
                {"index": g.index, "name": g.name, "slowdown_c": g.slowdown_c, "shutdown_c": g.shutdown_c} for g in gpus
            ],
        }
        self._line(header)

    def write(self, sample: Sample) -> None:
        self._line(
            {
                "t_s": round(sample.t_s, 3),
                "temperature_c": [sample.temperature_c.get(i) for i in self._indices],
                "power_w": [_round(sample.power_w.get(i)) for i in self._indices],
                "throttle": [list(sample.throttle.get(i, ())) for i in self._indices],
            }
        )

    def _line(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def nvidia_gpus_present() -> bool:
    """Whether this machine shows an NVIDIA GPU (a device node or the driver's GPU list), without NVML."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return any(Path("/dev").glob("nvidia[0-9]*")) or (gpus.is_dir() and any(gpus.iterdir()))


def open_source(
    cfg: GuardConfig, *, warn: Callable[[str], None], gpus_present: Callable[[], bool] = nvidia_gpus_present
) -> TemperatureSource | None:
    """The source the config asks for; None when the guard is off.

    guard.mode=auto on a machine without NVIDIA GPUs (a CPU run) is off without a word: there is nothing to
    watch, and a warning on every CPU run teaches users to ignore warnings. Where GPUs are present but NVML
    cannot read them, auto warns once.
    """
    if cfg.mode == "off":
        return None
    if cfg.trace is not None:
        return TraceSource(cfg.trace)
    try:
        return NvmlSource()
    except GuardUnavailableError as exc:
        if cfg.mode == "auto" and not gpus_present():
            return None
        if cfg.mode == "on":
            raise GuardUnavailableError(
                f"guard.mode=on but {exc}; run where NVML sees the GPUs, replay a recorded trace with "
                "guard.trace=FILE, or set guard.mode=auto (guard off with a warning) or guard.mode=off"
            ) from exc
        warn(
            f"warning: thermal guard off: {exc}; GPU temperatures are not watched "
            "(guard.mode=off silences this, guard.mode=on makes it an error)"
        )
        return None
