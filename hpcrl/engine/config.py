"""Rollout engine settings (the engines a run starts and drives)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from hpcrl.engine.kernels_config import KernelsConfig

DEFAULT_STARTUP_TIMEOUT_S = {"embedded": 120.0, "sglang": 600.0}

DEFAULT_MAX_RUNNING_REQUESTS = 256
"""Sequences an engine decodes together. The one default of `engine.max_running_requests`, `hpcrl engine serve
--max-running-requests` and the embedded scheduler: a quickstart step (16 prompts x 8 samples) fits in one wave."""


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    """The rollout engines the run starts and drives: hpcrl's embedded engine or SGLang servers, how many, where,
    and how the fleet watches and restarts them."""

    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "onpolicy_logprobs": (
            "it re-scored finished sequences with the trainer's forward, which relabels the log-probs but leaves "
            "the tokens sampled from the engine's own distribution; re-scoring is now engine.logprobs: recompute, "
            "and true on-policy is engine.batch_invariant: true with train.logprobs: invariant"
        ),
    }
    kind: Literal["embedded", "sglang"] = "embedded"
    """`embedded` runs hpcrl's own engine (`hpcrl engine serve`); `sglang` runs `python -m sglang.launch_server`
    (install the `sglang` extra on the GPU nodes)."""
    SERVE_KEYS: ClassVar[tuple[str, ...]] = (
        "device", "dtype", "max_running_requests", "context_length", "max_prefill_tokens", "deterministic",
        "logprobs", "batch_invariant", "kv_cache_dtype", "num_threads", "group_timeout_s", "enable_weights_cpu_backup",
        "decode_mode", "decode_overlap", "decode_profile", "kernels",
    )  # fmt: skip
    """What one embedded engine process reads (`hpcrl engine serve` has a flag for each); the other keys are the
    fleet's, which the launcher reads."""
    num_engines: int = 1
    """Engine processes (servers) in the fleet, each with its own copy of the weights; a step's prompt groups are
    spread over the live ones, whole groups each. Under Slurm, the total over the engine nodes (it must
    split evenly over them). On a CPU, several engines of fewer `num_threads` each can beat one engine of all
    cores; on GPUs, one engine per GPU (or per `tp_size` GPUs with sglang)."""
    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The weights' and activations' dtype."""
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    """Sequences decoded together (an engine's KV-cache slots)."""
    context_length: int | None = None
    """embedded: the most prompt + output tokens of a sequence (null: the model's max_position_embeddings)."""
    max_prefill_tokens: int = 4096
    """embedded: prompt tokens prefilled in one forward (a group's other samples are copied from its prompt's
    prefill and not counted); every waiting prompt that fits is prefilled before the next decode step."""
    deterministic: bool = True
    """Batches form only on an idle engine: a resumed run regenerates exactly what it would have, and a /generate
    call gives bit-identical results every time (false: requests join a running batch, for throughput)."""
    logprobs: Literal["sampled", "recompute"] = "sampled"
    """embedded: which log-probs an engine reports. `sampled`: those of the distribution it sampled from.
    `recompute`: a finished sequence re-scored by the model's standard full-sequence forward (the tokens still
    come from the decode distribution, so this is a relabel, not on-policy); the sampled-vs-reported difference
    is recorded as rollout/recompute_abs_diff and the train/rollout gap metrics are NaN (they would compare the
    trainer with a re-score, not with the sampler)."""
    batch_invariant: bool = False
    """embedded, CPU or CUDA, float32 or bfloat16: prefill, decode and sampling run hpcrl.model.invariant, whose
    logits for a token do not depend on batch size, batch composition or prefill vs decode; with
    train.logprobs: invariant the trainer scores with the same forward and the train/rollout gap is exactly 0.0
    (docs/numerics.md)."""
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """K/V cache storage. `auto`: the model's dtype. `fp8_e4m3`: 8-bit floats (scale 1, saturating at +-448), half
    the bytes of bfloat16; at batch 256 a decode step is mostly the attention reading K/V, so this is the engine's
    largest speed lever, at the price of a larger train/rollout log-prob gap (measured every step).
    embedded: CUDA with the fused decode path (decode_mode auto, graph or triton), bfloat16 or
    float16, not batch_invariant. sglang: passed as --kv-cache-dtype."""
    num_threads: int = 1
    """Torch CPU threads of each engine (and its OMP_NUM_THREADS)."""
    group_timeout_s: float = 300.0
    """embedded: bound on a weight-group rendezvous (update_weights_from_distributed)."""
    enable_weights_cpu_backup: bool = False
    """embedded: keep a host copy of the weights that release_memory_occupation frees."""
    startup_timeout_s: float | None = None
    """Bound on an engine's start (process launch to its first healthy answer); while it runs the engine
    is `starting`, never `hung`. None: the kind's own (embedded 120 s; sglang 600 s, since a stock SGLang
    server takes 130-150 s to answer /health on an H200, its port silent meanwhile)."""
    base_port: int = 0
    """First port; 0 picks free ports."""
    health_interval_s: float = 1.0
    """How often the fleet probes every engine (/health) and checks its process."""
    health_timeout_s: float = 3.0
    """Seconds one /health probe of the fleet's monitor may take; a probe that runs out only counts as a missed
    answer, and an engine with no answer for `hung_after_s` is hung. At most `hung_after_s`; raise it when a
    loaded engine answers slowly."""
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
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """embedded: the launch parameters of the CUDA decode kernels (`engine.kernels.*`; each also overridable by an
    HPCRL_ENGINE_<KEY> environment variable for a sweep, named in the engine's start-up line)."""

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
        if self.kind == "sglang":
            embedded_only = [key for key in _EMBEDDED_ONLY if getattr(self, key) != _default(key)]
            if embedded_only:
                raise ValueError(
                    f"{', '.join(embedded_only)} apply to kind: embedded only; pass SGLang's own flags in sglang_args"
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
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1 (or null: the model's), got {self.context_length}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if not (math.isfinite(self.group_timeout_s) and self.group_timeout_s > 0):
            raise ValueError(f"group_timeout_s must be a positive number of seconds, got {self.group_timeout_s}")
        if not 0 <= self.base_port <= 65535:
            raise ValueError(
                f"base_port must be a TCP port (1 to 65535), or 0 to pick free ports; got {self.base_port}"
            )
        if not self.health_interval_s > 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")
        if not 0 < self.health_timeout_s <= self.hung_after_s:
            raise ValueError("health_timeout_s must be > 0 and <= hung_after_s")


_EMBEDDED_ONLY = (
    "decode_mode", "decode_overlap", "decode_profile", "context_length", "max_prefill_tokens", "group_timeout_s",
    "enable_weights_cpu_backup", "kernels",
)  # fmt: skip


def _default(name: str) -> object:
    f = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


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
