"""HDF5 store of a run: metrics and events (``metrics.h5``) and checkpoints (``checkpoints/step_NNNNNNNN.h5``).

Names load on first use, so ``import hpcrl.store`` imports neither h5py nor torch, and reading metrics
(``hpcrl report``) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcrl.store.checkpoint import (
        Checkpoint,
        CheckpointError,
        checkpoint_path,
        list_checkpoints,
        load_checkpoint,
        load_latest_checkpoint,
        remove_temp_files,
        save_checkpoint,
    )
    from hpcrl.store.metrics import (
        MetricsWriter,
        StoreError,
        load_events,
        load_metrics,
        load_metrics_frame,
        load_root_attrs,
        metric_path,
    )
    from hpcrl.store.state_tree import capture_rng_state, flatten_state, restore_rng_state, unflatten_state

_MODULE_OF = {
    "MetricsWriter": "metrics",
    "StoreError": "metrics",
    "load_events": "metrics",
    "load_metrics": "metrics",
    "load_metrics_frame": "metrics",
    "load_root_attrs": "metrics",
    "metric_path": "metrics",
    "Checkpoint": "checkpoint",
    "CheckpointError": "checkpoint",
    "capture_rng_state": "state_tree",
    "checkpoint_path": "checkpoint",
    "flatten_state": "state_tree",
    "list_checkpoints": "checkpoint",
    "load_checkpoint": "checkpoint",
    "load_latest_checkpoint": "checkpoint",
    "remove_temp_files": "checkpoint",
    "restore_rng_state": "state_tree",
    "save_checkpoint": "checkpoint",
    "unflatten_state": "state_tree",
}

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "MetricsWriter",
    "StoreError",
    "capture_rng_state",
    "checkpoint_path",
    "flatten_state",
    "list_checkpoints",
    "load_checkpoint",
    "load_events",
    "load_latest_checkpoint",
    "load_metrics",
    "load_metrics_frame",
    "load_root_attrs",
    "metric_path",
    "remove_temp_files",
    "restore_rng_state",
    "save_checkpoint",
    "unflatten_state",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
