"""Fixtures the GPU tests share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def no_tf32() -> None:
    """fp32 matmuls in full fp32 (TF32 rounds them to 10 mantissa bits), for steps compared at fp32 rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
