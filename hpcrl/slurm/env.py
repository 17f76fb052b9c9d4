"""Where this process sits in a Slurm job: rank, world, node, het group — read per het group.

Inside `srun --het-group=K`, SLURM_PROCID restarts at 0 and SLURM_STEP_* describe this component's
step; the batch shell's un-suffixed SLURM_JOB_NODELIST describes component 0 only, so ranks are
derived from the step's variables, never from the job's. A step over several components (the MPI
step of sync.transport=mpi) numbers its tasks globally, components in order; there the script names
each task's component (HPCRL_HET_GROUP) and its rank is counted from its component's first task.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass


def expand_hostlist(hostlist: str) -> list[str]:
    """`n[1-3],gpu7` -> ['n1', 'n2', 'n3', 'gpu7'] (scontrol when present, else a small parser)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()
    except (OSError, subprocess.SubprocessError):
        pass
    return _parse_hostlist(hostlist)


def _parse_hostlist(hostlist: str) -> list[str]:
    hosts: list[str] = []
    depth, start = 0, 0
    parts = []
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(hostlist[start:i])
            start = i + 1
    parts.append(hostlist[start:])
    for part in filter(None, parts):
        if "[" not in part:
            hosts.append(part)
            continue
        prefix, rest = part.split("[", 1)
        body, suffix = rest.split("]", 1)
        for item in body.split(","):
            if "-" in item:
                lo, hi = item.split("-")
                hosts += [f"{prefix}{n:0{len(lo)}d}{suffix}" for n in range(int(lo), int(hi) + 1)]
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    return hosts


HET_GROUP_VAR = "HPCRL_HET_GROUP"
"""Set by the generated script on each component of a step that spans several het groups: nothing in
Slurm's environment says which component a task of such a step belongs to."""


def _het_step_group(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(het group, first global rank, tasks) of this task when its step spans several het components."""
    group = env.get(HET_GROUP_VAR)
    if group is None or not group.isdigit():
        return None
    sizes = []
    for k in range(int(group) + 1):
        size = env.get(f"SLURM_NTASKS_HET_GROUP_{k}")
        if size is None or not size.isdigit():
            return None
        sizes.append(int(size))
    step_tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 0)
    if step_tasks <= sizes[-1] or f"SLURM_JOB_NODELIST_HET_GROUP_{group}" not in env:
        return None  # a step of this component alone: SLURM_PROCID is already the component's rank
    return int(group), sum(sizes[:-1]), sizes[-1]


@dataclass(frozen=True)
class LaunchEnv:
    """How this task was launched, read from its environment: by srun (a Slurm step, maybe one het group) or
    by an MPI launcher outside Slurm (`scheduler`). Ranks, world size and node names either way."""

    job_id: str
    restart_count: int
    rank: int
    world_size: int
    local_rank: int
    node_name: str
    step_nodes: list[str]
    het_group: int | None
    scheduler: str = "slurm"
    """`slurm`: srun started this task; `mpi`: an MPI launcher (mpiexec) did, outside Slurm."""

    @property
    def engines_elsewhere(self) -> bool:
        """Under Slurm the engines are a het group of their own; under a bare mpiexec rank 0 starts them."""
        return self.scheduler == "slurm"

    @classmethod
    def from_mpi(cls) -> LaunchEnv | None:
        """Rank and world from an MPI launcher's variables; rank 0's host becomes the rendezvous host."""
        from hpcrl.sync.mpi import comm_world, mpi_rank_env

        ranks = mpi_rank_env()
        if ranks is None:
            return None
        comm = comm_world()
        import numpy as np

        name = np.zeros(256, dtype=np.uint8)
        if comm.rank == 0:
            raw = np.frombuffer(os.uname().nodename.encode()[:255], dtype=np.uint8)
            name[: raw.size] = raw
        comm.Bcast(name, root=0)
        master = bytes(name).rstrip(b"\0").decode()
        return cls(
            job_id=os.environ.get("PMIX_NAMESPACE", "mpi").replace("@", "-"),
            restart_count=0,
            rank=ranks["rank"],
            world_size=ranks["world_size"],
            local_rank=ranks["local_rank"],
            node_name=os.uname().nodename,
            step_nodes=[master],
            het_group=None,
            scheduler="mpi",
        )

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> LaunchEnv | None:
        env = os.environ if env is None else env
        if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
            return None
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        het = env.get("SLURM_HET_JOB_ID") and env.get("SLURM_HET_JOB_OFFSET")
        rank = int(env["SLURM_PROCID"])
        world_size = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS", "1"))
        het_group = int(env["SLURM_HET_JOB_OFFSET"]) if het else None
        spanning = _het_step_group(env)
        if spanning is not None:
            # One step over several components (`srun --het-group=0 A : --het-group=1 B`): SLURM_PROCID
            # and the STEP_* variables are the whole step's; this component's ranks start after the
            # tasks of the components before it, and its nodes are its allocation's.
            het_group, offset, world_size = spanning
            rank -= offset
            nodelist = env[f"SLURM_JOB_NODELIST_HET_GROUP_{het_group}"]
        return cls(
            job_id=env.get("SLURM_HET_JOB_ID") or env["SLURM_JOB_ID"],
            restart_count=int(env.get("SLURM_RESTART_COUNT", "0")),
            rank=rank,
            world_size=world_size,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            node_name=env.get("SLURMD_NODENAME") or os.uname().nodename,
            step_nodes=expand_hostlist(nodelist) if nodelist else [],
            het_group=het_group,
        )

    @property
    def master_addr(self) -> str:
        return self.step_nodes[0] if self.step_nodes else "127.0.0.1"

    def master_port(self, base: int = 29500) -> int:
        # Derived from the job id so that two jobs on one node do not collide, and stable across requeues.
        return base + int(self.job_id) % 10000 if self.job_id.isdigit() else base
