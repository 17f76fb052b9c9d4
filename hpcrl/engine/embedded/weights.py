"""Weight updates for the embedded engine: from a torch.distributed group, and from same-host tensors.

Receiving runs off the scheduler thread (generation goes on meanwhile when it is not paused);
writing into the model runs on the scheduler thread, between forward passes, through the request's apply
strategy (hpcrl/engine/embedded/apply.py: replace the tensors, or add a delta to them).

Same-host handover (`update_weights_from_tensor`) uses hpcrl's own JSON payload instead of SGLang's
pickled MultiprocessingSerializer blobs, so the server never unpickles request data:
  {"kind": "shm", "path": "/dev/shm/hpcrl-<uid>/...", "nbytes": N, "tensors": [{name, dtype, shape, offset}],
   "mac": HMAC}
  {"kind": "cuda_ipc", "handle": {...}, "tensors": [...], "mac": HMAC}     (see hpcrl/weightwire/handover.py)
each base64-encoded JSON in `serialized_named_tensors[0]`. Only this user's own handovers are mapped
(docs/security.md), and no update with a NaN or inf in it is loaded.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.engine.embedded import apply
from hpcrl.engine.embedded.requests import EngineStateError
from hpcrl.engine.embedded.scheduler import Scheduler
from hpcrl.weightwire.buckets import parse_dtype
from hpcrl.weightwire.finite import first_non_finite
from hpcrl.weightwire.group import broadcast, broadcast_many, destroy_weight_group, init_weight_group


class WeightReceiver:
    def __init__(self, scheduler: Scheduler, *, group_timeout_s: float) -> None:
        self.scheduler = scheduler
        self.group_timeout_s = group_timeout_s
        self.groups: dict[str, dist.ProcessGroup] = {}
        self._lock = threading.Lock()
        # Parameters that an in-place receive filled with NaN/inf: generation waits for finite ones.
        self.nonfinite: set[str] = set()
        self._strategies: dict[str, apply.ApplyStrategy] = {}

    # ----- groups -----
    def init_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        if group_name in self.groups:
            raise EngineStateError(f"weight-update group {group_name!r} exists; destroy it first")
        if self.scheduler.device.type == "cpu" and backend == "nccl":
            backend = "gloo"  # NCCL needs CUDA; the same request then works on a CPU engine
        pg = init_weight_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=self.group_timeout_s,
        )
        with self._lock:
            self.groups[group_name] = pg

    def destroy_group(self, group_name: str) -> None:
        with self._lock:
            pg = self.groups.pop(group_name, None)
        if pg is None:
            raise EngineStateError(f"no weight-update group named {group_name!r}")
        destroy_weight_group(pg)  # torch keeps a group registered under its name until it is destroyed

    # ----- checks shared by both paths -----
    def strategy(self, name: str) -> apply.ApplyStrategy:
        """This engine's strategy `name`: one per process, since a strategy may keep state across updates."""
        if name not in self._strategies:
            self._strategies[name] = apply.strategy(name)
        return self._strategies[name]

    def check_names(self, strategy: apply.ApplyStrategy, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
        strategy.check_names(self.scheduler.weight_shapes(), list(zip(names, shapes, strict=True)))

    def _apply(self, named: list[tuple[str, torch.Tensor]], strategy: apply.ApplyStrategy) -> int:
        """Write into the model (scheduler thread). Returns bytes loaded."""
        if self.scheduler.weights_released:
            raise EngineStateError("weights are released; resume_memory_occupation(['weights']) before an update")
        strategy.apply(self.scheduler.named_parameters(), named)
        # Each strategy refuses non-finite results, so what it wrote is finite.
        self.nonfinite.difference_update(n for n, _ in named)
        return sum(t.numel() * t.element_size() for _, t in named)

    # ----- update_weights_from_distributed -----
    def receive_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
        apply_strategy: str = apply.DEFAULT,
    ) -> int:
        strategy = self.strategy(apply_strategy)
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        self.check_names(strategy, names, shapes)
        pg = self.groups.get(group_name)
        if pg is None:
            raise EngineStateError(f"no weight-update group named {group_name!r}: call init_weights_update_group first")
        device = self.scheduler.device
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        received: list[tuple[str, torch.Tensor]] = []
        if load_format == "flattened_bucket":
            # SGLang's layout (FlattenedTensorBucket): one uint8 buffer, each tensor's bytes back to back.
            nbytes = [int(torch.Size(s).numel()) * d.itemsize for s, d in zip(shapes, torch_dtypes, strict=True)]
            flat = torch.empty(sum(nbytes), dtype=torch.uint8, device=device)
            broadcast(pg, flat)
            for name, shape, dtype, part in zip(names, shapes, torch_dtypes, flat.split(nbytes), strict=True):
                received.append((name, part.view(dtype).view(shape)))
        elif load_format in (None, "", "default"):
            # Paused, nothing runs a forward: a tensor of the model's dtype lands straight in its
            # parameter (no receive buffer, no copy). Captured graphs stay valid: addresses do not move.
            in_place_ok = strategy.receives_in_place and self._can_receive_in_place()
            params = self.scheduler.named_parameters() if in_place_ok else {}
            targets: list[torch.Tensor] = []
            in_place: list[tuple[str, torch.Tensor]] = []
            for name, dtype, shape in zip(names, torch_dtypes, shapes, strict=True):
                target = params.get(name)
                if target is not None and target.dtype == dtype and target.is_contiguous():
                    targets.append(target.data)
                    in_place.append((name, target.data))
                    continue
                buf = torch.empty(shape, dtype=dtype, device=device)
                targets.append(buf)
                received.append((name, buf))
            broadcast_many(pg, targets)
            first_bad = first_non_finite(in_place)
            bad_in_place = [] if first_bad is None else [n for n, t in in_place if not bool(torch.isfinite(t).all())]
            self.nonfinite.difference_update(n for n, _ in in_place)
            if bad_in_place:
                # Already written into the model: generation waits until finite values for these arrive.
                self.nonfinite.update(bad_in_place)
                raise ValueError(_nonfinite_message(bad_in_place[0], kept=False))
        else:
            raise ValueError(f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'")
        bad = first_non_finite(received)
        if bad is not None:
            raise ValueError(_nonfinite_message(bad, kept=True))
        if received:
            self.scheduler.call(lambda: self._apply(received, strategy)).result()
        return sum(int(torch.Size(s).numel()) * d.itemsize for s, d in zip(shapes, torch_dtypes, strict=True))

    def _can_receive_in_place(self) -> bool:
        # The scheduler thread steps only when not paused, and weights must be resident to be written.
        return self.scheduler.paused is not None and not self.scheduler.weights_released

    # ----- update_weights_from_tensor -----
    def load_handover(self, payload: dict[str, Any], apply_strategy: str = apply.DEFAULT) -> int:
        from hpcrl.weightwire.handover import open_handover

        strategy = self.strategy(apply_strategy)
        with open_handover(payload, device=self.scheduler.device) as named:
            self.check_names(strategy, [n for n, _ in named], [list(t.shape) for _, t in named])
            bad = first_non_finite(named)
            if bad is not None:
                raise ValueError(_nonfinite_message(bad, kept=True))
            return self.scheduler.call(lambda: self._apply(named, strategy)).result()


def _nonfinite_message(name: str, *, kept: bool) -> str:
    outcome = (
        "nothing of this update was loaded"
        if kept
        else "it was received in place, so the engine refuses /generate until finite values for it arrive"
    )
    return (
        f"weight {name!r} holds non-finite values (NaN or inf): {outcome}. The trainer's last step diverged; "
        "push finite weights (e.g. from the last checkpoint)"
    )
