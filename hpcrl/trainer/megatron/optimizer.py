"""The Megatron trainer's two optimizers, behind one interface.

- `LocalOptimizer`: torch AdamW over this rank's shards; gradients are all-reduced over DP by hand (an
  expert's over the ranks that hold that expert, Megatron's expert-data-parallel group), q/k-norm gradients
  summed over TP, tied-embedding gradients over the first and last stages. Runs on CPU (gloo) and GPU. Every
  DP replica keeps the full Adam state of its shards.
- `DistributedOptimizer`: Megatron's DDP (gradients in one fp32 buffer, reduce-scattered over DP)
  and distributed optimizer (fp32 master weights and Adam state split over DP, ZeRO-1), with
  Megatron's own `finalize_model_grads` for the TP/PP reductions. CUDA only: both allocate their
  buffers on the GPU.

Both expose the state of a (TP/PP-sharded) parameter as whole tensors of that shard's shape, so the
trainer writes checkpoints in HF layout whichever optimizer ran, and either can resume them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.megatron.layout import Shard, is_expert, is_tp_split

MOMENTS = ("exp_avg", "exp_avg_sq")


class LocalOptimizer:
    kind = "local"

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, lr: float, *, shard: Shard, device: torch.device,
                 shared_embedding: Tensor | None) -> None:  # fmt: skip
        from megatron.core import parallel_state as ps

        self.model, self.cfg, self.shard, self.device = model, cfg, shard, device
        self.shared_embedding = shared_embedding
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.expert_dp_group = ps.get_expert_data_parallel_group()
        self.experts = {p for name, p in model.named_parameters() if is_expert(name)}
        self.torch_opt = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )  # fmt: skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.torch_opt.zero_grad(set_to_none=set_to_none)

    def finish_grads(self) -> None:
        from megatron.core import parallel_state as ps

        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.dp_size > 1:
            for p in params:
                # An expert lives on the ranks of its expert-data-parallel group only; its gradient from the other
                # EP ranks' tokens came back through the token dispatcher's backward already.
                group = self.expert_dp_group if p in self.experts else self.dp_group
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(p.grad, group=group)
        if self.shard.tp_size > 1:
            # q/k norms are shared by all heads but each TP rank sees only its own heads' gradient.
            for name, p in self.model.named_parameters():
                if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(p.grad, group=self.tp_group)
        shared = self.shared_embedding
        if self.shard.pp_size > 1 and shared is not None and shared.grad is not None:
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())

    def clip_grads(self, clip: float) -> float:
        """Global grad norm over all shards (TP-split weights summed over TP, replicated ones once); clips."""
        split = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        experts = torch.zeros((), dtype=torch.float64, device=self.device)
        duplicate = self.shared_embedding if self.shard.pp_size > 1 and not self.shard.first_stage else None
        for name, p in self.model.named_parameters():
            if p.grad is None or p is duplicate:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if p in self.experts:
                experts += sq
            elif is_tp_split(name):
                split += sq
            else:
                replicated += sq
        if self.shard.tp_size > 1:
            dist.all_reduce(split, group=self.tp_group)
        if self.shard.ep_size > 1:  # each EP rank holds other experts
            dist.all_reduce(experts, group=self.ep_group)
        total = split + replicated + experts
        if self.shard.pp_size > 1:
            dist.all_reduce(total, group=self.pp_group)
        norm = float(total.sqrt().item())
        if clip and math.isfinite(norm):
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return norm

    def step(self) -> None:
        self.torch_opt.step()

    def adam_step(self) -> int:
        steps = {int(s["step"]) for s in self.torch_opt.state.values() if "step" in s}
        return max(steps) if steps else 0

    def param_state(self, param: Tensor) -> dict[str, Tensor]:
        """Adam moments of one model parameter (zeros before the first step); no master copy here."""
        st = self.torch_opt.state.get(param, {})
        return {m: st[m] if m in st else torch.zeros_like(param) for m in MOMENTS}

    def load_param_states(self, states: Mapping[Tensor, dict[str, Tensor]], step: int) -> None:
        """`states[param]` holds the moments (and maybe a `main` master copy, unused here)."""
        self.torch_opt.state.clear()
        if step > 0:
            for p, st in states.items():
                self.torch_opt.state[p] = {
                    "step": torch.tensor(float(step)),
                    **{m: st[m].to(p.dtype).clone() for m in MOMENTS},
                }


class DistributedOptimizer:
    kind = "distributed"

    def __init__(self, ddp: Any, cfg: TrainConfig, lr: float, *, dtype: torch.dtype) -> None:  # Megatron DDP
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.ddp = ddp
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.grad_clip,
            bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=True,
        )  # fmt: skip
        self.opt = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False)
        self.parts = list(getattr(self.opt, "chained_optimizers", [self.opt]))

    @staticmethod
    def wrap(model: Any) -> Any:
        """Megatron's DDP around the GPTModel: gradients land in one fp32 buffer per dtype, summed
        (not averaged) over DP, since hpcrl's losses are already scaled by the global token count."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model.config.calculate_per_token_loss = True
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
            use_distributed_optimizer=True, check_for_nan_in_grad=False,
        )  # fmt: skip
        return DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad(set_to_none=set_to_none)

    def finish_grads(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        # DP reduce-scatter, q/k-norm grads over TP, tied embeddings over the first and last stages.
        finalize_model_grads([self.ddp])

    def clip_grads(self, clip: float) -> float:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self.opt.prepare_grads()  # buffer shards -> fp32 master grads (no loss scaler in bf16/fp32)
        norm = float(self.opt.get_grad_norm())
        if clip and math.isfinite(norm):
            clip_grad_by_total_norm_fp32(self.opt.get_parameters(), clip, norm)
        return norm

    def step(self) -> None:
        # Updates the fp32 master shards, copies them into the model params and all-gathers over DP.
        self.opt.step_with_ready_grads()

    def _owner(self, param: Tensor) -> Any | None:
        """The chained part whose shard holds some of `param` on this DP rank (None: other ranks own it)."""
        for part in self.parts:
            if param in part.model_param_group_index_map:
                return part
        return None

    def adam_step(self) -> int:
        steps = {int(s["step"]) for part in self.parts for s in part.optimizer.state.values() if "step" in s}
        for part in self.parts:
            steps |= {int(g["step"]) for g in part.optimizer.param_groups if "step" in g}
        return max(steps) if steps else 0

    def param_state(self, param: Tensor) -> dict[str, Tensor]:
        """The master copy (`main`, fp32) and Adam moments of one model parameter, whole: each DP rank
        fills the range it owns and an all-reduce over DP joins the ranges (they do not overlap)."""
        part = self._owner(param)
        keys = ("main", *MOMENTS)
        full = torch.zeros(len(keys), param.numel(), dtype=torch.float32, device=param.device)
        if part is not None:
            rng = part._get_model_param_range_map(param)["param"]
            st = part._get_main_param_and_optimizer_states(param)
            st["main"] = st.pop("param")
            for i, k in enumerate(keys):
                if k in st:
                    full[i, rng.start : rng.end] = st[k].detach().float().view(-1)
        dist.all_reduce(full, group=(part or self.parts[0]).data_parallel_group)
        return {k: full[i].view(param.shape) for i, k in enumerate(keys)}

    def load_param_states(self, states: Mapping[Tensor, dict[str, Tensor]], step: int) -> None:
        """Master shards from `main` (else from the model param), moments and the Adam step count."""
        # This rank's ranges first: the dummy step below may decay an fp32 model param in place.
        ranges: list[tuple[Any, Tensor, dict[str, Tensor]]] = []
        for param, st in states.items():
            part = self._owner(param)
            if part is None:
                continue
            rng = part._get_model_param_range_map(param)["param"]
            main = st.get("main", param.detach())
            values = {"param": main.float().reshape(-1)[rng.start : rng.end].clone()}
            if step > 0:
                values |= {m: st[m].float().reshape(-1)[rng.start : rng.end] for m in MOMENTS}
                values["step"] = torch.tensor(float(step))
            ranges.append((part, param, values))
        for part in self.parts:
            part.optimizer.state.clear()
            if step > 0:
                # Creates every state tensor the way this Adam implementation lays them out; the
                # values are overwritten below.
                part._init_optimizer_states_with_dummy_values()
        with torch.no_grad():
            for part, param, values in ranges:
                for key, tensor in part._get_main_param_and_optimizer_states(param).items():
                    if key in values:
                        tensor.copy_(values[key].to(tensor.device, tensor.dtype))
        for part in self.parts:
            for group in part.optimizer.param_groups:
                if "step" in group:  # fused Adams keep the count per group
                    group["step"] = step

    def restart(self, *, lr: float) -> None:
        """Forget the Adam state (the masters stay) and go on at `lr`: the switch between the SFT warm
        start and GRPO, which the local backend makes with two optimizers."""
        for part in self.parts:
            part.optimizer.state.clear()
            for group in part.optimizer.param_groups:
                group["lr"] = lr
                if "step" in group:
                    group["step"] = 0
