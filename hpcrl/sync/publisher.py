"""The one owner of the order in which new weights reach the engines, and of the memory they lend meanwhile.

Per training step (colocated engines with `engine.offload_during_train`):
  lend_memory():   after the rollout: release `kv_cache`, then `weights` (each checked to have freed memory)
  publish(v):      1. resume `weights` (their contents are stale: SGLang's read as zeros until written)
                   2. restart dead engines (bounded), re-form the weight group over the live ones
                   3. push every weight (WeightSync, sync/push.py), in this order on every engine:
                      a. pause_generation(mode)         every engine, before any weight moves; SGLang then
                                                        flush_cache (its prefix cache holds the old weights' K/V)
                      b. transport.begin(v)             once (sync/transport.py: the transport's hooks)
                      c. transport.send(bucket)         per bucket (<= sync.bucket_mb), in order
                      d. transport.finish(v)            once; every engine now holds the new weights
                      e. update_weight_version(v, abort_all_requests=False)   never aborting in-flight requests
                      f. continue_generation
                      g. check: every engine reports version v (model_info)
                   4. resume `kv_cache`
                   A push that an engine's death breaks is redone once, whole, over the engines then alive
                   (a fresh engine has no weights); one that died while its memory was lent is restarted whole.
  restore_engines(): between phases (the rollout lost an engine): steps 2-3 with the version already served.
`version` is what the engines serve now (an int: hpcrl/samples/versions.py); read it before publish() to know
what a rollout was generated with.
Weights with NaN or inf are never pushed (NonFiniteWeightsError, naming the parameter).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.fleet import EngineFleet
from hpcrl.engine.joined import JoinWatcher
from hpcrl.samples.versions import INITIAL_VERSION, stored_version
from hpcrl.sync.push import WeightSync, WeightSyncError
from hpcrl.weightwire.finite import NonFiniteWeightsError, first_non_finite

LENT_TAGS = ("kv_cache", "weights")
WeightsFn = Callable[[], list[tuple[str, torch.Tensor]]]
EventFn = Callable[[str, dict[str, Any]], None]


class WeightPublisher:
    def __init__(
        self,
        cfg: EngineConfig,
        fleet: EngineFleet,
        sync: WeightSync,
        weights: WeightsFn,
        *,
        on_event: EventFn,
        every_steps: int,
        num_steps: int,
    ) -> None:
        self.cfg = cfg
        self.every_steps, self.num_steps = every_steps, num_steps  # the cadence of due(): sync.every_steps
        self.fleet = fleet
        self.sync = sync
        self.weights = weights
        self.on_event = on_event
        self.version = INITIAL_VERSION  # engines start on the run's initial weights (launched --weight-version 0)
        self._lend_metrics: dict[str, float] = {}
        # Engines that join from jobs of their own (sync.transport disk_delta): admitted after each push, when
        # the weight directory holds the version every engine serves.
        self.joins: JoinWatcher | None = None

    def due(self, step: int) -> bool:
        """Whether the weights trained at `step` are pushed after it: every `every_steps` steps, and after the last."""
        return (step + 1) % self.every_steps == 0 or step + 1 == self.num_steps

    def lend_memory(self) -> None:
        """Colocated engines release their KV cache and weights for the trainer (when configured)."""
        if not self.cfg.offload_during_train:
            return
        t0 = time.perf_counter()
        freed = self.fleet.release_memory(list(LENT_TAGS))
        self._lend_metrics = freed | {"fleet/release_s": time.perf_counter() - t0}

    def publish(self, version: int) -> dict[str, float]:
        """Give every live engine the trainer's current weights as `version` (the order in the docstring)."""
        weights = self.weights()
        self.check_finite(weights, f"weight version {version}")
        t0 = time.perf_counter()
        for attempt in (0, 1):
            # Engines that died with their memory lent are skipped here; restart_dead() restarts them whole.
            self.fleet.resume_memory(["weights"])  # stale until the push below rewrites every weight
            restarted = self.fleet.restart_dead()
            clients = [s.client for s in self.fleet.live()]
            if restarted or attempt or clients != self.sync.engines:  # engines restarted, joined or left
                self.sync.reconnect(clients)
            try:
                pushed = self.sync.push(weights, version)
                break
            except WeightSyncError:
                if attempt:
                    raise
                self.fleet.probe_all()  # find out who died; the next attempt restarts them and pushes all
        self.fleet.resume_memory(["kv_cache"])
        self.version = version
        if self.joins is not None:
            self.joins.update(self.fleet, version)  # the next push reaches the engines admitted here
        out = pushed | self._lend_metrics
        if self._lend_metrics:
            out["fleet/resume_s"] = time.perf_counter() - t0 - pushed["sync/seconds"]
        out["sync/weight_version"] = float(version)
        self._lend_metrics = {}
        return out

    def restore_engines(self) -> None:
        """Restart dead engines (bounded) and give them the weights the others serve, before they serve."""
        self.publish(self.version)

    def check_finite(self, weights: list[tuple[str, torch.Tensor]], what: str) -> None:
        """NaN or inf weights must reach neither an engine nor a checkpoint: record which, and stop."""
        bad = first_non_finite(weights)
        if bad is not None:
            self.on_event("nan_weights", {"parameter": bad, "what": what})
            raise NonFiniteWeightsError(
                f"parameter {bad!r} of the trainer's {what} holds NaN or inf; it was neither pushed nor "
                "checkpointed, and the last checkpoint is intact: lower train.lr, check the rewards and that "
                "model.path holds finite weights, then rerun to resume"
            )

    # ----- a part of the run's checkpointed state (hpcrl/store/run_state.py) -----
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"version": self.version}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any], *, step: int) -> None:
        version = stored_version(state["version"])
        if version is None:
            raise ValueError(
                f"the checkpoint's weights state holds version {state['version']!r}, which is not a weight version "
                "(an int, or a string of digits or 'sft' in older checkpoints); resume with the hpcrl that wrote it"
            )
        self.version = version
