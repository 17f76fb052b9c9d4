"""How a run pushes its weights: the transport to the engines (sync/push.py) and the publisher that orders each push
(sync/publisher.py), set for the run's engines and adapters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpcrl.engine.client import EngineClient
from hpcrl.engine.fleet import EngineFleet
from hpcrl.engine.joined import JoinWatcher, this_identity
from hpcrl.run.placement import Placement
from hpcrl.run_config import RunConfig
from hpcrl.sync.publisher import WeightPublisher
from hpcrl.sync.push import WeightSync
from hpcrl.trainer.ranks import RankGroup


def weight_publisher(
    cfg: RunConfig,
    placement: Placement,
    clients: list[EngineClient],
    fleet: EngineFleet,
    trainer: Callable[[], RankGroup],
    run_dir: Path,
    *,
    on_event: Callable[..., Any],
    closers: list[Callable[[], None]],
) -> WeightPublisher:
    """The run's publisher over a connected weight sync (its closer added to `closers`)."""
    # LoRA: embedded engines that keep their weights merge pushed adapters (apply_strategy lora); SGLang, and
    # engines that lend their weights' memory, get the merged weights computed by the trainer.
    adapters = cfg.train.lora is not None and cfg.engine.kind == "embedded" and not cfg.engine.offload_during_train
    sync = WeightSync(
        placement.sync_config(), clients, device=torch.device(cfg.train.device),
        colocated=placement.colocated, engine_kind=cfg.engine.kind, engine_tp_size=cfg.engine.tp_size,
        apply_strategy="lora" if adapters else "replace", run_dir=run_dir,
    )  # fmt: skip
    closers.append(sync.close)
    sync.connect()
    # Engines that lend their weights' memory to the trainer get it back as zeros: every push then sends
    # every weight, not only those a step can change.
    full = cfg.engine.offload_during_train or (cfg.train.lora is not None and not adapters)
    return WeightPublisher(
        cfg.engine, fleet, sync, lambda: trainer().push_weights(full=full), on_event=on_event,
        every_steps=cfg.sync.every_steps, num_steps=cfg.num_steps,
    )  # fmt: skip


def join_watcher(
    cfg: RunConfig, model_dir: Path, run_dir: Path, on_event: Callable[..., Any], closers: list[Callable[[], None]]
) -> JoinWatcher | None:
    """With sync.transport disk_delta, engines of other jobs may join (hpcrl/engine/joined.py): the watcher that
    announces the run to them and admits them; None for the other transports, which cannot reach such engines."""
    if cfg.sync.transport != "disk_delta":
        return None
    weights_dir = Path(cfg.sync.delta_dir).expanduser() if cfg.sync.delta_dir else run_dir / "weights"
    watcher = JoinWatcher(
        run_dir, this_identity(model_dir, weights_dir), on_event=on_event, load_timeout_s=cfg.sync.group_timeout_s,
        engine_kind=cfg.engine.kind,
    )  # fmt: skip
    closers.append(watcher.close)
    return watcher
