"""What a decode step hands the scheduler: each row's sampled token and its log-probs at temperature 1 and at the
row's temperature (and, when asked, its sampling support), read back from the device when first needed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hpcrl.engine.embedded.sampling import SampleOutput
from hpcrl.engine.embedded.step_timer import StepTimer

if TYPE_CHECKING:
    from hpcrl.engine.embedded.slots import DecodeSlots


@dataclass(frozen=True)
class RowState:
    """What the device needs to know about one running sequence."""

    token: int  # the last token, whose K/V the next step computes
    position: int  # its position (= tokens already in the cache)
    seed: int
    step: int  # index of the token to sample next
    temperature: float
    top_k: int
    top_p: float
    min_p: float

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass
class StepOutput:
    tokens: list[int]
    logprobs: list[float]
    scaled_logprobs: list[float]
    support_logprobs: list[float] | None
    support_mask: torch.Tensor | None  # [n, V] bool on the CPU, when the step filtered


class StepHandle:
    """A launched step; `result()` waits for the device only when first called."""

    def __init__(
        self,
        tok: torch.Tensor,
        lp: torch.Tensor,
        event: torch.cuda.Event | None,
        support_lp: torch.Tensor | None = None,
        support_mask: torch.Tensor | None = None,
        timing: tuple[Any, ...] | None = None,
        timer: StepTimer | None = None,
    ) -> None:
        self._tok, self._lp, self._event = tok, lp, event
        self._support_lp, self._support_mask = support_lp, support_mask
        self._timing, self._timer = timing, timer
        self._out: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._out is None:
            if self._event is not None:
                self._event.synchronize()
            if self._timing is not None and self._timer is not None:
                self._timer.record(self._timing)
            lp = self._lp.tolist()
            self._out = StepOutput(
                tokens=self._tok.tolist(),
                logprobs=[x[0] for x in lp],
                scaled_logprobs=[x[1] for x in lp],
                support_logprobs=self._support_lp.tolist() if self._support_lp is not None else None,
                support_mask=self._support_mask.cpu() if self._support_mask is not None else None,
            )
        return self._out


class ReadyStep(StepHandle):
    """A step whose outputs are already on the host (the synchronous CPU path)."""

    def __init__(self, out: StepOutput) -> None:
        self._out = out


def host_output(out: SampleOutput) -> StepOutput:
    lp = out.logprobs.tolist()
    return StepOutput(
        tokens=out.token_ids.tolist(),
        logprobs=lp,
        # The unit-temperature sampler returns one tensor for both: convert it once.
        scaled_logprobs=lp if out.scaled_logprobs is out.logprobs else out.scaled_logprobs.tolist(),
        support_logprobs=out.support_logprobs.tolist() if out.support_logprobs is not None else None,
        support_mask=out.support_mask.cpu() if out.support_mask is not None else None,
    )


class HostRing:
    """Pinned host buffers that steps copy their tokens into, reused round-robin: at most two
    steps are unread at a time (look-ahead), and allocating pinned memory per step is slow."""

    def __init__(self, max_batch: int, is_cuda: bool) -> None:
        self.is_cuda = is_cuda
        self.size = 4
        self.i = 0  # the slot the next step's outputs go to
        self.tok = torch.zeros(self.size, max_batch, dtype=torch.int64, pin_memory=is_cuda)
        self.lp = torch.zeros(self.size, max_batch, 2, dtype=torch.float32, pin_memory=is_cuda)

    def handle(
        self,
        slots: DecodeSlots,
        n: int,
        support_lp: torch.Tensor | None,
        support_mask: torch.Tensor | None,
        timing: Any,
        timer: StepTimer,
        *,
        on_host: bool = False,
    ) -> StepHandle:
        """The launched step's handle; on CUDA its outputs reach the next host slot (`on_host`: the fused sampler
        wrote them there itself, else they are copied from the device buffers)."""
        if not self.is_cuda:
            if timing is not None:
                timer.record(timing)
            # Clones: a look-ahead step may overwrite the buffers before this one is read.
            return StepHandle(slots.out_tok[:n].clone(), slots.out_lp[:n].clone(), None, support_lp, support_mask)
        slot = self.i
        self.i = (slot + 1) % self.size
        tok, lp = self.tok[slot, :n], self.lp[slot, :n]
        if not on_host:
            tok.copy_(slots.out_tok[:n], non_blocking=True)
            lp.copy_(slots.out_lp[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepHandle(tok, lp, event, support_lp, support_mask, timing, timer)
