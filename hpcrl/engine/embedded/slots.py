"""Each running sequence's decode state, in device buffers indexed by its cache slot b (0..n-1): its next input
token, position, sampling seed, token index and sampling parameters, and the step's outputs. A decode step reads
and advances them in place; the scheduler rewrites them only when the set of running sequences changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hpcrl.engine.embedded.sampling import RowParams
from hpcrl.engine.embedded.step_output import RowState


class DecodeSlots:
    def __init__(self, max_batch: int, device: torch.device) -> None:
        self.max_batch = max_batch
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
        self.unit_temperature = False  # every row samples at temperature 1 without filters

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
        self.unit_temperature = all(r.temperature == 1.0 and not r.filtered for r in rows)

    def params(self, n: int) -> RowParams:
        return RowParams(
            temperature=self.temperature[:n],
            top_k=self.top_k[:n],
            top_p=self.top_p[:n],
            min_p=self.min_p[:n],
            seeds=self.seeds[:n],
            steps=self.steps[:n],
        )

    def advance(self, n: int, tokens: torch.Tensor) -> None:
        """Slots 0..n-1 move on by one sampled token each."""
        self.tokens[:n].copy_(tokens)
        self.positions[:n] += 1
        self.steps[:n] += 1
