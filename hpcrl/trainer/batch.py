"""The trainer's input: prompt + response sequences, right-padded, with targets shifted by one.

Sampling supports (top-k/top-p replay) ride along ragged: `support_sizes[i, t]` ids for target position t of
row i (0 off the response), their ids back to back in `support_ids` in row-major (row, position) order. That is
about top_k int32 per response token, never a [tokens x vocab] mask; `padded_supports` widens one micro-batch
to [b, T-1, K] (K its largest support) for the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from hpcrl.samples.support import TokenSupports


@dataclass
class TrainBatch:
    input_ids: Tensor  # [N, T] long, right-padded with 0
    prompt_lens: Tensor  # [N] long
    lengths: Tensor  # [N] long, prompt + response
    loss_mask: Tensor  # [N, T-1] bool: target position t predicts input_ids[:, t+1]; True on response tokens
    advantages: Tensor  # [N] float32 per sample, or [N, T-1] per target position (on-policy distillation)
    rollout_logprobs: Tensor  # [N, T-1] float32, the engine's log-probs on response positions, 0 elsewhere
    support_sizes: Tensor | None = None  # [N, T-1] int32: support size per target position (0 off the response)
    support_ids: Tensor | None = None  # [support_sizes.sum()] int32, row-major over (row, position)
    routed_experts: Tensor | None = None  # [N, T, layers, k] int32: the rollout's experts per token, -1 where unknown
    # Distillation with distill.top_k = K: the teacher's K most likely ids at each target position, their
    # log-probs, and the forward-KL weights coef * p_teacher (0 off the loss mask): hpcrl/trainer/distill.py.
    teacher_topk_ids: Tensor | None = None  # [N, T-1, K] long
    teacher_topk_logprobs: Tensor | None = None  # [N, T-1, K] float32
    teacher_topk_weights: Tensor | None = None  # [N, T-1, K] float32

    @classmethod
    def from_sequences(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        *,
        advantages: Sequence[float] | None = None,
        rollout_logprobs: Sequence[Sequence[float]] | None = None,
        supports: Sequence[TokenSupports] | None = None,
        response_masks: Sequence[Sequence[int] | None] | None = None,
        routed_experts: Sequence[np.ndarray | None] | None = None,
    ) -> TrainBatch:
        """`response_masks` (one per sequence, None for all-ones) keep the loss off response tokens the model did not
        sample: the tool results and template tokens between the turns of a multi-turn episode."""
        n = len(prompts)
        if len(responses) != n:
            raise ValueError(f"{n} prompts but {len(responses)} responses")
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        width = max(max(lengths), 2)
        ids = torch.zeros(n, width, dtype=torch.long)
        mask = torch.zeros(n, width - 1, dtype=torch.bool)
        lps = torch.zeros(n, width - 1, dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            if not p:
                raise ValueError(f"sequence {i} has an empty prompt")
            ids[i, : lengths[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
            response_mask = None if response_masks is None else response_masks[i]
            if response_mask is None:
                mask[i, len(p) - 1 : len(p) - 1 + len(r)] = True
            elif len(response_mask) != len(r):
                raise ValueError(f"sequence {i}: a response mask of {len(response_mask)} for {len(r)} tokens")
            else:
                mask[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(list(response_mask), dtype=torch.bool)
            if rollout_logprobs is not None:
                if len(rollout_logprobs[i]) != len(r):
                    raise ValueError(f"sequence {i}: {len(rollout_logprobs[i])} log-probs for {len(r)} tokens")
                lps[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
        adv = torch.tensor(list(advantages) if advantages is not None else [0.0] * n, dtype=torch.float32)
        sizes = support_ids = None
        if supports is not None:
            if len(supports) != n:
                raise ValueError(f"{n} sequences but {len(supports)} sampling supports")
            sizes = torch.zeros(n, width - 1, dtype=torch.int32)
            for i, (p, r, sup) in enumerate(zip(prompts, responses, supports, strict=True)):
                if sup.num_tokens != len(r):
                    raise ValueError(f"sequence {i}: {sup.num_tokens} sampling supports for {len(r)} tokens")
                sizes[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.from_numpy(sup.sizes()).to(torch.int32)
            support_ids = torch.cat([torch.from_numpy(sup.ids) for sup in supports]) if n else torch.zeros(0)
            support_ids = support_ids.to(torch.int32)
        routes = None if routed_experts is None else _padded_routes(routed_experts, lengths, width)
        return cls(
            input_ids=ids,
            prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
            lengths=torch.tensor(lengths, dtype=torch.long),
            loss_mask=mask,
            advantages=adv,
            rollout_logprobs=lps,
            support_sizes=sizes,
            support_ids=support_ids,
            routed_experts=routes,
        )

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: Tensor | slice) -> TrainBatch:
        """Rows `index`, trimmed to the longest selected sequence."""
        lengths = self.lengths[index]
        width = max(int(lengths.max().item()) if lengths.numel() else 2, 2)
        sizes = support_ids = None
        if self.support_sizes is not None and self.support_ids is not None:
            # Columns past `width` are beyond every selected sequence, so trimming them drops no ids.
            sizes = self.support_sizes[index, : width - 1]
            row_ends = self.support_sizes.sum(dim=1, dtype=torch.long).cumsum(0)
            row_starts = row_ends - self.support_sizes.sum(dim=1, dtype=torch.long)
            rows = torch.arange(len(self))[index]
            support_ids = torch.cat(
                [self.support_ids[int(row_starts[r]) : int(row_ends[r])] for r in rows.tolist()]
                or [self.support_ids[:0]]
            )
        return TrainBatch(
            input_ids=self.input_ids[index, :width],
            prompt_lens=self.prompt_lens[index],
            lengths=lengths,
            loss_mask=self.loss_mask[index, : width - 1],
            advantages=self.advantages[index] if self.advantages.dim() == 1 else self.advantages[index, : width - 1],
            rollout_logprobs=self.rollout_logprobs[index, : width - 1],
            support_sizes=sizes,
            support_ids=support_ids,
            routed_experts=None if self.routed_experts is None else self.routed_experts[index, :width],
            teacher_topk_ids=_rows(self.teacher_topk_ids, index, width - 1),
            teacher_topk_logprobs=_rows(self.teacher_topk_logprobs, index, width - 1),
            teacher_topk_weights=_rows(self.teacher_topk_weights, index, width - 1),
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items() if t is not None})

    def tensors(self) -> dict[str, Tensor | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def padded_supports(self) -> tuple[Tensor, Tensor] | None:
        """This batch's supports as ``(ids [N, T-1, K] long, valid [N, T-1, K] bool)``, K the largest support.

        Padding slots hold id 0 and valid False; a position without a support (prompt, padding) has no valid
        slot. None when the batch carries no supports. Meant for one micro-batch: K is at most top_k.
        """
        if self.support_sizes is None or self.support_ids is None:
            return None
        sizes = self.support_sizes.long()
        k = max(int(sizes.max().item()) if sizes.numel() else 0, 1)
        valid = torch.arange(k, device=sizes.device) < sizes[..., None]
        ids = torch.zeros(valid.shape, dtype=torch.long, device=sizes.device)
        ids[valid] = self.support_ids.long()  # boolean indexing walks (row, position, slot) row-major
        return ids, valid

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def _rows(t: Tensor | None, index: Tensor | slice, width: int) -> Tensor | None:
    return None if t is None else t[index, :width]


def _padded_routes(routes: Sequence[np.ndarray | None], lengths: Sequence[int], width: int) -> Tensor:
    """[N, width, layers, k] int32 of each sequence's routes (one row per token but the last), -1 elsewhere."""
    shapes = {r.shape[1:] for r in routes if r is not None}
    if len(shapes) != 1:
        raise ValueError(f"the samples' routed experts have {len(shapes)} different [layers, top-k] shapes: {shapes}")
    (shape,) = shapes
    out = torch.full((len(routes), width, *shape), -1, dtype=torch.int32)
    for i, (r, n) in enumerate(zip(routes, lengths, strict=True)):
        if r is None:
            continue
        if r.shape[0] != n - 1:
            raise ValueError(
                f"sequence {i}: routed experts for {r.shape[0]} tokens, but it has {n} tokens (routes cover all but "
                "the last)"
            )
        out[i, : n - 1] = torch.from_numpy(np.array(r, dtype=np.int32))  # a copy: decoded routes are read-only
    return out
