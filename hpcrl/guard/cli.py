"""`hpcrl guard`: look at the GPUs' temperatures the way the thermal guard does, and record traces.

hpcrl guard watch [--interval-s 1] [--count N] [--trace FILE] [hot_c=80 cool_c=70 ...]
hpcrl guard record -o trace.jsonl [--duration-s 60] [--interval-s 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

from hpcrl.guard.config import GuardConfig
from hpcrl.guard.policy import ThermalPolicy
from hpcrl.guard.source import (
    GpuInfo,
    GuardUnavailableError,
    NvmlSource,
    Sample,
    TemperatureSource,
    TraceSource,
    TraceWriter,
)
from hpcrl.store.run_dir import path_arg


def add_guard_commands(sub: argparse._SubParsersAction) -> None:
    guard = sub.add_parser("guard", help="GPU temperatures: watch them live, record a trace")
    cmds = guard.add_subparsers(dest="guard_cmd", required=True)
    p = cmds.add_parser(
        "watch",
        help="print live GPU temperatures and what the thermal guard's policy would do",
        description="Poll every GPU of this node through NVML (or replay --trace) and print, per reading, each "
        "GPU's temperature, its pause threshold, power and clock-throttle reasons, and the policy's state "
        "(run / PAUSED / workers stopped). Guard settings are the run config's guard section, as KEY=VALUE.",
        epilog="example: hpcrl guard watch --count 10 hot_c=80 cool_c=70",
    )
    p.add_argument("overrides", nargs="*", help="guard settings, e.g. hot_c=80 warmup_s=0 (see GuardConfig)")
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between readings (default 1)")
    p.add_argument("--count", type=int, default=None, help="stop after this many readings (default: until Ctrl-C)")
    p.add_argument("--trace", default=None, help="replay this recorded trace instead of reading NVML")
    p.set_defaults(func=_watch)
    p = cmds.add_parser(
        "record",
        help="record this node's GPU temperatures to a trace file (replay with guard.trace=FILE)",
        description="Read every GPU through NVML each --interval-s and write a JSON-lines trace "
        "(format: docs/thermal-guard.md). Each line is flushed, so an interrupted recording stays usable.",
        epilog="example: hpcrl guard record -o runs/traces/gpu.jsonl --duration-s 600",
    )
    p.add_argument("-o", "--output", type=path_arg, required=True, help="trace file to write (JSON lines)")
    p.add_argument("--duration-s", type=float, default=60.0, help="how long to record (default 60)")
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between readings (default 1)")
    p.set_defaults(func=_record)


def _open_nvml() -> NvmlSource:
    try:
        return NvmlSource()
    except GuardUnavailableError as exc:
        raise GuardUnavailableError(f"{exc}; on a machine without GPUs, replay a trace: --trace FILE") from exc


def _check_interval(interval_s: float) -> None:
    if not interval_s > 0:
        raise ValueError(f"--interval-s must be > 0, got {interval_s}")


def _guard_config(overrides: list[str]) -> GuardConfig:
    from hpcrl.config import apply_overrides, from_dict

    return from_dict(GuardConfig, apply_overrides({}, overrides, cls=GuardConfig), path="guard")


def _watch(ns: argparse.Namespace) -> int:
    _check_interval(ns.interval_s)
    cfg = _guard_config(ns.overrides)
    source: TemperatureSource = TraceSource(ns.trace) if ns.trace else _open_nvml()
    try:
        gpus = source.gpus()
        policy = ThermalPolicy(cfg, {g.index: g.slowdown_c for g in gpus})
        print(_describe_gpus(gpus, source.name), flush=True)
        for sample in _samples(source, ns.interval_s, ns.count):
            decisions = policy.update(sample.t_s, sample.temperature_c)
            said = "; ".join(f"{d.kind} (GPU {d.gpu} {d.temperature_c:g} °C)" for d in decisions)
            print(f"{_format_sample(sample, policy)} | {policy.describe(sample.t_s)}{' <- ' + said if said else ''}")
    finally:
        source.close()
    return 0


def _record(ns: argparse.Namespace) -> int:
    _check_interval(ns.interval_s)
    if not ns.duration_s > 0:
        raise ValueError(f"--duration-s must be > 0, got {ns.duration_s}")
    source = _open_nvml()
    count = int(ns.duration_s / ns.interval_s) + 1
    writer = TraceWriter(ns.output, source.gpus(), source="nvml", interval_s=ns.interval_s)
    try:
        print(f"recording {count} readings of {len(source.gpus())} GPU(s) to {ns.output}", flush=True)
        for sample in _samples(source, ns.interval_s, count):
            writer.write(sample)
    finally:
        writer.close()
        source.close()
    print(f"wrote {ns.output}; replay it with guard.trace={ns.output}")
    return 0


def _samples(source: TemperatureSource, interval_s: float, count: int | None) -> Iterator[Sample]:
    """Readings at t = 0, interval, 2 interval, ... (ticks do not drift with the time a read takes)."""
    t0 = time.monotonic()
    done = 0
    tick = 0
    while count is None or done < count:
        time.sleep(max(0.0, t0 + tick * interval_s - time.monotonic()))
        for sample in source.read(time.monotonic() - t0):
            yield sample
            done += 1
            if count is not None and done >= count:
                return
        tick += 1
        if isinstance(source, TraceSource) and source.done:
            return


def _describe_gpus(gpus: list[GpuInfo], source_name: str) -> str:
    parts = [f"GPU {g.index} {g.name} (slowdown {_c(g.slowdown_c)}, shutdown {_c(g.shutdown_c)})" for g in gpus]
    return f"{source_name}: " + "; ".join(parts)


def _c(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g} °C"


def _format_sample(sample: Sample, policy: ThermalPolicy) -> str:
    cells = []
    for gpu, temp in sorted(sample.temperature_c.items()):
        power = f" {sample.power_w[gpu]:.0f} W" if gpu in sample.power_w else ""
        throttle = f" [{','.join(sample.throttle[gpu])}]" if sample.throttle.get(gpu) else ""
        cells.append(f"gpu{gpu} {temp:g}/{policy.threshold_c(gpu, sample.t_s):g} °C{power}{throttle}")
    return f"{sample.t_s:8.1f} s | " + " | ".join(cells)
