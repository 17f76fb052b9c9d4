"""What the Triton kernel tests share: where they run (CUDA, or the CPU under TRITON_INTERPRET=1) and the dtypes.

Triton 3.6's interpreter needs numpy < 2.4: with numpy 2.4 it fails on loops whose bound is computed inside the kernel
(`int()` of a one-element array), in most of these tests. `pip install --target DIR "numpy<2.4"` and
`PYTHONPATH=DIR` beside the project's environment is enough.
"""

from __future__ import annotations

import os

import pytest
import torch

from hpcrl.model.invariant_kernels import AVAILABLE

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not AVAILABLE or not (torch.cuda.is_available() or INTERPRET),
    reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] if DEVICE.type == "cpu" else [torch.float32, torch.bfloat16]
"""The interpreter runs fp32 only."""
