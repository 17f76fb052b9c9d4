"""The calculator tool's cost per call: the fork server against a fresh interpreter per call, in one run.

    PYTHONPATH=. python tools/bench/calculator_calls.py [--calls 128] [--threads 32] [--rounds 3]

Each round makes `--calls` calls of `123*45` one after another, then `--calls` calls from `--threads` threads at
once (as a GRPO step's episodes call the tool together), first through `sandbox.run_python` (the fork server),
then through `sandbox.run_in_new_process` (what every call cost before the server). CPU is counted over every
process involved: this one, the server and its children (/proc/<server>/stat: utime + stime + cutime + cstime),
or the reaped children of this process for the fresh interpreters.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hpcrl.sessions import sandbox, sandbox_server  # noqa: E402

CODE = "123*45"


def _server_cpu_s() -> float:
    server = sandbox_server._server
    if server is None:
        return 0.0
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime (fields 14-17 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + _server_cpu_s()


def _measure(call: Callable[[], sandbox.ToolResult], calls: int, threads: int) -> dict[str, float]:
    out = {}
    for label, workers in (("sequential", 1), (f"{threads} threads", threads)):
        c0, t0 = _cpu_s(), time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda _: call(), range(calls)))
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
        bad = [r for r in results if r.content != "5535"]
        if bad:
            raise SystemExit(f"a call answered {bad[0]!r}")
        out[f"{label} wall ms/call"] = 1000 * wall / calls
        out[f"{label} cpu ms/call"] = 1000 * cpu / calls
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=128)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    limits = sandbox.SandboxLimits()
    cap = sandbox.output_cap(limits)

    def server() -> sandbox.ToolResult:
        return sandbox.run_python(CODE, limits)

    def fresh() -> sandbox.ToolResult:
        return sandbox._result(*sandbox.run_in_new_process(CODE, limits, cap), limits)

    server()  # start the server outside the timed rounds (its start-up is paid once per process)
    rows: dict[str, dict[str, list[float]]] = {"fork server": {}, "fresh interpreter": {}}
    for r in range(ns.rounds):
        for name, fn in (("fork server", server), ("fresh interpreter", fresh)):
            for key, value in _measure(fn, ns.calls, ns.threads).items():
                rows[name].setdefault(key, []).append(value)
        print(f"round {r + 1}/{ns.rounds} done", file=sys.stderr)
    keys = list(rows["fork server"])
    print(f"calculator calls ({CODE!r}), {ns.calls} per measurement, median of {ns.rounds} rounds, load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| path | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(row[k]):.1f}" for k in keys) + " |")
    for k in keys:
        if "cpu" in k:
            ratio = statistics.median(rows["fresh interpreter"][k]) / statistics.median(rows["fork server"][k])
            print(f"{k}: the server costs 1/{ratio:.1f} of a fresh interpreter")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
