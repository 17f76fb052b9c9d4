"""Rollout engine settings (the engines a run starts and drives)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

DEFAULT_STARTUP_TIMEOUT_S = {"embedded": 120.0, "sglang": 600.0}

DEFAULT_MAX_RUNNING_REQUESTS = 256
"""Sequences an engine decodes together. The one default of `engine.max_running_requests`, `hpcrl engine serve
--max-running-requests` and the embedded scheduler: a quickstart step (16 prompts x 8 samples) fits in one wave."""


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "onpolicy_logprobs": (
            "it re-scored finished sequences with the trainer's forward, which relabels the log-probs but leaves "
            "the tokens sampled from the engine's own distribution; re-scoring is now engine.logprobs: recompute, "
            "and true on-policy is engine.batch_invariant: true with train.onpolicy: true"
        ),
    }
    kind: Literal["embedded", "sglang"] = "embedded"
    """`embedded` runs hpcrl's own engine (`hpcrl engine serve`); `sglang` runs `python -m sglang.launch_server`
    (install the `sglang` extra on the GPU nodes)."""
    num_engines: int = 1
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    deterministic: bool = True
    """Batches form only on an idle engine: a resumed run regenerates exactly what it would have."""
    logprobs: Literal["sampled", "recompute"] = "sampled"
    """embedded: which log-probs an engine reports. `sampled`: those of the distribution it sampled from.
    `recompute`: a finished sequence re-scored by the model's standard full-sequence forward (the tokens still
    come from the decode distribution, so this is a relabel, not on-policy); the sampled-vs-reported difference
    is recorded as rollout/recompute_abs_diff and the train/rollout gap metrics are NaN (they would compare the
    trainer with a re-score, not with the sampler)."""
    batch_invariant: bool = False
    """embedded, CPU or CUDA, float32 or bfloat16: prefill, decode and sampling run hpcrl.model.invariant, whose
    logits for a token do not depend on batch size, batch composition or prefill vs decode; with train.onpolicy the
    trainer scores with the same forward and the train/rollout gap is exactly 0.0 (docs/numerics.md)."""
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """K/V cache storage. `auto`: the model's dtype. `fp8_e4m3`: 8-bit floats (scale 1, saturating at +-448), half
    the bytes of bfloat16; at batch 256 a decode step is mostly the attention reading K/V, so this is the engine's
    largest speed lever, at the price of a larger train/rollout log-prob gap (measured every step;
    docs/benchmarks.md). embedded: CUDA with the fused decode path (decode_mode auto, graph or triton), bfloat16 or
    float16, not batch_invariant. sglang: passed as --kv-cache-dtype."""
    num_threads: int = 1
    startup_timeout_s: float | None = None
    """Bound on an engine's start (process launch to its first healthy answer); while it runs the engine
    is `starting`, never `hung`. None: the kind's own (embedded 120 s; sglang 600 s, since a stock SGLang
    server takes 130-150 s to answer /health on an H200, its port silent meanwhile)."""
    base_port: int = 0
    """First port; 0 picks free ports."""
    health_interval_s: float = 1.0
    """How often the fleet probes every engine (/health) and checks its process."""
    health_timeout_s: float = 3.0
    hung_after_s: float = 20.0
    """An engine that answers no probe for this long is hung (e.g. SIGSTOP): it is killed and restarted.
    One failed probe is never death: /health can be slow during a long prefill (sgl-project/sglang#22511)."""
    tp_size: int = 1
    """sglang: tensor-parallel GPUs per engine (--tp-size)."""
    mem_fraction_static: float | None = None
    """sglang: --mem-fraction-static (None: SGLang's default)."""
    enable_memory_saver: bool = False
    """sglang: --enable-memory-saver, needed for release/resume_memory_occupation (colocated runs)."""
    sglang_args: list[str] = field(default_factory=list)
    """sglang: further flags passed as they are, e.g. ["--attention-backend", "fa3"]."""
    offload_during_train: bool = False
    """Colocated runs: engines release their KV cache and weights while the trainer trains (and get them
    back before the weight push), each release checked to have freed memory."""
    max_restarts: int = 2
    """Restarts per engine; after that the engine is given up, and with none left the run stops."""
    decode_mode: Literal["auto", "eager", "triton", "graph", "compile"] = "auto"
    """embedded: how a decode step runs (`hpcrl engine serve --decode-mode`). `auto` is CUDA graphs of the fused
    Triton kernels on CUDA and the eager model on CPU; `eager` the plain torch model; `triton` the fused kernels
    without graphs; `graph` fused kernels in CUDA graphs; `compile` a torch.compile'd CPU step (opt-in: it
    compiles for seconds; ignored on CUDA)."""
    decode_overlap: Literal["auto", "on", "off"] = "auto"
    """embedded: launch decode step t+1 before reading step t's tokens (`--decode-overlap`); `auto` is on for
    CUDA, where launches are asynchronous, and off on CPU."""
    decode_profile: bool = False
    """embedded: time every decode step (CUDA events and host timers), reported in /server_info under
    internal_states[0].profile (`--decode-profile`)."""

    @property
    def start_timeout_s(self) -> float:
        """The start-up bound in force: the configured one or the kind's default."""
        if self.startup_timeout_s is not None:
            return self.startup_timeout_s
        return DEFAULT_STARTUP_TIMEOUT_S[self.kind]

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {self.num_engines}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.startup_timeout_s is not None and not self.startup_timeout_s > 0:
            raise ValueError(
                f"startup_timeout_s must be > 0 (or null: the kind's default), got {self.startup_timeout_s}"
            )
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.kind == "embedded" and (self.tp_size != 1 or self.sglang_args or self.enable_memory_saver):
            raise ValueError("tp_size, sglang_args and enable_memory_saver apply to kind: sglang only")
        if self.kind == "sglang" and (
            self.decode_mode != "auto" or self.decode_overlap != "auto" or self.decode_profile
        ):
            raise ValueError(
                "decode_mode, decode_overlap and decode_profile apply to kind: embedded only; "
                "pass SGLang's own flags in sglang_args"
            )
        if self.kind == "sglang" and (self.batch_invariant or self.logprobs != "sampled"):
            raise ValueError(
                "batch_invariant and logprobs: recompute apply to kind: embedded only (SGLang's own "
                "--enable-deterministic-inference goes in sglang_args)"
            )
        if self.batch_invariant:
            if not self.device.startswith(("cpu", "cuda")) or self.dtype not in ("float32", "bfloat16"):
                raise ValueError(
                    f"batch_invariant covers device cpu or cuda in float32 or bfloat16 (device {self.device!r}, "
                    f"dtype {self.dtype!r}); use one of those, or batch_invariant: false (docs/numerics.md)"
                )
            if self.logprobs == "recompute":
                raise ValueError(
                    "batch_invariant with logprobs: recompute would replace the sampled log-probs by a re-score; "
                    "use logprobs: sampled (the invariant engine's sampled log-probs already equal the trainer's)"
                )
            if self.decode_mode not in ("auto", "eager"):
                raise ValueError(
                    f"batch_invariant runs its own decode step; decode_mode {self.decode_mode!r} would not be "
                    "used: leave decode_mode at auto"
                )
        if self.kv_cache_dtype == "fp8_e4m3" and self.kind == "embedded":
            problem = fp8_kv_cache_problem(
                device=self.device, dtype=self.dtype, decode_mode=self.decode_mode, batch_invariant=self.batch_invariant
            )
            if problem:
                raise ValueError(f"kv_cache_dtype: fp8_e4m3 {problem}; or use kv_cache_dtype: auto")
        if self.offload_during_train and self.kind == "sglang" and not self.enable_memory_saver:
            raise ValueError("offload_during_train with kind: sglang needs enable_memory_saver: true")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not 0 <= self.base_port <= 65535:
            raise ValueError(
                f"base_port must be a TCP port (1 to 65535), or 0 to pick free ports; got {self.base_port}"
            )
        if not self.health_interval_s > 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")
        if not 0 < self.health_timeout_s <= self.hung_after_s:
            raise ValueError("health_timeout_s must be > 0 and <= hung_after_s")


def fp8_kv_cache_problem(*, device: str, dtype: str, decode_mode: str, batch_invariant: bool) -> str | None:
    """Why the embedded engine cannot keep an 8-bit K/V cache in this setting (None: it can).

    Only the fused CUDA decode kernels read 8-bit K/V (converting in registers); the eager and compiled steps and the
    batch-invariant one would need float8 matmuls that torch lacks, and batch_invariant promises the trainer's exact
    numbers, which a quantised cache breaks."""
    if not device.startswith("cuda"):
        return f"needs a CUDA device (the fused decode kernels), not {device!r}"
    if dtype not in ("bfloat16", "float16"):
        return f"needs dtype bfloat16 or float16 (the decode kernels' inputs), not {dtype!r}"
    if batch_invariant:
        return "cannot go with batch_invariant, whose log-probs must equal the trainer's bit for bit"
    if decode_mode not in ("auto", "graph", "triton"):
        return f"needs decode_mode auto, graph or triton (the fused kernels read 8-bit K/V), not {decode_mode!r}"
    return None
