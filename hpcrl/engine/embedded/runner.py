"""The decode step of the embedded engine and the per-slot state it reads, kept on the model's device.

Each running sequence owns one cache slot b (0..n-1); its next input token, position, sampling seed
and token index live in device buffers indexed by b. A decode step reads them, samples, and advances
them in place, so consecutive steps need nothing from the host: the scheduler rewrites the buffers
only when the set of running sequences changes, and reads each step's tokens back asynchronously.

Four ways to run the step, picked once per engine (`mode`):
- "eager": plain torch ops (`torch_forward`) and `sampling.sample` (CPU, and CUDA without Triton); on
  the CPU, prompts are prefilled by `_torch_prefill` with the same fused weights and GEMMs;
- "compile": the CPU step and its unit-temperature sampler compiled by torch.compile (`compiled.py`;
  opt-in: the first step compiles for several seconds); prefill as in "eager";
- "triton": the fused kernels of `kernels/`, launched one by one (CUDA);
- "graph": the same kernels captured in one CUDA graph per batch-size bucket (CUDA, the default);
  "triton" and "graph" prefill with those kernels too (`fused_prefill.py`; engine.kernels.prefill: model: the model's);
- "invariant": `hpcrl.model.invariant` for prefill and decode, sampling from its log-prob rows
  (`--batch-invariant`, CPU float32): a token's log-prob does not depend on its batch or on prefill vs decode.
Top-k/top-p/min-p and sampling-support requests always use `sampling.sample` on the step's logits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from hpcrl.engine.embedded import first_token, fused_prefill
from hpcrl.engine.embedded.forward import ForwardPaths, split_k_for
from hpcrl.engine.embedded.graphs import GraphCache
from hpcrl.engine.embedded.kernels import launch, sampler
from hpcrl.engine.embedded.sampling import sample
from hpcrl.engine.embedded.slots import DecodeSlots
from hpcrl.engine.embedded.step_output import HostRing, ReadyStep, RowState, StepHandle, StepOutput, host_output
from hpcrl.engine.embedded.step_timer import StepTimer
from hpcrl.model import invariant, moe
from hpcrl.model.qwen3 import CausalLM, KVCache

log = logging.getLogger(__name__)

MODES = ("eager", "triton", "graph", "compile", "invariant")


class DecodeRunner:
    """One engine's decode step and prefill in the mode it runs (`MODES`), composed of the slots' device state
    (`slots.DecodeSlots`), the forward (`forward.ForwardPaths`), the CUDA graphs (`graphs.GraphCache`) and the
    step's profile (`step_timer.StepTimer`)."""

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache | None,
        *,
        max_batch: int,
        device: torch.device,
        mode: str,
        profile: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"decode mode must be one of {MODES}, got {mode!r}")
        self.model = model
        self.cache = cache
        self.max_batch = max_batch
        self.device = device
        self.mode = mode
        self.profile = profile
        self.is_cuda = device.type == "cuda"
        # Prompts through the decode step's kernels (fused_prefill.py) wherever those kernels decode.
        settings = launch.SETTINGS
        self.prefill_fused = settings.prefill != "model" and mode in ("triton", "graph")
        if settings.prefill == "fused" and not self.prefill_fused:
            log.warning("kernels.prefill fused needs the triton or graph decode mode; %s prefills as before", mode)
        if settings.gemm == "triton" and mode not in ("triton", "graph"):
            log.warning("kernels.gemm triton needs the triton or graph decode mode; %s decodes as before", mode)
        self.paths = ForwardPaths(model, cache, device=device, split_k=split_k_for(model.args, settings.cublas_split_k))
        # The invariant mode uses it only on its log-prob rows at temperature 1 without supports (_invariant_step).
        self.fast_sampler = self.is_cuda and mode != "eager"
        self.slots = DecodeSlots(max_batch, device)
        self.timer = StepTimer(self.is_cuda)
        self.stats = self.timer.stats
        self.graphs = GraphCache(max_batch, self.stats)
        self._compiled: Any = None  # compiled.CompiledStep, made on the first "compile" step
        self.host = HostRing(max_batch, self.is_cuda)
        self._direct_out = True  # the fused sampler may write host slots (off after a failed launch)

    # ----- state -----
    def set_cache(self, cache: KVCache | None) -> None:
        self.cache = cache
        self.paths.set_cache(cache)
        self.reset_graphs()

    def reset_graphs(self) -> None:
        """Forget captured graphs (they hold raw addresses of the cache and the weights) and the
        fused weights (re-made from the parameters on the next fused step)."""
        self.graphs.clear()
        self.paths.drop_fused()

    def write_rows(self, rows: Sequence[RowState]) -> None:
        """Rewrite slots 0..len(rows)-1 from the host; padding slots get harmless values."""
        self.slots.write_rows(rows)

    # ----- decode -----
    def decode(self, n: int, *, torch_sampler: bool, want_support: bool) -> StepHandle:
        """Launch one decode step for slots 0..n-1 (asynchronous on CUDA)."""
        assert self.cache is not None and 0 < n <= self.max_batch
        timing = self.timer.events() if self.profile else None
        if self.mode == "invariant":
            return self._invariant_step(n, timing, want_support=want_support)
        if self.mode == "compile" and n >= 2 and self.cache.max_len > 2:
            done = self._compiled_step(n, timing, torch_sampler=torch_sampler, want_support=want_support)
            if done is not None:
                return done
        logits = self._forward(n)
        if timing is not None:
            self.timer.mark(timing, 1)
        support_lp = support_mask = None
        fast = self.fast_sampler and not torch_sampler and self._fast_sample(logits, n)
        if not fast:
            out = sample(
                logits, self.slots.params(n), want_support=want_support, unit_temperature=self.slots.unit_temperature
            )
            if not self.is_cuda:
                # Synchronous: hand the outputs over as they are and advance the slot state.
                return self._advance_and_hand_over(n, out, timing)
            self.slots.out_tok[:n].copy_(out.token_ids)
            self.slots.out_lp[:n, 0].copy_(out.logprobs)
            self.slots.out_lp[:n, 1].copy_(out.scaled_logprobs)
            self.slots.advance(n, out.token_ids)
            support_lp, support_mask = out.support_logprobs, out.support_mask
        if timing is not None:
            self.timer.mark(timing, 2)
        return self.host.handle(
            self.slots, n, support_lp, support_mask, timing, self.timer, on_host=fast and self._direct_out
        )

    def _invariant_step(self, n: int, timing: Any, *, want_support: bool) -> StepHandle:
        """The batch-invariant step: the invariant forward, then sampling from its log-prob rows.

        On CUDA with the invariant kernels the forward is a CUDA graph per batch bucket: it is a few thousand
        small launches, and its padding rows change nothing for the real ones (every row is computed alone).
        """
        assert self.cache is not None
        if self.is_cuda and invariant.graphable(self.model, self.slots.tokens):
            graph, lp_all = self._invariant_graph(self.graphs.bucket(n))
            graph.replay()
            lp = lp_all[:n]
        else:
            lp = self._invariant_forward(n)
        if timing is not None:
            self.timer.mark(timing, 1)
        fast = self.fast_sampler and self.slots.unit_temperature and not want_support
        if fast and self._fast_sample(lp, n, logprob_rows=True):
            # One pass over the rows on the device, the slot state advanced there, and no host sync: the
            # step is handed over like the plain one's (the reported log-prob is still the row's entry).
            if timing is not None:
                self.timer.mark(timing, 2)
            return self.host.handle(self.slots, n, None, None, timing, self.timer, on_host=self._direct_out)
        out = sample(
            lp,
            self.slots.params(n),
            want_support=want_support,
            unit_temperature=self.slots.unit_temperature,
            logprobs=lp,
        )
        return self._advance_and_hand_over(n, out, timing)

    def _advance_and_hand_over(self, n: int, out: Any, timing: Any) -> StepHandle:
        """A synchronous step's end: advance the first n slots by their sampled tokens, hand the outputs over."""
        self.slots.advance(n, out.token_ids)
        if timing is not None:
            self.timer.mark(timing, 2)
        step = ReadyStep(host_output(out))
        if timing is not None:  # after the outputs reached the host, so on CUDA the events have completed
            self.timer.record(timing)
        return step

    def _compiled_step(self, n: int, timing: Any, *, torch_sampler: bool, want_support: bool) -> StepHandle | None:
        """The "compile" mode's step (CPU, n >= 2: batch 1 would compile a second graph); None when
        the compiled step failed (the mode falls back to eager)."""
        try:
            if self._compiled is None:
                from hpcrl.engine.embedded.compiled import CompiledStep

                self._compiled = CompiledStep()
            logits, tok, lp = self._compiled(self, n)
        except Exception:  # noqa: BLE001 - no compiler, or a compile error: decode eagerly instead
            log.exception("the compiled CPU decode step failed; decoding with the eager step from now on")
            self.mode = "eager"
            return None
        self.stats["compile_s"] = self._compiled.compile_s
        if timing is not None:
            self.timer.mark(timing, 1)
        if torch_sampler or want_support or not self.slots.unit_temperature:
            # Filtered rows, another temperature or sampling support: the torch sampler on the logits.
            out = sample(
                logits, self.slots.params(n), want_support=want_support, unit_temperature=self.slots.unit_temperature
            )
            tok = out.token_ids
            step_out = host_output(out)
        else:
            lps = lp.tolist()
            step_out = StepOutput(
                tokens=tok.tolist(), logprobs=lps, scaled_logprobs=lps, support_logprobs=None, support_mask=None
            )
        self.slots.advance(n, tok)
        if timing is not None:
            self.timer.mark(timing, 2)
            self.timer.record(timing)
        return ReadyStep(step_out)

    def _fast_sample(self, logits: torch.Tensor, n: int, *, logprob_rows: bool = False) -> bool:
        # On CUDA the sampler writes its outputs straight into the next pinned host slot (pinned memory is mapped
        # into the device's address space): the two copies it replaces held the device 6.7 us a step between
        # steps on an H200 (8.5 -> 1.7 us, benchmarks/decode_h200_2026-12.md).
        direct = self.is_cuda and self._direct_out
        out_tok = self.host.tok[self.host.i, :n] if direct else self.slots.out_tok[:n]
        out_lp = self.host.lp[self.host.i, :n] if direct else self.slots.out_lp[:n]
        try:
            sampler.sample_rows(
                logits,
                self.slots.temperature[:n],
                self.slots.seeds[:n],
                self.slots.steps[:n],
                out_tok,
                out_lp,
                tokens=self.slots.tokens[:n],
                positions=self.slots.positions[:n],
                logprob_rows=logprob_rows,
            )
        except Exception:  # noqa: BLE001 - a compile failure must not stop generation
            if direct:
                # A platform whose kernels cannot take a host pointer: keep the fused sampler, with the copies.
                log.exception("the fused sampler could not write to pinned host memory; it writes device buffers")
                self._direct_out = False
                return self._fast_sample(logits, n, logprob_rows=logprob_rows)
            log.exception("the fused sampling kernel failed; sampling with torch from now on")
            self.fast_sampler = False
            return False
        return True

    def _forward(self, n: int) -> torch.Tensor:
        if self.mode == "graph":
            try:
                graph, logits = self._graph(self.graphs.bucket(n))
            except Exception:  # noqa: BLE001 - fall back rather than fail every request
                log.exception("CUDA graph capture failed; decoding with eager Triton kernels from now on")
                self.mode = "triton"
                self.reset_graphs()
            else:
                graph.replay()
                return logits[:n]
        if self.mode == "triton":
            try:
                return self.fast_forward(n)
            except Exception:  # noqa: BLE001
                log.exception("the fused decode kernels failed; decoding with the eager model from now on")
                self.mode = "eager"
                self.fast_sampler = False
        return self.torch_forward(n)

    def _graph(self, nb: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The fused-kernel decode step for batch bucket nb, captured on first use."""
        if nb not in self.graphs and self.paths.fused is None:
            self.paths.fuse_weights()  # never inside a capture: it allocates and re-points parameters
        return self.graphs.captured(nb, self.fast_forward, "the decode step")

    def _invariant_forward(self, n: int) -> torch.Tensor:
        assert self.cache is not None
        logits = invariant.decode(
            self.model, self.cache, self.slots.tokens[:n], self.slots.positions[:n], fused=self.paths.fused
        )
        return invariant.logprob_rows(logits)

    def _invariant_graph(self, nb: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The batch-invariant decode step (log-prob rows) for batch bucket nb, captured on first use; with the
        q/k/v and gate/up weights stacked when that keeps the bits (`invariant.fusable`)."""
        if nb not in self.graphs and self.paths.fused is None and invariant.fusable(self.model.args):
            self.paths.fuse_weights()  # never inside a capture: it allocates and re-points parameters
        return self.graphs.captured(nb, self._invariant_forward, "the batch-invariant decode step")

    def fast_forward(self, n: int) -> torch.Tensor:
        """Logits [n, V] of the tokens in slots 0..n-1 with the fused kernels; no host syncs."""
        return self.paths.fused_forward(self.slots.tokens, self.slots.positions, n)

    def torch_forward(self, n: int) -> torch.Tensor:
        """Logits [n, V] of the tokens in slots 0..n-1 with plain torch ops (the CPU decode step)."""
        if self.model.args.moe is not None:
            # Experts per expert through the model's own forward (the fused step is written for a dense MLP).
            assert self.cache is not None
            zero = torch.zeros(n, dtype=torch.long, device=self.device)
            tokens = self.slots.tokens[:n, None]
            return self.model.forward_cached(tokens, self.cache, 0, self.slots.positions[:n], zero)
        return self.paths.torch_forward(self.slots.tokens, self.slots.positions, n)

    def routes(self, b: int, t: int) -> torch.Tensor | None:
        """The experts each token of the latest forward [b, t] was routed to, [b, t, layers, k] int32 on the device
        (None for a dense model)."""
        args = self.model.args.moe
        return None if args is None else moe.routes_of(self.model.routing, args, b, t)

    # ----- prefill -----
    def prefill(self, ids: torch.Tensor, first_slot: int, last: torch.Tensor) -> torch.Tensor:
        """Run right-padded prompts ids [B, T] from position 0 into cache slots first_slot..; returns
        the logits at `last` [B] of each row (the position that predicts the next token), [B, V]."""
        assert self.cache is not None
        b = ids.shape[0]
        if self.mode == "invariant":
            return invariant.prefill(self.model, self.cache, ids, first_slot, last)
        if self.prefill_fused and self.mode in ("triton", "graph"):  # not after a fallback of the decode kernels
            fused, rope = self.paths.kernel_tables()
            try:
                return fused_prefill.prefill_logits(self.model, self.cache, fused, rope, ids, first_slot, last)
            except Exception:  # noqa: BLE001 - fall back rather than fail every request, as decode does
                log.exception("the fused prefill failed; prefilling with the model's forward from now on")
                self.prefill_fused = False
        if self.mode not in ("eager", "compile") or self.is_cuda or self.model.args.moe is not None:
            start = torch.zeros(b, dtype=torch.long, device=self.device)
            return self.model.forward_cached(ids, self.cache, first_slot, start, last, from_start=True)
        return self.paths.torch_prefill(ids, first_slot, last)

    def sample_prefill(
        self, logits: torch.Tensor, rows: Sequence[RowState], *, torch_sampler: bool, want_support: bool
    ) -> StepOutput:
        """Sample the first token of freshly prefilled rows (synchronous); slot buffers are not touched."""
        fast = self.fast_sampler and not torch_sampler
        return first_token.sample(logits, rows, self.device, invariant_rows=self.mode == "invariant", fast=fast,
                                  want_support=want_support)  # fmt: skip
