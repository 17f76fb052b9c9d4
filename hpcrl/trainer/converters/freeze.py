"""`freeze`: named modules of the model stop training (`train.freeze_modules`).

Their parameters leave the optimizer (no gradients, no Adam moments: 12 bytes a parameter saved in fp32
training) and, since no step changes them, a weight push leaves them out: engines keep the copy they loaded
from model.path. Checkpoints and exports still hold the whole model. Freezing the token embeddings of a model
with tied embeddings freezes its LM head too (one tensor).
"""

from __future__ import annotations

import re

from torch import Tensor

from hpcrl.model.qwen3 import CausalLM
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.converters.base import ModelConverter


class FreezeModules(ModelConverter):
    name = "freeze"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.frozen: set[str] = set()  # state-dict names of the frozen parameters

    def convert(self, model: CausalLM) -> None:
        modules = dict(model.named_modules())
        for name in self.cfg.freeze_modules:
            if name not in modules:
                raise ValueError(f"train.freeze_modules: {_unknown(name, model, modules)}")
            for pname, p in modules[name].named_parameters(prefix=name):
                p.requires_grad_(False)
                self.frozen.add(pname)
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"train.freeze_modules {list(self.cfg.freeze_modules)} freezes every parameter: nothing would "
                "train; leave a module out"
            )

    def push_state(self, model: CausalLM, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return {k: v for k, v in state.items() if k not in self.frozen}


def _unknown(name: str, model: CausalLM, modules: dict[str, object]) -> str:
    if name == "lm_head" and model.args.tie_word_embeddings:
        return (
            "this model ties its LM head to the token embeddings (tie_word_embeddings); freeze "
            "model.embed_tokens, which freezes both"
        )
    # One entry for the decoder layers' range instead of every layer and every part of it.
    layered = sorted({re.sub(r"^model\.layers\.\d+", "model.layers.N", m) for m in modules if m})
    shown = [m for m in layered if m.count(".") <= 2 or m.startswith("model.layers.N")]
    num_layers = model.args.num_layers
    return (
        f"the model has no module {name!r}; its modules are {', '.join(shown)} "
        f"(N = 0..{num_layers - 1}: each decoder layer)"
    )
