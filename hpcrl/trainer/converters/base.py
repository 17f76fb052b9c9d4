"""What a model converter may do to the torch trainer's model, and when the trainer asks it."""

from __future__ import annotations

import abc
import contextlib
import importlib
from pathlib import Path
from typing import Any

from torch import Tensor

from hpcrl.model.qwen3 import CausalLM
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.converters import CONVERTERS


class ModelConverter(abc.ABC):
    """One named change to the model (`train.converters`); every hook but `convert` defaults to doing nothing.

    The trainer calls, in this order: `convert` once, after loading the weights (and taking the KL
    reference copy) and before compilation, the parallelism and the optimizer, which holds the parameters
    left with `requires_grad`; `post_optimizer_hook` after every optimizer step that ran; `push_state` and
    `export_state` on each push and export. With several converters, `convert` runs in the listed order
    and the state hooks in the reverse one (the last change is undone first)."""

    name = ""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    @abc.abstractmethod
    def convert(self, model: CausalLM) -> None:
        """Change `model` in place (the one hook every converter writes)."""

    def post_optimizer_hook(self, model: CausalLM) -> None:
        """After each optimizer step (e.g. re-derive quantization scales from the updated weights); default: nothing."""
        return None

    def push_state(self, model: CausalLM, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The tensors a weight push sends, given the previous converter's (the model's state at first).

        Engines keep what a push leaves out, so a converter drops only tensors no step changes, or replaces
        them by what the engine applies (an adapter)."""
        return state

    def export_state(self, model: CausalLM, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The tensors an export writes (a whole model in Hugging Face names), given the previous converter's."""
        return state

    def gather_for_export(self, model: CausalLM) -> None:
        """Sharded model (parallelism: fsdp2): called on every rank as an export gathers the weights, so that
        rank 0's `export_files` can then write whole tensors alone; default: nothing."""
        return None

    def export_files(self, model: CausalLM, out_dir: Path, *, base_dir: Path) -> None:
        """Write files of the converter's own into the exported model directory (LoRA: the peft adapter of the
        model loaded from `base_dir`); default: nothing."""
        return None

    def checkpoint_state(self, model: CausalLM, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The model tensors a checkpoint holds (model.state_dict() names), given the previous converter's; a
        tensor left out must be one no step changes, restored from model.path on resume."""
        return state

    def checkpoint_meta(self, model: CausalLM) -> dict[str, Any]:
        """JSON the checkpoint keeps for `check_resume` (e.g. the identity of what it left out); default: none."""
        return {}

    def check_resume(self, model: CausalLM, meta: dict[str, Any] | None) -> None:
        """Refuse (ValueError with the fix) a checkpoint this converted model cannot resume from; `meta` is what
        `checkpoint_meta` wrote (None: the checkpoint was written without this converter)."""
        return None


def build_converters(cfg: TrainConfig) -> list[ModelConverter]:
    """The converters of `cfg.converters`, in the order they apply."""
    out = []
    for name in cfg.converters:
        if name not in CONVERTERS:
            raise ValueError(f"unknown model converter {name!r}; valid: {', '.join(CONVERTERS)}")
        module, _, cls = CONVERTERS[name].partition(":")
        converter = getattr(importlib.import_module(module), cls)(cfg)
        if not isinstance(converter, ModelConverter):
            raise TypeError(f"{CONVERTERS[name]} is not a ModelConverter")
        out.append(converter)
    return out


class ServesReference(abc.ABC):
    """A converter whose converted model can still compute the policy as loaded (LoRA: adapters off): the KL
    term's reference is then the model itself, not a copy taken before `convert`."""

    @abc.abstractmethod
    def reference(self, model: CausalLM) -> contextlib.AbstractContextManager[None]:
        """A context in which `model` computes the policy as loaded."""
