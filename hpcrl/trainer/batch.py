"""The trainer's input: prompt + response sequences, right-padded, with targets shifted by one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class TrainBatch:
    input_ids: Tensor  # [N, T] long, right-padded with 0
    prompt_lens: Tensor  # [N] long
    lengths: Tensor  # [N] long, prompt + response
    loss_mask: Tensor  # [N, T-1] bool: target position t predicts input_ids[:, t+1]; True on response tokens
    advantages: Tensor  # [N] float32
    rollout_logprobs: Tensor  # [N, T-1] float32, the engine's log-probs on response positions, 0 elsewhere

    @classmethod
    def from_sequences(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        *,
        advantages: Sequence[float] | None = None,
        rollout_logprobs: Sequence[Sequence[float]] | None = None,
        response_masks: Sequence[Sequence[int] | None] | None = None,
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
        return cls(
            input_ids=ids,
            prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
            lengths=torch.tensor(lengths, dtype=torch.long),
            loss_mask=mask,
            advantages=adv,
            rollout_logprobs=lps,
        )

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: Tensor | slice) -> TrainBatch:
        """Rows `index`, trimmed to the longest selected sequence."""
        lengths = self.lengths[index]
        width = max(int(lengths.max().item()) if lengths.numel() else 2, 2)
        return TrainBatch(
            input_ids=self.input_ids[index, :width],
            prompt_lens=self.prompt_lens[index],
            lengths=lengths,
            loss_mask=self.loss_mask[index, : width - 1],
            advantages=self.advantages[index],
            rollout_logprobs=self.rollout_logprobs[index, : width - 1],
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum().item())
