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
- "triton": the fused kernels of `kernels.py`, launched one by one (CUDA);
- "graph": the same kernels captured in one CUDA graph per batch-size bucket (CUDA, the default);
  "triton" and "graph" prefill with those kernels too (`fused_prefill.py`; engine.kernels.prefill: model: the model's);
- "invariant": `hpcrl.model.invariant` for prefill and decode, sampling from its log-prob rows
  (`--batch-invariant`, CPU float32): a token's log-prob does not depend on its batch or on prefill vs decode.
Top-k/top-p/min-p and sampling-support requests always use `sampling.sample` on the step's logits.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hpcrl.engine.embedded import fused_prefill, kernels
from hpcrl.engine.embedded.sampling import RowParams, SampleOutput, sample
from hpcrl.model import invariant
from hpcrl.model.qwen3 import CausalLM, KVCache, rope_cos_sin

log = logging.getLogger(__name__)

MODES = ("eager", "triton", "graph", "compile", "invariant")


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
        runner: DecodeRunner | None = None,
    ) -> None:
        self._tok, self._lp, self._event = tok, lp, event
        self._support_lp, self._support_mask = support_lp, support_mask
        self._timing, self._runner = timing, runner
        self._out: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._out is None:
            if self._event is not None:
                self._event.synchronize()
            if self._timing is not None and self._runner is not None:
                self._runner._record_timing(self._timing)
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


def _host_output(out: SampleOutput) -> StepOutput:
    lp = out.logprobs.tolist()
    return StepOutput(
        tokens=out.token_ids.tolist(),
        logprobs=lp,
        # The unit-temperature sampler returns one tensor for both: convert it once.
        scaled_logprobs=lp if out.scaled_logprobs is out.logprobs else out.scaled_logprobs.tolist(),
        support_logprobs=out.support_logprobs.tolist() if out.support_logprobs is not None else None,
        support_mask=out.support_mask.cpu() if out.support_mask is not None else None,
    )


def batch_buckets(max_batch: int) -> list[int]:
    """CUDA-graph batch sizes: 1, 2, 4, 8, then every 16 (every 64 past 512); a step pads to the next."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    step = 16
    s = 16
    while s < max_batch:
        sizes.append(s)
        if s >= 512:
            step = 64
        s += step
    sizes.append(max_batch)
    return sizes


class DecodeRunner:
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
        settings = kernels.SETTINGS
        self.prefill_fused = settings.prefill != "model" and mode in ("triton", "graph")
        if settings.prefill == "fused" and not self.prefill_fused:
            log.warning("kernels.prefill fused needs the triton or graph decode mode; %s prefills as before", mode)
        if settings.gemm == "triton" and mode not in ("triton", "graph"):
            log.warning("kernels.gemm triton needs the triton or graph decode mode; %s decodes as before", mode)
        self.split_k = _split_k_for(model.args, settings.cublas_split_k)
        # The invariant mode uses it only on its log-prob rows at temperature 1 without supports (_invariant_step).
        self.fast_sampler = self.is_cuda and mode != "eager"
        z: dict[str, Any] = dict(device=device)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, **z)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, **z)
        self.seeds = torch.zeros(max_batch, dtype=torch.int64, **z)
        self.steps = torch.zeros(max_batch, dtype=torch.int64, **z)
        self.temperature = torch.ones(max_batch, dtype=torch.float32, **z)
        self.top_k = torch.full((max_batch,), -1, dtype=torch.int64, **z)
        self.top_p = torch.ones(max_batch, dtype=torch.float32, **z)
        self.min_p = torch.zeros(max_batch, dtype=torch.float32, **z)
        self.out_tok = torch.zeros(max_batch, dtype=torch.int64, **z)
        self.out_lp = torch.zeros(max_batch, 2, dtype=torch.float32, **z)
        self.buckets = batch_buckets(max_batch)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._torch_rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._unit_temperature = False
        # The model's dtype, not the cache's: an 8-bit cache stores K/V, the math runs in the model's dtype.
        self.model_dtype = model.model.embed_tokens.weight.dtype
        # Per layer: the fused [q; k; v] weight (and bias) and [gate; up] weight that the model's
        # parameters are views of (see _fuse_weights).
        self._fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] | None = None
        self._compiled: Any = None  # compiled.CompiledStep, made on the first "compile" step
        # Pinned host buffers that steps copy their tokens into, reused round-robin: at most two
        # steps are unread at a time (look-ahead), and allocating pinned memory per step is slow.
        self._ring = 4
        self._ring_i = 0
        self._host_tok = torch.zeros(self._ring, max_batch, dtype=torch.int64, pin_memory=self.is_cuda)
        self._host_lp = torch.zeros(self._ring, max_batch, 2, dtype=torch.float32, pin_memory=self.is_cuda)
        self.stats: dict[str, float] = {
            "steps": 0,
            "forward_ms": 0.0,
            "sample_ms": 0.0,
            "between_steps_ms": 0.0,
            "graph_captures": 0,
        }
        self._direct_out = True  # the fused sampler may write host slots (off after a failed launch)
        self._last_end: Any = None  # the profiled step's last event: the next step's gap is measured from it

    # ----- state -----
    def set_cache(self, cache: KVCache | None) -> None:
        self.cache = cache
        self._rope = None
        self._torch_rope = None
        self.reset_graphs()

    def reset_graphs(self) -> None:
        """Forget captured graphs (they hold raw addresses of the cache and the weights) and the
        fused weights (re-made from the parameters on the next fused step)."""
        self._graphs.clear()
        self._pool = None
        self._fused = None

    def _fuse_weights(self) -> None:
        """Make each layer's q/k/v (and gate/up) weights views of one tensor, so one GEMM computes them.

        The parameters keep their names and shapes, and weight updates that copy into them (every
        update path does) write into the fused tensors, so captured graphs stay valid. Releasing
        the weights replaces the parameters' storage; reset_graphs then drops these tensors too.
        """
        fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        for layer in self.model.model.decoder_layers:
            at, mlp = layer.self_attn, layer.mlp
            qkv_w = _fuse([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
            qkv_b = _fuse([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]) if at.q_proj.bias is not None else None
            gate_up = _fuse([mlp.gate_proj.weight, mlp.up_proj.weight])
            fused.append((qkv_w, qkv_b, gate_up))
        self._fused = fused

    def write_rows(self, rows: Sequence[RowState]) -> None:
        """Rewrite slots 0..len(rows)-1 from the host; padding slots get harmless values."""
        pad = self.max_batch - len(rows)

        def put(buf: torch.Tensor, values: list[Any], fill: Any) -> None:
            buf.copy_(torch.tensor(values + [fill] * pad, dtype=buf.dtype), non_blocking=False)

        put(self.tokens, [r.token for r in rows], 0)
        put(self.positions, [r.position for r in rows], 0)
        put(self.seeds, [r.seed for r in rows], 0)
        put(self.steps, [r.step for r in rows], 0)
        put(self.temperature, [r.temperature for r in rows], 1.0)
        put(self.top_k, [r.top_k for r in rows], -1)
        put(self.top_p, [r.top_p for r in rows], 1.0)
        put(self.min_p, [r.min_p for r in rows], 0.0)
        self._unit_temperature = all(r.temperature == 1.0 and not r.filtered for r in rows)

    # ----- decode -----
    def decode(self, n: int, *, torch_sampler: bool, want_support: bool) -> StepHandle:
        """Launch one decode step for slots 0..n-1 (asynchronous on CUDA)."""
        assert self.cache is not None and 0 < n <= self.max_batch
        timing = self._events() if self.profile else None
        if self.mode == "invariant":
            return self._invariant_step(n, timing, want_support=want_support)
        if self.mode == "compile" and n >= 2 and self.cache.max_len > 2:
            done = self._compiled_step(n, timing, torch_sampler=torch_sampler, want_support=want_support)
            if done is not None:
                return done
        logits = self._forward(n)
        if timing is not None:
            self._mark(timing, 1)
        support_lp = support_mask = None
        fast = self.fast_sampler and not torch_sampler and self._fast_sample(logits, n)
        if not fast:
            out = sample(logits, self._params(n), want_support=want_support, unit_temperature=self._unit_temperature)
            if not self.is_cuda:
                # Synchronous: hand the outputs over as they are and advance the slot state.
                return self._advance_and_hand_over(n, out, timing)
            self.out_tok[:n].copy_(out.token_ids)
            self.out_lp[:n, 0].copy_(out.logprobs)
            self.out_lp[:n, 1].copy_(out.scaled_logprobs)
            self.tokens[:n].copy_(out.token_ids)
            self.positions[:n] += 1
            self.steps[:n] += 1
            support_lp, support_mask = out.support_logprobs, out.support_mask
        if timing is not None:
            self._mark(timing, 2)
        return self._handle(n, support_lp, support_mask, timing, on_host=fast and self._direct_out)

    def _invariant_step(self, n: int, timing: Any, *, want_support: bool) -> StepHandle:
        """The batch-invariant step: the invariant forward, then sampling from its log-prob rows.

        On CUDA with the invariant kernels the forward is a CUDA graph per batch bucket: it is a few thousand
        small launches, and its padding rows change nothing for the real ones (every row is computed alone).
        """
        assert self.cache is not None
        if self.is_cuda and invariant.graphable(self.model, self.tokens):
            graph, lp_all = self._invariant_graph(self._bucket(n))
            graph.replay()
            lp = lp_all[:n]
        else:
            lp = self._invariant_forward(n)
        if timing is not None:
            self._mark(timing, 1)
        fast = self.fast_sampler and self._unit_temperature and not want_support
        if fast and self._fast_sample(lp, n, logprob_rows=True):
            # One pass over the rows on the device, the slot state advanced there, and no host sync: the
            # step is handed over like the plain one's (the reported log-prob is still the row's entry).
            if timing is not None:
                self._mark(timing, 2)
            return self._handle(n, None, None, timing, on_host=self._direct_out)
        out = sample(
            lp, self._params(n), want_support=want_support, unit_temperature=self._unit_temperature, logprobs=lp
        )
        return self._advance_and_hand_over(n, out, timing)

    def _advance_and_hand_over(self, n: int, out: Any, timing: Any) -> StepHandle:
        """A synchronous step's end: advance the first n slots by their sampled tokens, hand the outputs over."""
        self.tokens[:n].copy_(out.token_ids)
        self.positions[:n] += 1
        self.steps[:n] += 1
        if timing is not None:
            self._mark(timing, 2)
        step = ReadyStep(_host_output(out))
        if timing is not None:  # after the outputs reached the host, so on CUDA the events have completed
            self._record_timing(timing)
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
            self._mark(timing, 1)
        if torch_sampler or want_support or not self._unit_temperature:
            # Filtered rows, another temperature or sampling support: the torch sampler on the logits.
            out = sample(logits, self._params(n), want_support=want_support, unit_temperature=self._unit_temperature)
            tok = out.token_ids
            step_out = _host_output(out)
        else:
            lps = lp.tolist()
            step_out = StepOutput(
                tokens=tok.tolist(), logprobs=lps, scaled_logprobs=lps, support_logprobs=None, support_mask=None
            )
        self.tokens[:n].copy_(tok)
        self.positions[:n] += 1
        self.steps[:n] += 1
        if timing is not None:
            self._mark(timing, 2)
            self._record_timing(timing)
        return ReadyStep(step_out)

    def _fast_sample(self, logits: torch.Tensor, n: int, *, logprob_rows: bool = False) -> bool:
        # On CUDA the sampler writes its outputs straight into the next pinned host slot (pinned memory is mapped
        # into the device's address space): the two copies it replaces held the device 6.7 us a step between
        # steps on an H200 (8.5 -> 1.7 us, benchmarks/decode_h200_2026-12.md).
        direct = self.is_cuda and self._direct_out
        out_tok = self._host_tok[self._ring_i, :n] if direct else self.out_tok[:n]
        out_lp = self._host_lp[self._ring_i, :n] if direct else self.out_lp[:n]
        try:
            kernels.sample_rows(
                logits,
                self.temperature[:n],
                self.seeds[:n],
                self.steps[:n],
                out_tok,
                out_lp,
                tokens=self.tokens[:n],
                positions=self.positions[:n],
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

    def _handle(
        self,
        n: int,
        support_lp: torch.Tensor | None,
        support_mask: torch.Tensor | None,
        timing: Any,
        *,
        on_host: bool = False,
    ) -> StepHandle:
        """The launched step's handle; on CUDA its outputs reach the next host slot (`on_host`: the fused sampler
        wrote them there itself, else they are copied from the device buffers)."""
        if not self.is_cuda:
            if timing is not None:
                self._record_timing(timing)
            # Clones: a look-ahead step may overwrite the buffers before this one is read.
            return StepHandle(self.out_tok[:n].clone(), self.out_lp[:n].clone(), None, support_lp, support_mask)
        slot = self._ring_i
        self._ring_i = (slot + 1) % self._ring
        tok, lp = self._host_tok[slot, :n], self._host_lp[slot, :n]
        if not on_host:
            tok.copy_(self.out_tok[:n], non_blocking=True)
            lp.copy_(self.out_lp[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepHandle(tok, lp, event, support_lp, support_mask, timing, self)

    def _params(self, n: int) -> RowParams:
        return RowParams(
            temperature=self.temperature[:n],
            top_k=self.top_k[:n],
            top_p=self.top_p[:n],
            min_p=self.min_p[:n],
            seeds=self.seeds[:n],
            steps=self.steps[:n],
        )

    def _forward(self, n: int) -> torch.Tensor:
        if self.mode == "graph":
            try:
                graph, logits = self._graph(self._bucket(n))
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

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        return self.max_batch

    def _graph(self, nb: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The fused-kernel decode step for batch bucket nb, captured on first use."""
        if nb not in self._graphs and self._fused is None:
            self._fuse_weights()  # never inside a capture: it allocates and re-points parameters
        return self._captured(nb, self.fast_forward, "the decode step")

    def _invariant_forward(self, n: int) -> torch.Tensor:
        assert self.cache is not None
        logits = invariant.decode(self.model, self.cache, self.tokens[:n], self.positions[:n], fused=self._fused)
        return invariant.logprob_rows(logits)

    def _invariant_graph(self, nb: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The batch-invariant decode step (log-prob rows) for batch bucket nb, captured on first use; with the
        q/k/v and gate/up weights stacked when that keeps the bits (`invariant.fusable`)."""
        if nb not in self._graphs and self._fused is None and invariant.fusable(self.model.args):
            self._fuse_weights()  # never inside a capture: it allocates and re-points parameters
        return self._captured(nb, self._invariant_forward, "the batch-invariant decode step")

    def _captured(
        self, nb: int, forward: Callable[[int], torch.Tensor], what: str
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        hit = self._graphs.get(nb)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Warm-up outside capture (Triton compiles, cuBLAS picks kernels, tables are built). A step only
        # rewrites the K/V of each row's current token at its current position, so running it again is harmless.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward(nb)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the HTTP and weight-receiving threads may touch CUDA while this thread captures.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = forward(nb)
        self._graphs[nb] = (graph, out)
        self.stats["graph_captures"] += 1
        log.info("captured %s for batch %d in %.2f s", what, nb, time.perf_counter() - t0)
        return graph, out

    def fast_forward(self, n: int) -> torch.Tensor:
        """Logits [n, V] of the tokens in slots 0..n-1 with the fused kernels; no host syncs."""
        model, cache = self.model, self.cache
        assert cache is not None
        a = model.args
        fused, rope = self._kernel_tables()
        pos = self.positions[:n]
        layers = model.model.decoder_layers
        embed = model.model.embed_tokens.weight
        resid = torch.empty(n, a.hidden_size, dtype=embed.dtype, device=embed.device)
        h = torch.empty_like(resid)
        first = layers[0].input_layernorm
        kernels.embed_rmsnorm(self.tokens[:n], embed, resid, first.weight, first.eps, h)
        nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
        scale = 1.0 / math.sqrt(hd)
        act = torch.empty(n, a.intermediate_size, dtype=h.dtype, device=h.device)
        gemm = kernels.SETTINGS.gemm_configs() if kernels.SETTINGS.gemm == "triton" else None
        for i, layer in enumerate(layers):
            at = layer.self_attn
            qkv_w, qkv_b, gate_up_w = fused[i]
            if gemm is not None:
                qkv = kernels.linear(h, qkv_w, qkv_b, config=gemm["qkv"])
            else:
                qkv = F.linear(h, qkv_w, qkv_b)  # [n, (H + 2 KVH) D]
            kernels.layer_qk_norm_rope_store(at, a, qkv, rope, pos, cache.k[i], cache.v[i])
            o = torch.empty(n, nh * hd, dtype=h.dtype, device=h.device)
            kernels.decode_attention(qkv, cache.k[i], cache.v[i], pos, o, nh, nkv, hd, scale)
            post = layer.post_attention_layernorm
            if gemm is not None:
                # o and down as split-K partials that add_rmsnorm sums; gate/up with the SwiGLU product built in.
                kernels.add_rmsnorm(kernels.linear(o, at.o_proj.weight, config=gemm["o"]), resid, post.weight,
                                    post.eps, h)  # fmt: skip
                act = kernels.linear(h, gate_up_w, config=gemm["gate_up"], gated=True)
                d = kernels.linear(act, layer.mlp.down_proj.weight, config=gemm["down"])
            else:
                split_o, split_down = self.split_k if n <= kernels.CUBLAS_SPLIT_K_MAX_ROWS else (1, 1)
                kernels.add_rmsnorm(kernels.split_k_linear(o, at.o_proj.weight, split_o), resid, post.weight,
                                    post.eps, h)  # fmt: skip
                kernels.silu_mul(F.linear(h, gate_up_w), act)
                d = kernels.split_k_linear(act, layer.mlp.down_proj.weight, split_down)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            kernels.add_rmsnorm(d, resid, nxt.weight, nxt.eps, h)
        return model.logits(h)

    def _kernel_tables(
        self,
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
        """The fused kernels' inputs: each layer's fused weights, and cos/sin [max_len, D] in the model's dtype."""
        assert self.cache is not None
        if self._rope is None:
            a = self.model.args
            pos = torch.arange(self.cache.max_len, device=self.device)
            self._rope = rope_cos_sin(pos, a.head_dim, a.rope_theta, self.model_dtype, a.rope_scaling)
        if self._fused is None:
            self._fuse_weights()
        assert self._fused is not None
        return self._fused, self._rope

    def torch_forward(self, n: int) -> torch.Tensor:
        """Logits [n, V] of the tokens in slots 0..n-1 with plain torch ops (the CPU decode step).

        The math of `forward_cached` for one token per row, in about a third of its ops (each op's
        fixed cost is what a small model's CPU step is made of): fused QKV and gate/up GEMMs, one
        RMSNorm op, q and k heads normalised and rotated together and written back into the QKV
        output, where the new K and V rows sit side by side and reach the cache in one index_put;
        grouped-query attention as two batched matmuls over the cache without expanding K/V heads.
        """
        model, cache = self.model, self.cache
        assert cache is not None and cache.buffer is not None
        a = model.args
        fused = self._torch_weights()
        nh, nkv, hd, inter = a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size
        pos = self.positions[:n]
        length = min(int(pos.max()) + 1, cache.max_len)
        rope = self._rope_tables()
        cos, sin = rope[0][pos][:, None], rope[1][pos][:, None]  # [n, 1, D]
        # Indices of each row's new K and V entries in a layer's [2, slots, kv, L, D] block: [n, 2, kv].
        dev = self.device
        kv_index = (
            torch.arange(2, device=dev)[None, :, None],
            torch.arange(n, device=dev)[:, None, None],
            torch.arange(nkv, device=dev)[None, None, :],
            pos[:, None, None],
        )
        # Attention runs over (row, kv head) pairs as one batch of [group, D] x [D, length] products.
        key_pos = torch.arange(length, device=dev)
        bias = torch.zeros(n * nkv, 1, length, dtype=cos.dtype, device=dev)
        bias.masked_fill_(key_pos > pos.repeat_interleave(nkv)[:, None, None], float("-inf"))
        scale = 1.0 / math.sqrt(hd)
        group = nh // nkv
        layers = model.model.decoder_layers
        x = F.embedding(self.tokens[:n], model.model.embed_tokens.weight)
        for i, layer in enumerate(layers):
            at, norm = layer.self_attn, layer.input_layernorm
            qkv_w, qkv_b, gate_up_w = fused[i]
            qkv = _linear(F.rms_norm(x, (a.hidden_size,), norm.weight, norm.eps), qkv_w, qkv_b)
            qk = self._norm_rope_qk(qkv, at, cos, sin)
            block = cache.buffer[i]
            block.index_put_(kv_index, qkv[:, nh * hd :].view(n, 2, nkv, hd))
            q = qk[:, :nh].reshape(n * nkv, group, hd)
            keys = block[0, :n, :, :length].reshape(n * nkv, length, hd)  # a view: slots and heads merge
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)
            o = torch.bmm(torch.softmax(scores, -1), block[1, :n, :, :length].reshape(n * nkv, length, hd))
            x = x + _linear(o.reshape(n, nh * hd), at.o_proj.weight)
            post = layer.post_attention_layernorm
            gate_up = _linear(F.rms_norm(x, (a.hidden_size,), post.weight, post.eps), gate_up_w)
            x = x + _linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.mlp.down_proj.weight)
        final = model.model.norm
        return _linear(F.rms_norm(x, (a.hidden_size,), final.weight, final.eps), model.output_weight)

    def _torch_weights(self) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
        if self._fused is None:
            self._fuse_weights()
        assert self._fused is not None
        return self._fused

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [max_len, D], for `_norm_rope_qk`."""
        if self._torch_rope is None:
            assert self.cache is not None
            a = self.model.args
            pos = torch.arange(self.cache.max_len, device=self.device)
            cos, sin = rope_cos_sin(pos, a.head_dim, a.rope_theta, self.model_dtype, a.rope_scaling)
            half = a.head_dim // 2
            sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin)
            # rotate_half(x) = roll(x, D/2) * sign: the sign goes into the sin table.
            self._torch_rope = (cos, sin * sign)
        return self._torch_rope

    def _norm_rope_qk(self, qkv: torch.Tensor, at: Any, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Normalise (qk_norm) and rotate the q and k heads of a QKV output [..., (H + 2 KVH) D] in
        place; returns them as a view [..., H + KVH, D]. cos/sin broadcast against that view."""
        a = self.model.args
        nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
        qk = qkv[..., : (nh + nkv) * hd].unflatten(-1, (nh + nkv, hd))
        normed = qk
        if a.qk_norm:
            normed = F.rms_norm(qk, (hd,), eps=at.q_norm.eps)
            normed[..., :nh, :] *= at.q_norm.weight
            normed[..., nh:, :] *= at.k_norm.weight
        torch.addcmul(normed * cos, normed.roll(hd // 2, -1), sin, out=qk)
        return qk

    # ----- prefill -----
    def prefill(self, ids: torch.Tensor, first_slot: int, last: torch.Tensor) -> torch.Tensor:
        """Run right-padded prompts ids [B, T] from position 0 into cache slots first_slot..; returns
        the logits at `last` [B] of each row (the position that predicts the next token), [B, V]."""
        assert self.cache is not None
        b = ids.shape[0]
        if self.mode == "invariant":
            return invariant.prefill(self.model, self.cache, ids, first_slot, last)
        if self.prefill_fused and self.mode in ("triton", "graph"):  # not after a fallback of the decode kernels
            fused, rope = self._kernel_tables()
            try:
                return fused_prefill.prefill_logits(self.model, self.cache, fused, rope, ids, first_slot, last)
            except Exception:  # noqa: BLE001 - fall back rather than fail every request, as decode does
                log.exception("the fused prefill failed; prefilling with the model's forward from now on")
                self.prefill_fused = False
        if self.mode not in ("eager", "compile") or self.is_cuda:
            start = torch.zeros(b, dtype=torch.long, device=self.device)
            return self.model.forward_cached(ids, self.cache, first_slot, start, last, from_start=True)
        return self._torch_prefill(ids, first_slot, last)

    def _torch_prefill(self, ids: torch.Tensor, first_slot: int, last: torch.Tensor) -> torch.Tensor:
        """`forward_cached(from_start=True)` in plain torch ops with the decode step's fused weights and
        GEMMs. The last layer's attention output and MLP are computed for the `last` tokens only: the
        cache needs every token's K/V, but nothing else needs the last layer's other outputs."""
        model, cache = self.model, self.cache
        assert cache is not None and cache.buffer is not None
        a = model.args
        fused = self._torch_weights()
        nh, nkv, hd, inter, hidden = a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, a.hidden_size
        b, t = ids.shape
        rope = self._rope_tables()
        cos, sin = rope[0][:t, None], rope[1][:t, None]  # [T, 1, D]
        rows = slice(first_slot, first_slot + b)
        batch = torch.arange(b, device=self.device)
        layers = model.model.decoder_layers
        x = F.embedding(ids, model.model.embed_tokens.weight).view(b * t, hidden)
        for i, layer in enumerate(layers):
            at, norm = layer.self_attn, layer.input_layernorm
            qkv_w, qkv_b, gate_up_w = fused[i]
            qkv = _linear(F.rms_norm(x, (hidden,), norm.weight, norm.eps), qkv_w, qkv_b).view(b, t, -1)
            qk = self._norm_rope_qk(qkv, at, cos, sin)  # [B, T, H + KVH, D]
            block = cache.buffer[i]  # [2, slots, KVH, L, D]
            block[:, rows, :, :t] = qkv[..., nh * hd :].view(b, t, 2, nkv, hd).permute(2, 0, 3, 1, 4)
            keys, values = block[0, rows, :, :t], block[1, rows, :, :t]
            if i + 1 < len(layers):
                q = qk[:, :, :nh].transpose(1, 2)
                o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=nh != nkv)
                o = o.transpose(1, 2).reshape(b * t, nh * hd)
            else:
                x = x.view(b, t, hidden)[batch, last]
                q = qk[batch, last, :nh][:, :, None]  # [B, H, 1, D]
                visible = (torch.arange(t, device=self.device)[None, :] <= last[:, None])[:, None, None]
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=nh != nkv)
                o = o.reshape(b, nh * hd)
            x = x + _linear(o, at.o_proj.weight)
            post = layer.post_attention_layernorm
            gate_up = _linear(F.rms_norm(x, (hidden,), post.weight, post.eps), gate_up_w)
            x = x + _linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.mlp.down_proj.weight)
        final = model.model.norm
        return _linear(F.rms_norm(x, (hidden,), final.weight, final.eps), model.output_weight)

    def sample_prefill(
        self, logits: torch.Tensor, rows: Sequence[RowState], *, torch_sampler: bool, want_support: bool
    ) -> StepOutput:
        """Sample the first token of freshly prefilled rows (synchronous); slot buffers are not touched."""
        n = len(rows)
        dev = self.device
        temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=dev)
        seeds = torch.tensor([r.seed for r in rows], dtype=torch.int64, device=dev)
        steps = torch.tensor([r.step for r in rows], dtype=torch.int64, device=dev)
        # The invariant engine samples from the log-prob row itself and reports its entries.
        lp = invariant.logprob_rows(logits) if self.mode == "invariant" else None
        if torch_sampler or not self.fast_sampler or lp is not None:
            params = RowParams(
                temperature=temperature,
                top_k=torch.tensor([r.top_k for r in rows], dtype=torch.int64, device=dev),
                top_p=torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev),
                min_p=torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=dev),
                seeds=seeds,
                steps=steps,
            )
            unit = all(r.temperature == 1.0 and not r.filtered for r in rows)
            return _host_output(
                sample(
                    lp if lp is not None else logits,
                    params,
                    want_support=want_support,
                    unit_temperature=unit,
                    logprobs=lp,
                )
            )
        tok = torch.empty(n, dtype=torch.int64, device=dev)
        lp = torch.empty(n, 2, dtype=torch.float32, device=dev)
        kernels.sample_rows(logits, temperature, seeds, steps, tok, lp)
        lps = lp.tolist()
        return StepOutput(
            tokens=tok.tolist(),
            logprobs=[x[0] for x in lps],
            scaled_logprobs=[x[1] for x in lps],
            support_logprobs=None,
            support_mask=None,
        )

    # ----- profiling -----
    def _events(self) -> list[Any]:
        if self.is_cuda:
            ev: list[Any] = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            # The device's time between the last step's end and this one's start (the output copies, the
            # launches) counts only while that step is still queued or running: otherwise the gap is the host's.
            last = self._last_end
            ev.append(last if last is not None and not last.query() else None)
            ev[0].record()
            return ev
        return [time.perf_counter(), 0.0, 0.0, None]

    def _mark(self, timing: list[Any], i: int) -> None:
        if self.is_cuda:
            timing[i].record()
            if i == 2:
                self._last_end = timing[2]
        else:
            timing[i] = time.perf_counter()

    def _record_timing(self, timing: Sequence[Any]) -> None:
        if self.is_cuda:
            fwd, smp = timing[0].elapsed_time(timing[1]), timing[1].elapsed_time(timing[2])
            if timing[3] is not None:
                self.stats["between_steps_ms"] += timing[3].elapsed_time(timing[0])
        else:
            fwd, smp = (timing[1] - timing[0]) * 1e3, (timing[2] - timing[1]) * 1e3
        self.stats["steps"] += 1
        self.stats["forward_ms"] += fwd
        self.stats["sample_ms"] += smp


def _fuse(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor holding the params stacked on dim 0; each param becomes a view of its rows."""
    fused = torch.cat([p.detach() for p in params], dim=0)
    offset = 0
    for p in params:
        rows = p.shape[0]
        p.data = fused[offset : offset + rows]
        offset += rows
    return fused


# oneDNN's GEMM (AVX-512 on any x86 vendor) ran the engine's CPU GEMMs 1.4-2.3x faster than MKL's
# here (an AMD EPYC, where MKL takes its AVX2 path), but it costs ~10 us more per call: up to about two
# million multiply-adds (a 64x64x256 GEMM took 20-30 us with oneDNN, 20 with MKL) MKL wins. Only
# float32 was measured.
_ONEDNN_MIN_MACS = 1 << 21
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _split_k_for(args: Any, asked: tuple[int, int] | None) -> tuple[int, int]:
    """engine.kernels.cublas_split_k for a model: (o, down) parts that divide its K (heads x head_dim, the
    intermediate size). The default (null) that does not divide falls back to 1 (whole); a setting given is an
    error."""
    wanted = asked or kernels.CUBLAS_SPLIT_K_DEFAULT
    splits = []
    for what, parts, k in (
        ("o", wanted[0], args.num_heads * args.head_dim),
        ("down", wanted[1], args.intermediate_size),
    ):
        if k % parts == 0:
            splits.append(parts)
        elif asked is not None:
            raise ValueError(
                f"kernels.cublas_split_k {','.join(map(str, asked))}: {parts} parts do not divide this model's "
                f"{what} GEMM, K = {k}; use parts that divide it, or null for the default"
            )
        else:
            splits.append(1)
    return splits[0], splits[1]


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for 2-D CPU inputs, through oneDNN where that is faster."""
    if (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.shape[0] * w.shape[0] * w.shape[1] >= _ONEDNN_MIN_MACS
    ):
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)
