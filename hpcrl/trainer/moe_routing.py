"""The trainer's side of a mixture-of-experts model: rollout routing replay, the load-balancing loss, and the
routing metrics of a step (moe/route_agreement, moe/expert_load_cv, moe/aux_loss). Both backends use it: the torch
backend's model fills its `Routing` in its sparse blocks, the megatron backend's in its routers' top-k
(hpcrl/trainer/megatron/moe.py)."""

from __future__ import annotations

import logging
import math
from typing import Protocol

import torch
from torch import Tensor

from hpcrl.model import moe
from hpcrl.trainer.batch import TrainBatch

log = logging.getLogger(__name__)


class Routed(Protocol):
    """A model whose forward fills `routing` (hpcrl's CausalLM, or the megatron backend's GPTModel)."""

    routing: moe.Routing


class MoeRouting:
    """Set before each forward (the routes to force), read after it (the auxiliary loss and the statistics)."""

    def __init__(self, model: Routed, args: moe.MoeArgs | None, replay: str) -> None:
        self.args = args
        self.replay = replay != "off" and self.args is not None
        if self.args is None and replay != "off":
            log.info("train.routing_replay: %s does nothing for this dense model (it has no experts to route)", replay)
        self.coef = self.args.router_aux_loss_coef if self.args is not None else 0.0
        if self.args is not None:  # a dense model may have no routing at all (the megatron backend's)
            model.routing.force = replay == "rollout"
            model.routing.record_logits = self.coef > 0
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return self.args is not None

    def before(self, model: Routed, mb: TrainBatch) -> None:
        """Give the next forward of `model` the rollout's routes (when the batch carries them): forced under
        `rollout`, compared only under `observe`."""
        if self.args is None:
            return
        routes = mb.routed_experts if self.replay else None
        if routes is not None and routes.shape[2:] != (len(self.args.sparse_layers), self.args.top_k):
            raise ValueError(
                f"the batch's routed experts have shape {tuple(routes.shape)}, but this model has "
                f"{len(self.args.sparse_layers)} layers and top-{self.args.top_k} routing: [sequences, tokens, "
                f"{len(self.args.sparse_layers)}, {self.args.top_k}] expected"
            )
        model.routing.replay = routes

    def after(self, model: Routed, mb: TrainBatch) -> Tensor | None:
        """The latest training forward's router_aux_loss_coef x load-balancing loss (None without experts or
        coefficient), its statistics recorded for `metrics`."""
        if self.args is None:
            return None
        width = mb.input_ids.shape[1]
        mask = torch.arange(width, device=mb.lengths.device)[None, :] < mb.lengths[:, None]
        for key, value in moe.route_stats(model.routing, self.args, mask).items():
            if not math.isnan(value):
                self._sums[key] = self._sums.get(key, 0.0) + value
                self._counts[key] = self._counts.get(key, 0) + 1
        if self.coef <= 0:
            return None
        aux = moe.aux_loss(model.routing, self.args, mask)
        self._sums["moe/aux_loss"] = self._sums.get("moe/aux_loss", 0.0) + float(aux.detach())
        self._counts["moe/aux_loss"] = self._counts.get("moe/aux_loss", 0) + 1
        model.routing.logits.clear()  # the graph they hold is the loss's now
        return self.coef * aux

    def metrics(self) -> dict[str, float]:
        """The means over the training forwards since the last call."""
        out = {k: self._sums[k] / self._counts[k] for k in self._sums}
        self._sums.clear()
        self._counts.clear()
        return out
