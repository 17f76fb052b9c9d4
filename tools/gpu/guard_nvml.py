"""The thermal guard on a real GPU: NVML readings under load, a recorded trace, and a forced pause in a run.

    PYTHONPATH=. python3 tools/gpu/guard_nvml.py --out $OUT [--load-s 60] [--cool-s 20] [--gpu 0] [KEY=VALUE ...]

1. Opens NVML through hpcrl's NvmlSource and prints every GPU with its slowdown/shutdown thresholds.
2. Runs a bf16 matmul loop on --gpu for --load-s seconds, then idles --cool-s seconds, reading every GPU
   each --interval-s through NVML; writes the readings as a trace ($OUT/guard_nvml_trace.jsonl, the
   format of docs/thermal-guard.md; commit it as tests/data/guard_nvml_<gpu>.jsonl for the replay tests).
3. Runs a GPU quickstart (`hpcrl run experiments/quickstart.yaml engine.device=cuda train.device=cuda
   guard.mode=on ...`) with thresholds just above the current temperature (hot_c = T + --hot-delta-c,
   cool_c = T + --cool-delta-c, no warmup). Once its first step is logged, the same matmul load heats
   the GPU until it is --overshoot-c over hot_c (or --max-heat-s passed): the guard pauses the run,
   stops its workers when the GPU keeps heating (stop_after_s), and resumes when it has cooled. A few
   steps after the resume the run gets SIGTERM (it checkpoints and exits 143, the preemption path).
   NVML readings during the run go to $OUT/guard_nvml_run_trace.jsonl.
4. Prints the thermal_pause / thermal_resume events and the guard metrics from the run's metrics.h5,
   and writes everything as $OUT/guard_nvml.json (plus the run's metrics.h5 and stdout).
About 3 minutes on one H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from hpcrl.guard.source import NvmlSource, Sample, TraceWriter  # noqa: E402
from hpcrl.store import load_events, load_metrics  # noqa: E402


class Heater:
    """A bf16 matmul loop on one GPU in a background thread, until stop() or until `until()` is true."""

    def __init__(self, gpu: int, size: int = 8192) -> None:
        self.device = torch.device(f"cuda:{gpu}")
        self.a = torch.randn(size, size, device=self.device, dtype=torch.bfloat16)
        self.b = torch.randn(size, size, device=self.device, dtype=torch.bfloat16)
        self.flop_per_matmul = 2 * size**3
        self.num_matmuls = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, until: Any = lambda: False, max_s: float = 1e9) -> None:
        self._stop.clear()

        def loop() -> None:
            t0 = time.perf_counter()
            while not self._stop.is_set() and not until() and time.perf_counter() - t0 < max_s:
                for _ in range(20):
                    torch.mm(self.a, self.b)
                torch.cuda.synchronize(self.device)
                self.num_matmuls += 20
            self.seconds += time.perf_counter() - t0

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def tflops(self) -> float:
        return self.flop_per_matmul * self.num_matmuls / max(self.seconds, 1e-9) / 1e12


class Recorder:
    """NVML readings every interval_s into a trace file (and memory), in a background thread."""

    def __init__(self, source: NvmlSource, path: Path, interval_s: float) -> None:
        self.source = source
        self.interval_s = interval_s
        self.writer = TraceWriter(path, source.gpus(), source="nvml", interval_s=interval_s)
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        tick = 0
        while not self._stop.is_set():
            for sample in self.source.read(time.monotonic() - self._t0):
                self.writer.write(sample)
                self.samples.append(sample)
            tick += 1
            self._stop.wait(max(0.0, self._t0 + tick * self.interval_s - time.monotonic()))

    def latest(self, gpu: int) -> float:
        for sample in reversed(self.samples):
            if gpu in sample.temperature_c:
                return sample.temperature_c[gpu]
        return float("nan")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.writer.close()


def summarize_load(samples: list[Sample], gpu: int, load_s: float) -> dict[str, Any]:
    temps = [(s.t_s, s.temperature_c[gpu]) for s in samples if gpu in s.temperature_c]
    during = [(t, c) for t, c in temps if t <= load_s]
    peak_t, peak_c = max(during, key=lambda x: x[1])
    power = [s.power_w[gpu] for s in samples if gpu in s.power_w]
    throttle = sorted({r for s in samples for r in s.throttle.get(gpu, ())})
    return {
        "start_c": temps[0][1],
        "peak_c": peak_c,
        "peak_at_s": peak_t,
        "end_of_load_c": during[-1][1],
        "end_of_cooldown_c": temps[-1][1],
        "rise_c_per_s_first_10_s": round((max(c for t, c in during if t <= 10) - temps[0][1]) / 10, 3),
        "peak_power_w": max(power) if power else None,
        "throttle_reasons_seen": throttle,
    }


def run_quickstart(args: argparse.Namespace, source: NvmlSource, heater: Heater, out: Path) -> dict[str, Any]:
    recorder = Recorder(source, out / "guard_nvml_run_trace.jsonl", args.interval_s)
    time.sleep(2 * args.interval_s)
    now_c = round(recorder.latest(args.gpu), 1)
    hot_c, cool_c = round(now_c + args.hot_delta_c, 1), round(now_c + args.cool_delta_c, 1)
    run_dir = Path(tempfile.mkdtemp(prefix="guard_nvml_run_"))
    cmd = [
        sys.executable, "-m", "hpcrl.cli", "run", "experiments/quickstart.yaml",
        "num_steps=100000", "sft.num_steps=0", "checkpoint.every_steps=1000",
        "engine.device=cuda", "train.device=cuda",
        "guard.mode=on", "guard.warmup_s=0", f"guard.hot_c={hot_c:g}", f"guard.cool_c={cool_c:g}",
        f"guard.poll_s={args.interval_s:g}", "guard.min_pause_s=3", "guard.stop_after_s=5",
        f"guard.max_pause_s={args.max_pause_s:g}", *args.overrides, "--run-dir", str(run_dir),
    ]  # fmt: skip
    print(f"\n== run: GPU {args.gpu} at {now_c:g} °C -> hot_c={hot_c:g} cool_c={cool_c:g}\n$ {' '.join(cmd[2:])}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": str(args.gpu)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    first_step, resumed = threading.Event(), threading.Event()

    def read_output() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step ") and not first_step.is_set():
                first_step.set()
            if not line.startswith("step "):
                print("   " + line, end="", flush=True)
            if line.startswith("thermal resume"):
                resumed.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    deadline = time.monotonic() + args.run_timeout_s

    def wait_for(event: threading.Event) -> bool:
        # A run that exits early (a startup error) must not keep this script waiting until the deadline.
        while not event.wait(0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
        return True

    outcome = "no first step"
    if wait_for(first_step):
        heater.start(until=lambda: recorder.latest(args.gpu) >= hot_c + args.overshoot_c, max_s=args.max_heat_s)
        outcome = "resumed" if wait_for(resumed) else "no resume"
        heater.stop()
        time.sleep(3)  # a few steps after the resume
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the preemption path: checkpoint, exit 143
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(timeout=10)
    recorder.stop()
    (out / "run_stdout.txt").write_text("".join(lines))
    result: dict[str, Any] = {"start_c": now_c, "hot_c": hot_c, "cool_c": cool_c, "outcome": outcome}
    result |= {"exit_code": proc.returncode, "heater_tflops": round(heater.tflops(), 1)}
    metrics_path = run_dir / "metrics.h5"
    if metrics_path.exists():
        shutil.copy(metrics_path, out / "run_metrics.h5")
        events = [e for e in load_events(metrics_path) if e["kind"].startswith("thermal_") or e["kind"] == "preempted"]
        m = load_metrics(metrics_path)
        result["events"] = events
        result["num_steps"] = len(m["step"])
        if "guard/paused_s" in m:
            result["paused_s_total"] = round(float(m["guard/paused_s"].sum()), 2)
            result["steps_with_pause"] = int((m["guard/paused_s"] > 0).sum())
            peaks = [float(v.max()) for k, v in m.items() if k.startswith("guard/peak_temp_c/")]
            result["peak_temp_c"] = max(peaks) if peaks else None
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder ($OUT)")
    p.add_argument("--gpu", type=int, default=0, help="GPU (NVML / CUDA index) to load")
    p.add_argument("--load-s", type=float, default=60.0)
    p.add_argument("--cool-s", type=float, default=20.0)
    p.add_argument("--interval-s", type=float, default=0.5)
    p.add_argument("--hot-delta-c", type=float, default=4.0, help="run's hot_c = current temperature + this")
    p.add_argument("--cool-delta-c", type=float, default=1.0, help="run's cool_c = current temperature + this")
    p.add_argument("--overshoot-c", type=float, default=2.0, help="heat the run's GPU to hot_c + this")
    p.add_argument("--max-heat-s", type=float, default=60.0)
    p.add_argument("--max-pause-s", type=float, default=100.0)
    p.add_argument("--run-timeout-s", type=float, default=150.0, help="bound on the run's start, heating and pause")
    p.add_argument("overrides", nargs="*", help="extra overrides for the run, e.g. sync.transport=distributed")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU", file=sys.stderr)
        return 1
    source = NvmlSource()
    report: dict[str, Any] = {"gpus": [dataclasses.asdict(g) for g in source.gpus()], "torch": torch.__version__}
    print("== NVML")
    for g in source.gpus():
        print(f"   GPU {g.index}: {g.name}, slowdown {g.slowdown_c} °C, shutdown {g.shutdown_c} °C")

    print(f"\n== load: bf16 8192^3 matmuls on GPU {args.gpu} for {args.load_s:g} s, then {args.cool_s:g} s idle")
    heater = Heater(args.gpu)
    recorder = Recorder(source, out / "guard_nvml_trace.jsonl", args.interval_s)
    heater.start(max_s=args.load_s)
    t0 = time.monotonic()
    while heater.running():
        time.sleep(5)
        print(f"   {time.monotonic() - t0:5.0f} s  GPU {args.gpu} {recorder.latest(args.gpu):g} °C", flush=True)
    heater.stop()
    time.sleep(args.cool_s)
    recorder.stop()
    report["load"] = summarize_load(recorder.samples, args.gpu, args.load_s) | {"tflops": round(heater.tflops(), 1)}
    report["trace"] = {"path": "guard_nvml_trace.jsonl", "num_readings": len(recorder.samples)}
    print("   " + json.dumps(report["load"]))

    heater.num_matmuls, heater.seconds = 0, 0.0
    report["run"] = run_quickstart(args, source, heater, out)
    source.close()
    print("\n== thermal events in the run's metrics.h5")
    for e in report["run"].get("events", []):
        print(f"   step {e['step']}: {e['kind']} {json.dumps(e['detail'], sort_keys=True)}")
    summary = {k: v for k, v in report["run"].items() if k != "events"}
    print("   " + json.dumps(summary))
    (out / "guard_nvml.json").write_text(json.dumps(report, indent=2, default=str))
    kinds = [e["kind"] for e in report["run"].get("events", [])]
    ok = "thermal_pause" in kinds and "thermal_resume" in kinds
    print(f"\n{'OK' if ok else 'FAILED'}: pause and resume events {'found' if ok else 'missing'}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
