"""Prefill of GRPO groups: P prompts x n samples in one /generate call, one new token, against the embedded engine.

    PYTHONPATH=. python tools/bench/group_prefill.py --model DIR [--prompts 64] [--n 8] [--prompt-len 128]
        [--max-prefill-tokens 4096] [--repeats 4] [--threads 2]

Starts `hpcrl engine serve` on CPU (a free loopback port), sends the same shape of call --repeats times (fresh
random prompts each time) and prints the seconds per call (the median leaves out the first, which warms up) and the
engine's prefill forwards per call (/server_info `num_prefill_forwards`). Run it in two checkouts for an A/B.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory (e.g. from `hpcrl model init-tiny`)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    ns = p.parse_args()
    port = _free_port()
    cmd = [
        sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", ns.model, "--port", str(port),
        "--max-running-requests", str(ns.prompts * ns.n), "--context-length", str(ns.prompt_len + 8),
        "--max-prefill-tokens", str(ns.max_prefill_tokens), "--num-threads", str(ns.threads),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(ns.threads))
    engine = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if engine.poll() is not None:
                raise SystemExit(f"the engine exited with code {engine.returncode}:\n{engine.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the engine did not answer /health in 300 s")
            time.sleep(0.2)
        vocab = int(httpx.get(url + "/server_info", timeout=10).json().get("vocab_size", 90))
        rng = random.Random(0)
        seconds: list[float] = []
        forwards: list[int] = []
        for _ in range(ns.repeats):
            prompts = [[rng.randrange(3, vocab) for _ in range(ns.prompt_len)] for _ in range(ns.prompts)]
            body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 1, "n": ns.n}}
            before = httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]
            t0 = time.perf_counter()
            r = httpx.post(url + "/generate", json=body, timeout=600)
            seconds.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise SystemExit(f"/generate answered {r.status_code}: {r.text[:500]}")
            after = httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]
            forwards.append(after.get("num_prefill_forwards", -1) - before.get("num_prefill_forwards", 0))
        timed = seconds[1:] or seconds
        print(f"{ns.prompts} prompts x {ns.n} samples x {ns.prompt_len} tokens, chunk {ns.max_prefill_tokens}: "
              f"{statistics.median(timed):.3f} s a call (median of {len(timed)}; all: "
              f"{', '.join(f'{s:.3f}' for s in seconds)}), prefill forwards a call {forwards} "
              "(-1: the engine does not count them)")  # fmt: skip
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
