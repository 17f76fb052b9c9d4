"""Sliding-window models served by the embedded engine on CUDA (fused kernels, CUDA graphs): what it generates is
scored as transformers scores it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_engine_windows import CONFIGS, engine_vs_transformers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("mode", ["graph", "triton", "eager", "invariant"])
def test_cuda_engine_logprobs_equal_transformers_past_the_window(config: str, mode: str, tmp_path: Path) -> None:
    kind, overrides = CONFIGS[config]
    flags = ("--batch-invariant",) if mode == "invariant" else ("--decode-mode", mode)
    gap, log = engine_vs_transformers(kind, overrides, tmp_path, "--device", "cuda", *flags)
    print(f"{config} {mode}: max |engine - transformers| log-prob = {gap:.2e}")
    assert "from now on" not in log, log  # the fused kernels and graphs ran: no fallback to a slower path
    assert gap <= 1e-4, f"{config} ({mode}): the CUDA engine's log-probs differ from transformers' by {gap}"
