"""The Megatron backend's half of the trainer step (hpcrl/trainer/step.py): micro-batches through the pipeline.

Pipeline stages run a GPipe schedule (all micro-batches forward, then all backward) with plain send/recv of the
[s, b, h] activations, which works on gloo and nccl alike; Megatron's own schedules allocate their buffers on
CUDA. The last stage scores log-probs vocab-parallel: each TP rank holds a slice of the vocabulary's logits, and
the log-softmax normalizer, the target's logit and the entropy are all-reduced across TP. With
train.logprob_chunk_tokens it stops at the final norm and the LM head and log-softmax run fused over token chunks
(`vocab_parallel_hidden_logprobs`), so the logits never exist in full. Gradients are summed over data-parallel
replicas (Megatron's DDP is told `calculate_per_token_loss`; the local optimizer all-reduces a sum). A
mixture-of-experts model adds its load-balancing loss and routes by the rollout's routes (hpcrl.trainer.moe_routing);
under expert parallelism each forward is padded to its expert-parallel group's shape (moe.ExpertBatch).
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from hpcrl.model.qwen3 import ModelArgs
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.megatron.layout import Shard
from hpcrl.trainer.megatron.logprobs import (
    vocab_parallel_hidden_logprobs,
    vocab_parallel_logprobs,
    vocab_parallel_support_logprobs,
)
from hpcrl.trainer.megatron.model import output_weight
from hpcrl.trainer.megatron.moe import ExpertBatch
from hpcrl.trainer.moe_routing import MoeRouting
from hpcrl.trainer.step import MicroLoss


class Pipeline:
    """This rank's stage of the policy (and of the reference copy) as the step's backend (`StepBackend`)."""

    averages_gradients = False

    def __init__(
        self, cfg: TrainConfig, args: ModelArgs, shard: Shard, *, model: Any, ref_model: torch.nn.Module | None,
        dtype: torch.dtype, device: torch.device, moe: MoeRouting | None = None,
    ) -> None:  # fmt: skip
        from megatron.core import parallel_state as ps

        self.cfg, self.args, self.shard = cfg, args, shard
        self.moe = moe
        self.expert_batch = ExpertBatch(ps.get_expert_model_parallel_group(), shard.ep_size)
        self.model, self.ref_model = model, ref_model
        self.dtype, self.device = dtype, device
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.computes_loss = shard.last_stage

    def all_reduce(self, values: Tensor, op: str) -> Tensor:
        if self.dp_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.dp_group)
        return values

    def share(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's metrics on every stage (rank 0, on the first, logs them)."""
        if self.shard.pp_size == 1:
            return metrics
        return self._broadcast_json(metrics, src_stage=self.shard.pp_size - 1)

    def _forward(self, model: Any, ids: Tensor, hidden_in: Tensor | None, hidden_only: bool) -> Tensor:
        """Hidden states [s, b, h] out of a middle stage, or logits [b, s, V/tp] out of the last (its final
        norm's output [s, b, h] with `hidden_only`)."""
        if hidden_in is not None:
            model.set_input_tensor(hidden_in)
        routing = getattr(model, "routing", None)
        padded, (b, t), replay = self.expert_batch.pad(ids, routing)
        positions = torch.arange(padded.shape[1], device=ids.device).expand_as(padded)
        out = model(padded, positions, None, hidden_only=hidden_only)
        if padded.shape == ids.shape:
            return out
        assert routing is not None
        ExpertBatch.trim(routing, (b, t), (padded.shape[0], padded.shape[1]), replay)
        return out[:t, :b] if hidden_only else out[:b, :t]

    def _fused_head(self, supports: tuple[Tensor, Tensor] | None) -> bool:
        """Whether the last stage hands the fused head its hidden states: train.logprob_chunk_tokens is set and
        the micro-batch has no sampling supports (replay scores each token's support from the logits, as the
        torch backend does; the run config refuses that pair, TrainConfig alone does not see the rollout)."""
        return self.cfg.logprob_chunk_tokens is not None and supports is None

    def _logprobs(
        self, model: Any, out: Tensor, ids: Tensor, supports: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy [b, T-1] from the last stage's output: logits [b, T, V/tp], or the hidden
        states [T, b, h] where `_fused_head`."""
        if self._fused_head(supports):
            return self._hidden_logprobs(model, out, ids)
        logits, width = out, out.shape[-1]
        if supports is not None:  # top-k/top-p: score over the ids each token was drawn from
            return vocab_parallel_support_logprobs(
                logits[:, :-1], ids[:, 1:], *supports, vocab_start=self.shard.tp_rank * width, group=self.tp_group
            )
        return vocab_parallel_logprobs(
            logits[:, :-1], ids[:, 1:], vocab_start=self.shard.tp_rank * width, vocab_size=self.args.vocab_size,
            group=self.tp_group,
        )  # fmt: skip

    def _hidden_logprobs(self, model: Any, hidden: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        chunk = self.cfg.chunk_tokens
        assert chunk is not None
        s, b, h = hidden.shape
        # Rows in the hidden states' own [s, b] order: hidden[:-1] flattens without a copy, the ids are tiny.
        weight = output_weight(model)
        lp, ent = vocab_parallel_hidden_logprobs(
            hidden[:-1].reshape((s - 1) * b, h), weight, ids[:, 1:].t().reshape(-1),
            vocab_start=self.shard.tp_rank * weight.shape[0], vocab_size=self.args.vocab_size, group=self.tp_group,
            chunk_tokens=chunk, compiled=self.cfg.compiled,
        )  # fmt: skip
        return lp.view(s - 1, b).t(), ent.view(s - 1, b).t()

    def score(self, mb: TrainBatch, *, reference: bool) -> Tensor | None:
        """Log-probs without grad, run through the pipeline like a training forward; None before the last stage."""
        model = self.ref_model if reference else self.model
        assert model is not None, "reference log-probs need train.kl_coef > 0"
        supports = mb.padded_supports()
        if self.moe is not None:
            self.moe.before(cast(Any, model), mb)
        with torch.no_grad():
            out = self._stage_forward(model, mb, keep_graph=False, hidden_only=self._fused_head(supports))[1]
            if not self.shard.last_stage:
                return None
            return self._logprobs(model, out, mb.input_ids, supports)[0]

    def _stage_forward(
        self, model: torch.nn.Module, mb: TrainBatch, *, keep_graph: bool, hidden_only: bool
    ) -> tuple[Tensor | None, Tensor]:
        """Receive the previous stage's activations (if any), run this stage, send to the next."""
        hidden_in = None
        if not self.shard.first_stage:
            s, b = mb.input_ids.shape[1], mb.input_ids.shape[0]
            hidden_in = torch.empty(s, b, self.args.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(hidden_in, src=self._pp_peer(-1))
            hidden_in.requires_grad_(keep_graph)
        out = self._forward(model, mb.input_ids, hidden_in, hidden_only)
        if not self.shard.last_stage:
            dist.send(out.detach().contiguous(), dst=self._pp_peer(+1))
        return hidden_in, out

    def _pp_peer(self, delta: int) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_next_rank() if delta > 0 else ps.get_pipeline_model_parallel_prev_rank()

    def update(self, optimizer: Any, mbs: list[TrainBatch], loss: MicroLoss) -> tuple[float, float]:
        """A GPipe schedule: every micro-batch forward (the last stage computes its loss), then every backward."""
        optimizer.zero_grad(set_to_none=True)
        forward_s = 0.0
        pending: list[tuple[Tensor | None, Tensor]] = []
        for i, mb in enumerate(mbs):
            t0 = time.perf_counter()
            supports = mb.padded_supports()
            if self.moe is not None:
                self.moe.before(self.model, mb)
            hidden_in, out = self._stage_forward(self.model, mb, keep_graph=True,
                                                 hidden_only=self._fused_head(supports))  # fmt: skip
            if self.shard.last_stage:
                out = loss(i, *self._logprobs(self.model, out, mb.input_ids, supports))
                aux = self.moe.after(self.model, mb) if self.moe is not None else None
                if aux is not None:  # an MoE model is one stage (layout.check_parallel_sizes)
                    # The load-balancing term once per optimizer step, the replicas' mean as the torch backend's
                    # DDP averages it (gradients here are summed over DP).
                    out = out + aux / (len(mbs) * self.dp_size)
            forward_s += time.perf_counter() - t0
            pending.append((hidden_in, out))
        for hidden_in, out in reversed(pending):
            if self.shard.last_stage:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=self._pp_peer(+1))
                out.backward(grad)
            if hidden_in is not None:
                assert hidden_in.grad is not None
                dist.send(hidden_in.grad.contiguous(), dst=self._pp_peer(-1))
        optimizer.finish_grads()
        return optimizer.clip_grads(self.cfg.grad_clip), forward_s

    def _broadcast_json(self, value: dict[str, float], *, src_stage: int) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        src = dist.get_global_rank(self.pp_group, src_stage)
        data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=self.device)
        size = torch.tensor([data.numel()], dtype=torch.long, device=self.device)
        dist.broadcast(size, src=src, group=self.pp_group)
        buf = data if ps.get_pipeline_model_parallel_rank() == src_stage else torch.empty(
            int(size.item()), dtype=torch.uint8, device=self.device)  # fmt: skip
        dist.broadcast(buf, src=src, group=self.pp_group)
        return json.loads(bytes(buf.cpu().tolist()).decode())
