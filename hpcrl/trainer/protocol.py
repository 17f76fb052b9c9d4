"""The seam between the driver and a trainer backend (torch, megatron): what rank 0 may call.

A backend is `collective` when weight and state requests need every rank (Megatron: TP shards and
pipeline stages); then rank 0 tells the followers first (hpcrl/trainer/ranks.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from hpcrl.trainer.batch import TrainBatch


class Trainer(Protocol):
    world_size: int
    collective: bool

    def train_grpo(self, batch: TrainBatch) -> dict[str, float]: ...

    def train_sft(self, batch: TrainBatch) -> dict[str, float]: ...

    def push_weights(self, *, full: bool = False) -> list[tuple[str, Tensor]]:
        """What a weight push sends, in Hugging Face names: the tensors a step can change (a model converter may
        leave out frozen ones, which the engines keep); `full`: every weight, for engines that dropped theirs."""
        ...

    def export_weights(self) -> list[tuple[str, Tensor]]:
        """The whole model in Hugging Face names and shapes: what an export writes."""
        ...

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Model and optimizer state as tensors + a JSON skeleton (no pickle), for checkpoints."""
        ...

    def load_state(self, tensors: dict[str, Tensor], state: dict[str, Any]) -> None: ...

    def export(self, out_dir: str | Path) -> Path:
        """Write `export_weights()` as a Hugging Face model directory."""
        ...
