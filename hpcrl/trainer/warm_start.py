"""The supervised warm start before GRPO; runs once per run, checkpointed as done.

Its batches come from a function of the SFT step: prompt -> answer pairs (`answer_batches` in
hpcrl/rollout/generate.py, single-turn runs), or pre-tokenized sequences with loss masks (hpcrl/sessions/traces.py,
multi-turn runs: loss on the assistant turns).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from hpcrl.guard import Guard
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import SFTConfig
from hpcrl.trainer.ranks import RankGroup


class WarmStart:
    def __init__(
        self,
        cfg: SFTConfig,
        trainer: RankGroup,
        batches: Callable[[int], TrainBatch],
        *,
        guard: Guard,
        say: Callable[[str], None],
        on_event: Callable[[str, dict[str, Any]], None],
        interrupted: Callable[[], bool] = lambda: False,
    ) -> None:
        self.cfg, self.trainer, self.batches = cfg, trainer, batches
        self.guard, self.say, self.on_event = guard, say, on_event
        self.interrupted = interrupted
        self.done = False

    def run(self) -> bool:
        """The SFT steps, unless done or not configured; True when they ran (the engines need the weights)."""
        if self.done or self.cfg.num_steps == 0:
            return False
        t0 = time.perf_counter()
        for step in range(self.cfg.num_steps):
            if self.interrupted():
                # A long SFT must not outlive Slurm's grace period: stop now; it is not checkpointed mid-way,
                # so it starts over when the run resumes.
                n = self.cfg.num_steps
                self.say(f"sft stopped after {step}/{n} steps by a preemption signal; it starts over on resume")
                return False
            self.guard.wait_until_cool(None)
            m = self.trainer.train_sft(self.batches(step))
            if (step + 1) % self.cfg.log_every_steps == 0 or step + 1 == self.cfg.num_steps:
                elapsed_s = time.perf_counter() - t0
                self.say(f"sft {step + 1:>4}/{self.cfg.num_steps} | loss {m['loss']:.3f} | {elapsed_s:.1f} s")
        self.done = True
        self.on_event("sft_done", {"num_steps": self.cfg.num_steps, "loss": m["loss"]})
        return True

    # ----- a part of the run's checkpointed state (hpcrl/store/run_state.py) -----
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"done": self.done}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any], *, step: int) -> None:
        self.done = bool(state["done"])
