"""Weights over a torch.distributed group from trainer rank 0 to the engines (NCCL on GPU, gloo on CPU).

The group is the one SGLang's `init_weights_update_group` joins (hpcrl/weightwire/group.py): trainer rank 0 hosts
it, engine i joins as rank 1 + i. Per bucket every engine gets `update_weights_from_distributed` (names,
dtypes, shapes) while rank 0 broadcasts the bytes: one uint8 buffer per bucket (`flattened_bucket`, SGLang's
layout) or one broadcast per tensor. Every rendezvous and broadcast is bounded by `sync.group_timeout_s`.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch.distributed as dist

from hpcrl.engine.client import EngineClient
from hpcrl.engine.protocol.control import InitWeightsUpdateGroup, UpdateWeightsFromDistributed
from hpcrl.sync.errors import WeightSyncError
from hpcrl.sync.transport import Transport, TransportContext
from hpcrl.weightwire.buckets import Bucket
from hpcrl.weightwire.group import broadcast, broadcast_many, destroy_weight_group, init_weight_group, listen
from hpcrl.weightwire.sglang_payload import flatten_bucket

GROUP_NAME = "hpcrl_weights"


class DistributedTransport(Transport):
    def __init__(self, ctx: TransportContext) -> None:
        self.cfg = ctx.cfg
        self.engines = list(ctx.engines)
        self.device = ctx.device
        self.apply_strategy = ctx.apply_strategy
        self._pool = ctx.pool
        self.group: dist.ProcessGroup | None = None
        # Torch refuses a group name twice in one process: each (re)connect forms a newly named group.
        self.num_groups = 0
        self._name_token = secrets.token_hex(3)
        self.group_name = GROUP_NAME
        self.port = 0  # the store's port of the current group

    def connect(self) -> None:
        """Form the weight group: trainer rank 0 hosts it, engine i joins as rank 1 + i."""
        if self.group is not None:
            return
        # Listen before the engines learn the port (no other process can take it in between), and only on
        # master_address: 127.0.0.1 in a local run, the node's own address under Slurm.
        listener = listen(self.cfg.master_address, self.cfg.master_port)
        port = self.port = int(listener.getsockname()[1])
        self.num_groups += 1
        # A name of this driver's own: an engine that outlived a crashed driver may still hold its groups.
        self.group_name = f"{GROUP_NAME}_{self._name_token}_{self.num_groups}"
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        world = 1 + len(self.engines)
        futures = [
            self._pool.submit(
                e.init_weights_update_group,
                InitWeightsUpdateGroup(
                    master_address=self.cfg.master_address,
                    master_port=port,
                    rank_offset=1 + i,
                    world_size=world,
                    group_name=self.group_name,
                    backend=backend,
                ),
                timeout_s=self.cfg.group_timeout_s + 10,
            )
            for i, e in enumerate(self.engines)
        ]
        self.group = init_weight_group(
            master_address=self.cfg.master_address,
            master_port=port,
            rank=0,
            world_size=world,
            group_name=self.group_name,
            backend=backend,
            timeout_s=self.cfg.group_timeout_s,
            listener=listener,
        )
        for engine, fut in zip(self.engines, futures, strict=True):
            try:
                fut.result(timeout=self.cfg.group_timeout_s + 20)
            except Exception as exc:
                raise WeightSyncError(f"engine {engine.url} could not join the weight group: {exc}") from exc

    def reconnect(self, engines: Sequence[EngineClient]) -> None:
        """Re-form the weight group over `engines` (after a restart: a group's membership is fixed)."""
        if self.group is not None:
            # A peer that died mid-broadcast can leave NCCL kernels waiting on this GPU, with the compute
            # stream behind them: abort the communicator so they end now, not at the watchdog's timeout
            # (which would also take this process down).
            try:
                self.group.abort()
            except Exception:  # noqa: BLE001 - an already broken group may refuse; it is dropped anyway
                pass
            for e in self.engines:
                try:
                    e.destroy_weights_update_group(self.group_name, timeout_s=5)
                except Exception:  # noqa: BLE001 - the dead engine cannot answer
                    pass
            destroy_weight_group(self.group)
            self.group = None
        self.engines = list(engines)
        self.connect()

    def send(self, bucket: Bucket) -> None:
        assert self.group is not None, "connect() first"
        flattened = self.cfg.flattened
        request = UpdateWeightsFromDistributed(
            names=tuple(n for n, _ in bucket),
            dtypes=tuple(str(t.dtype).removeprefix("torch.") for _, t in bucket),
            shapes=tuple(tuple(t.shape) for _, t in bucket),
            group_name=self.group_name,
            flush_cache=False,
            load_format="flattened_bucket" if flattened else None,
            apply_strategy=self.apply_strategy,
        )
        calls = [
            self._pool.submit(e.update_weights_from_distributed, request, timeout_s=self.cfg.group_timeout_s)
            for e in self.engines
        ]
        try:
            if flattened:
                # SGLang's layout: one uint8 buffer of the tensors' bytes (what 0.5.16 allocates to receive).
                broadcast(self.group, flatten_bucket(bucket)[0].to(self.device))
            else:
                broadcast_many(self.group, [t.contiguous().to(self.device) for _, t in bucket])
        except RuntimeError as exc:
            # A peer that dies mid-broadcast resets the connection (gloo) or trips the group timeout (nccl):
            # a failed push the caller can heal (restart, re-form the group, push everything again).
            raise WeightSyncError(f"weight broadcast failed: {exc}") from exc
        for engine, fut in zip(self.engines, calls, strict=True):
            try:
                fut.result(timeout=self.cfg.group_timeout_s)
            except Exception as exc:
                raise WeightSyncError(f"update_weights_from_distributed failed on {engine.url}: {exc}") from exc

    def close(self) -> None:
        if self.group is not None:
            for e in self.engines:
                try:
                    e.destroy_weights_update_group(self.group_name, timeout_s=10)
                except Exception:  # noqa: BLE001 - engines may already be gone at shutdown
                    pass
            destroy_weight_group(self.group)
            self.group = None
