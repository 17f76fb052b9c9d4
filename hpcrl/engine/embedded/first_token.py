"""The first token of freshly prefilled rows, sampled from the prefill's logits at each row's last prompt position
(synchronous; the slots' device state is not touched: the rows join the decode batch afterwards)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hpcrl.engine.embedded.kernels import sampler
from hpcrl.engine.embedded.sampling import RowParams
from hpcrl.engine.embedded.sampling import sample as torch_sample
from hpcrl.engine.embedded.step_output import RowState, StepOutput, host_output
from hpcrl.model import invariant


def sample(
    logits: torch.Tensor, rows: Sequence[RowState], device: torch.device, *, invariant_rows: bool, fast: bool,
    want_support: bool,
) -> StepOutput:  # fmt: skip
    """The rows' first tokens and log-probs: with the fused sampler when `fast` (plain temperature sampling on
    CUDA), else with `sampling.sample`; `invariant_rows`: the logits are the batch-invariant engine's, which samples
    from the log-prob row itself and reports its entries."""
    n = len(rows)
    dev = device
    temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=dev)
    seeds = torch.tensor([r.seed for r in rows], dtype=torch.int64, device=dev)
    steps = torch.tensor([r.step for r in rows], dtype=torch.int64, device=dev)
    # The invariant engine samples from the log-prob row itself and reports its entries.
    lp = invariant.logprob_rows(logits) if invariant_rows else None
    if not fast or lp is not None:
        params = RowParams(
            temperature=temperature,
            top_k=torch.tensor([r.top_k for r in rows], dtype=torch.int64, device=dev),
            top_p=torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev),
            min_p=torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=dev),
            seeds=seeds,
            steps=steps,
        )
        unit = all(r.temperature == 1.0 and not r.filtered for r in rows)
        return host_output(
            torch_sample(
                lp if lp is not None else logits,
                params,
                want_support=want_support,
                unit_temperature=unit,
                logprobs=lp,
            )
        )
    tok = torch.empty(n, dtype=torch.int64, device=dev)
    lp = torch.empty(n, 2, dtype=torch.float32, device=dev)
    sampler.sample_rows(logits, temperature, seeds, steps, tok, lp)
    lps = lp.tolist()
    return StepOutput(
        tokens=tok.tolist(),
        logprobs=[x[0] for x in lps],
        scaled_logprobs=[x[1] for x in lps],
        support_logprobs=None,
        support_mask=None,
    )
