"""The trainer ranks' process group: in a local run its store listens on loopback only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

RANK = r"""
import json, os, sys, torch, torch.distributed as dist
from hpcrl.engine.portcheck import listeners
from hpcrl.trainer.ranks import init_trainer_group
from hpcrl.weightwire.group import listen
rank = int(sys.argv[1])
listener = None
if rank == 0:
    listener = listen("127.0.0.1")  # as a local run's placement takes it, before rank 1 learns the port
    port = int(listener.getsockname()[1])
    print(port, flush=True)
else:
    port = int(sys.stdin.readline())
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
init_trainer_group(rank=rank, world_size=2, device=torch.device("cpu"), timeout_s=30, listener=listener)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
bound = [b.describe() for b in listeners(port) or []]
print(json.dumps({"sum": total.item(), "bound": bound, "port": port}), flush=True)
dist.destroy_process_group()
"""


def test_a_local_trainer_group_store_listens_on_loopback_only() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)
    rank0 = subprocess.Popen([sys.executable, "-c", RANK, "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)  # fmt: skip
    assert rank0.stdout is not None
    port = rank0.stdout.readline().strip()
    rank1 = subprocess.Popen([sys.executable, "-c", RANK, "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        out1, err1 = rank1.communicate(port + "\n", timeout=120)
        out0, err0 = rank0.communicate(timeout=60)
    finally:
        rank0.kill(), rank1.kill()
    assert rank0.returncode == 0 and rank1.returncode == 0, (err0, err1)
    first, second = (json.loads(out.strip().splitlines()[-1]) for out in (out0, out1))
    assert first["sum"] == second["sum"] == 3.0  # the group works: 1 + 2 over both ranks
    # Torch's own store listens on every interface ("0.0.0.0" or "::"); this one on 127.0.0.1 only.
    assert first["bound"] == [f"127.0.0.1:{port}"], first
