"""What every decode kernel launch reads: the Triton import (optional), the resolved `engine.kernels` settings and
programmatic dependent launch (PDL)."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from hpcrl.engine.kernels_config import KernelsConfig

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    AVAILABLE = True
except ImportError:  # CPU-only installs have no Triton; the engine then decodes eagerly
    triton = None
    tl = None
    libdevice = None
    AVAILABLE = False


SETTINGS = KernelsConfig()
"""The resolved `engine.kernels` this process launches with (`configure`); every launch reads it, so a benchmark
may swap it (dataclasses.replace) to compare two settings in one process, recapturing its graphs."""


def configure(settings: KernelsConfig) -> None:
    """Launch every kernel of this process with `settings` (the engine section's kernels, env overrides applied):
    the kernels are process-wide, like the CUDA graphs that capture them."""
    global SETTINGS
    SETTINGS = settings


def nvidia_compiled() -> bool:
    """Whether Triton compiles the kernels for an NVIDIA GPU: not on ROCm, not under Triton's interpreter (which has
    neither tl.extra.cuda nor libdevice's fast functions)."""
    return torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


@functools.cache
def pdl_capable(device_index: int) -> bool:
    """Whether the decode kernels can use PDL on this CUDA device: NVIDIA (ROCm also reports a capability 9, and
    has no griddepcontrol), compute capability 9 or newer, and not under Triton's interpreter."""
    return nvidia_compiled() and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_on(device: torch.device) -> bool:
    """Whether kernels launched on `device` use programmatic dependent launch now."""
    if not SETTINGS.pdl or device.type != "cuda":
        return False
    return pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(t: torch.Tensor) -> dict[str, Any]:
    """The launch keywords of one kernel: PDL (its constexpr) and, with it on, Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if pdl_on(t.device) else {"PDL": False}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def supported(head_dim: int, dtype: torch.dtype) -> str | None:
    """None when the fused decode path can run this model, else the reason it cannot."""
    if not AVAILABLE:
        return "triton is not installed"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dtype} is not supported"
    return None


if AVAILABLE:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        # A kernel launched with launch_pdl starts while the kernel before it drains: nothing it reads or writes is
        # safe before the wait. Its dependents may then launch (they wait in turn).
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
else:
    pdl_enter = None
