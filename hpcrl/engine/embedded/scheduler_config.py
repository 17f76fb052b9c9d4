"""The scheduler's view of the engine section (`SchedulerConfig`) and the decode mode it resolves to on this device."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.embedded.kernels import launch
from hpcrl.model import invariant
from hpcrl.model.qwen3 import CausalLM

# The scheduler's logger: these messages are about how the scheduler decodes.
log = logging.getLogger("hpcrl.engine.embedded.scheduler")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The scheduler's view of the engine section: its settings as `EngineConfig` declares, defaults and checks
    them, plus the one thing only the loaded model decides, the context length."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    context_length: int
    """engine.context_length, or the model's max_position_embeddings where that is null."""

    @property
    def max_running_requests(self) -> int:
        return self.engine.max_running_requests

    @property
    def max_prefill_tokens(self) -> int:
        return self.engine.max_prefill_tokens

    @property
    def deterministic(self) -> bool:
        return self.engine.deterministic

    @property
    def logprobs(self) -> str:
        """`sampled`, or `recompute`: re-score finished sequences (see _complete)."""
        return self.engine.logprobs

    @property
    def batch_invariant(self) -> bool:
        """The "invariant" decode mode (hpcrl.model.invariant)."""
        return self.engine.batch_invariant

    @property
    def kv_cache_dtype(self) -> torch.dtype | None:
        """None: the model's dtype."""
        return torch.float8_e4m3fn if self.engine.kv_cache_dtype == "fp8_e4m3" else None

    @property
    def decode_mode(self) -> str:
        return self.engine.decode_mode

    @property
    def overlap(self) -> bool | None:
        """Launch step t+1 before reading step t (None: on for CUDA, where launches are asynchronous)."""
        return {"auto": None, "on": True, "off": False}[self.engine.decode_overlap]

    @property
    def profile(self) -> bool:
        return self.engine.decode_profile


def resolve_decode_mode(
    requested: str, model: CausalLM, device: torch.device, dtype: torch.dtype, *, batch_invariant: bool = False
) -> str:
    if batch_invariant:
        reason = invariant.supported_reason(device, dtype) or invariant.unsupported_model(model.args)
        if reason is not None:
            raise ValueError(f"--batch-invariant: {reason}")
        if requested not in ("auto", "eager"):
            raise ValueError(f"--batch-invariant runs its own decode step; --decode-mode {requested} cannot apply")
        invariant.pin_backend_numerics(device)
        return "invariant"
    if requested not in ("auto", "eager", "triton", "graph", "compile"):
        raise ValueError(f"decode mode must be auto, eager, triton, graph or compile, got {requested!r}")
    if model.args.moe is not None:
        # The fused kernels and the compiled step are written for the dense MLP; experts run per expert in torch.
        if requested not in ("auto", "eager"):
            log.warning("decode mode %s covers dense models; this mixture-of-experts model decodes eagerly", requested)
        return "eager"
    if requested == "compile":
        if device.type == "cpu":
            return "compile"  # torch.compile of the CPU step (opt-in: it compiles for seconds)
        log.warning("decode mode compile is for the CPU; using the default mode for %s", device.type)
        requested = "auto"
    if device.type != "cuda":
        return "eager"  # the fused kernels are Triton GPU code
    reason = launch.supported(model.args.head_dim, dtype)
    if reason is not None:
        if requested in ("triton", "graph"):
            log.warning("decode mode %s is unavailable (%s); using the eager model", requested, reason)
        return "eager"
    return "graph" if requested == "auto" else requested
