"""The Megatron-core trainer: GRPO and SFT steps on a GPTModel split by tensor and pipeline parallelism.

Ranks are laid out the way Megatron does (TP fastest, then DP, then PP), so global rank 0, which runs
the driver, is TP rank 0 of pipeline stage 0 and data-parallel replica 0. Data-parallel replica d
trains on rows d, d+DP, ... of a step's batch; every rank of a replica sees the same rows.

The step (mini-batches, epochs, old log-probs, losses, the NaN guard) is the torch backend's,
hpcrl/trainer/step.py; pipeline.py gives it this backend's mechanics: a GPipe schedule over the stages and
vocab-parallel log-probs. With train.torch_compile every TransformerLayer of the policy (not the reference
copy) is compiled. Optimizer (`train.megatron_optimizer`, see optimizer.py): on CUDA,
Megatron's DDP and distributed optimizer (fp32 master weights, Adam state split over DP); on CPU, torch
AdamW over this rank's shards with gradients all-reduced over DP by hand. AdamW is element-wise, so
sharding does not change its result.

Weights leave in Hugging Face names and shapes (TP shards gathered, QKV and gate/up split, vocab
padding dropped) for the weight push, the export and the checkpoint. A checkpoint therefore holds
the full model and Adam moments in HF layout and resumes under any TP/PP split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from hpcrl.model.hf import iter_safetensors, parse_dtype, save_state_dict
from hpcrl.model.qwen3 import CausalLM, ModelArgs
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.megatron.layout import Shard, check_parallel_sizes, hf_names, to_hf, to_megatron
from hpcrl.trainer.megatron.model import build_gpt_model, compile_layers, init_parallel_state
from hpcrl.trainer.megatron.moe import gloo_expert_collectives
from hpcrl.trainer.megatron.optimizer import MOMENTS, DistributedOptimizer, LocalOptimizer
from hpcrl.trainer.megatron.pipeline import Pipeline
from hpcrl.trainer.moe_routing import MoeRouting
from hpcrl.trainer.step import TrainStep
from hpcrl.trainer.step_stats import NanGuard

Optimizer = LocalOptimizer | DistributedOptimizer


class MegatronTrainer:
    """Same calls as TorchTrainer; the weight calls, `state` and `export` are collective over all ranks."""

    collective = True

    def __init__(
        self, cfg: TrainConfig, model_dir: str | Path, *, rank: int = 0, world_size: int = 1, sft_lr: float = 1e-3
    ) -> None:
        from megatron.core import parallel_state as ps

        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.rank, self.world_size = rank, world_size
        self.args = ModelArgs.from_dir(model_dir)
        tp, pp, ep = cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.expert_parallel_size
        check_parallel_sizes(self.args, tp, pp, ep)
        if world_size % (tp * pp):
            raise ValueError(f"train.num_ranks ({world_size}) must be a multiple of TP x PP ({tp} x {pp})")
        if (world_size // (tp * pp)) % ep:
            raise ValueError(
                f"train.expert_parallel_size ({ep}) must divide the data-parallel size num_ranks / (TP x PP) "
                f"({world_size // (tp * pp)}): Megatron places each expert-parallel group inside the data-parallel "
                "ranks"
            )
        torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():  # one rank: Megatron still wants its process groups
            dist.init_process_group("gloo" if self.device.type == "cpu" else "nccl", store=dist.HashStore(),
                                    rank=0, world_size=1)  # fmt: skip
        init_parallel_state(tp, pp, ep)
        if ep > 1 and self.device.type == "cpu":
            gloo_expert_collectives()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.shard = Shard(
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
            pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp,
            ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep, num_layers=self.args.num_layers,
        )  # fmt: skip
        self.dtype = parse_dtype(cfg.dtype)
        hf = dict(iter_safetensors(self.model_dir))
        self.model: Any = self._build(hf)  # a megatron GPTModel (untyped), maybe inside Megatron's DDP
        self.model.train()
        if cfg.torch_compile:
            # The policy's layers only: the reference copy runs once per micro-batch without grad, as in the
            # torch backend; compiling happens lazily, on the first step.
            compile_layers(self.model)
        self.ref_model: torch.nn.Module | None = None
        if cfg.kl_coef > 0:
            self.ref_model = self._build(hf).eval().requires_grad_(False)
            if self.args.moe is not None:  # routes as the policy's forwards do (MoeRouting sets those)
                cast(Any, self.ref_model).routing.force = cfg.routing_replay == "rollout"
        kind = cfg.megatron_optimizer
        if kind == "auto":
            kind = "distributed" if self.device.type == "cuda" else "local"
        self.ddp: torch.nn.Module | None = None
        if kind == "distributed":
            self.ddp = DistributedOptimizer.wrap(self.model)  # moves the params into its buffer, values kept
        self.optimizer: Optimizer = self._make_optimizer(cfg.lr)
        self.sft_lr = sft_lr
        self._sft_optimizer: Optimizer | None = None
        self._last_mode = "grpo"
        self.nan_guard = NanGuard(cfg.max_nan_steps)
        self.moe = MoeRouting(cast(Any, self.model), self.args.moe, cfg.routing_replay)
        self.pipeline = Pipeline(cfg, self.args, self.shard, model=self.model, ref_model=self.ref_model,
                                 dtype=self.dtype, device=self.device, moe=self.moe)  # fmt: skip
        self.step = TrainStep(self.pipeline, cfg, self.nan_guard)

    def _build(self, hf: dict[str, Tensor]) -> torch.nn.Module:
        model = build_gpt_model(
            self.args, tp_size=self.shard.tp_size, pp_size=self.shard.pp_size, pp_rank=self.shard.pp_rank,
            dtype=self.dtype, device=self.device, ep_size=self.shard.ep_size,
        )  # fmt: skip
        self._load_params(model, to_megatron(lambda n: hf[n], self.args, self.shard))
        return model

    def _load_params(self, model: torch.nn.Module, state: dict[str, Tensor]) -> None:
        params = dict(model.named_parameters())
        if set(params) != set(state):
            raise RuntimeError(
                f"Megatron layout mismatch: model has {sorted(set(params) - set(state))[:3]}..., "
                f"converted weights have {sorted(set(state) - set(params))[:3]}..."
            )
        with torch.no_grad():
            for name, p in params.items():
                if tuple(p.shape) != tuple(state[name].shape):
                    raise RuntimeError(f"{name}: shape {tuple(state[name].shape)} does not fit {tuple(p.shape)}")
                p.copy_(state[name])

    def _make_optimizer(self, lr: float) -> Optimizer:
        if self.ddp is not None:
            return DistributedOptimizer(self.ddp, self.cfg, lr, dtype=self.dtype)
        return LocalOptimizer(self.model, self.cfg, lr, shard=self.shard, device=self.device,
                              shared_embedding=self._shared_embedding())  # fmt: skip

    @property
    def optimizer_kind(self) -> str:
        return self.optimizer.kind

    # ----- steps (the algorithm: hpcrl/trainer/step.py, the mechanics: pipeline.py) -----
    def train_grpo(self, batch: TrainBatch) -> dict[str, float]:
        return self.step.grpo(batch, self._optimizer_for("grpo")) | self.moe.metrics()

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        return self.step.sft(batch, self._optimizer_for("sft"))

    def _optimizer_for(self, mode: str) -> Optimizer:
        """GRPO and the SFT warm start each have their own Adam state and learning rate."""
        switched, self._last_mode = mode != self._last_mode, mode
        if isinstance(self.optimizer, DistributedOptimizer):
            # One distributed optimizer serves both (a second one over the same DDP buffers would keep
            # master weights of its own): a switch starts Adam afresh at the mode's learning rate, as
            # the local optimizers do when each first steps.
            if switched:
                self.optimizer.restart(lr=self.sft_lr if mode == "sft" else self.cfg.lr)
            return self.optimizer
        if mode == "grpo":
            return self.optimizer
        if self._sft_optimizer is None:
            self._sft_optimizer = self._make_optimizer(self.sft_lr)
        return self._sft_optimizer

    def _shared_embedding(self) -> Tensor | None:
        """This stage's copy of the tied embedding (None when untied: the LM head is a weight of its own)."""
        if not self.args.tie_word_embeddings:
            return None
        if self.shard.first_stage:
            return self.model.embedding.word_embeddings.weight
        if self.shard.last_stage:
            return self.model.output_layer.weight
        return None

    # ----- weights and state, in Hugging Face layout -----
    @staticmethod
    def _gather(t: Tensor, size: int, group: Any) -> list[Tensor]:
        """`t` from every rank of `group` (`size` ranks), in rank order: TP shards, or EP ranks' local experts."""
        if size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(out, t.contiguous(), group=group)
        return out

    def _collect(self, lookup: Callable[[str], Tensor]) -> list[tuple[str, Tensor]]:
        # A later stage gathers its TP shards before it sends them to rank 0.
        self._stage_cache = list(to_hf(
            lambda n: self._gather(lookup(n).detach(), self.shard.tp_size, self.tp_group), self.args, self.shard,
            ep_shards=lambda n: self._gather(lookup(n).detach(), self.shard.ep_size, self.ep_group),
        ))  # fmt: skip
        if self.shard.pp_size == 1:
            return self._stage_cache if self.rank == 0 else []
        out = list(self._hf_tensors_from_cache())
        self._stage_cache = []
        return out

    def _hf_tensors_from_cache(self) -> Iterator[tuple[str, Tensor]]:
        from megatron.core import parallel_state as ps

        if self.rank == 0:
            yield from self._stage_cache
        shapes = {k: v.shape for k, v in _meta_model(self.args).state_dict().items()}
        sender = self.shard.tp_rank == 0 and self.dp_rank == 0
        for stage in range(1, self.shard.pp_size):
            s = Shard(pp_rank=stage, pp_size=self.shard.pp_size, num_layers=self.args.num_layers)
            names = hf_names(self.args, s.layers, first=False, last=s.last_stage)
            if self.rank == 0:
                src = dist.get_global_rank(self.pp_group, stage)
                for name in names:
                    # fp32 on the wire: the norms stay fp32 in a bf16 model, and bf16 -> fp32 is exact.
                    buf = torch.empty(shapes[name], dtype=torch.float32, device=self.device)
                    dist.recv(buf, src=src)
                    yield name, buf
            elif sender and ps.get_pipeline_model_parallel_rank() == stage:
                mine = dict(self._stage_cache)
                for name in names:
                    dist.send(mine[name].float().contiguous(), dst=0)

    def push_weights(self, *, full: bool = False) -> list[tuple[str, Tensor]]:
        """A push sends every weight (this backend has no model converters); every rank must call it."""
        return self.export_weights()

    def export_weights(self) -> list[tuple[str, Tensor]]:
        """The policy in HF names and shapes on rank 0 ([] elsewhere); every rank must call it."""
        params = dict(self.model.named_parameters())
        # Megatron keeps norm weights in fp32 under bf16; the engines load the model's dtype, and mixed
        # dtypes would also cut the push into one bucket per dtype run (~170 for 0.6B instead of 3).
        return [(k, v.to(self.dtype)) for k, v in self._collect(lambda n: params[n])]

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Weights and Adam moments in HF layout (any TP/PP split can resume them); every rank calls it."""
        params = dict(self.model.named_parameters())
        tensors = {f"model/{k}": v.to("cpu", copy=True) for k, v in self._collect(lambda n: params[n])}
        self._assert_grpo_optimizer()
        keys = list(MOMENTS) + (["main"] if isinstance(self.optimizer, DistributedOptimizer) else [])
        for key in keys:
            # One parameter's state at a time: the distributed optimizer joins it over DP on request.
            def lookup(n: str, key: str = key) -> Tensor:
                return self.optimizer.param_state(params[n])[key]

            prefix = "optimizer/main_params/" if key == "main" else f"optimizer/{key}/"
            tensors.update({f"{prefix}{k}": v.to("cpu", copy=True) for k, v in self._collect(lookup)})
        if self.ref_model is not None:
            ref = dict(self.ref_model.named_parameters())
            tensors.update({f"ref_model/{k}": v.to("cpu", copy=True) for k, v in self._collect(lambda n: ref[n])})
        state = {
            "backend": "megatron",
            "megatron_optimizer": self.optimizer.kind,
            "adam_step": self.optimizer.adam_step(),
            "num_nan_in_a_row": self.nan_guard.in_a_row,
        }
        return tensors, state

    def _assert_grpo_optimizer(self) -> None:
        if isinstance(self.optimizer, DistributedOptimizer) and self._last_mode != "grpo":
            # Checkpoints hold GRPO's Adam state; with one distributed optimizer that is only true in GRPO.
            self.optimizer.restart(lr=self.cfg.lr)
            self._last_mode = "grpo"

    def load_state(self, tensors: dict[str, Tensor], state: dict[str, Any]) -> None:
        if state.get("backend") != "megatron":
            raise ValueError(
                "this checkpoint was written by the torch trainer backend; resume it with train.backend=torch"
            )

        def part(prefix: str) -> dict[str, Tensor]:
            local = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            return to_megatron(lambda n: local[n].to(self.device), self.args, self.shard)

        self._load_params(self.model, part("model/"))
        if self.ref_model is not None:
            self._load_params(self.ref_model, part("ref_model/"))
        params = dict(self.model.named_parameters())
        moments = {m: part(f"optimizer/{m}/") for m in MOMENTS}
        # fp32 master weights exist only in checkpoints of the distributed optimizer; from another
        # checkpoint the masters start from the (possibly bf16) model weights.
        main = part("optimizer/main_params/") if any(k.startswith("optimizer/main_params/") for k in tensors) else {}
        states = {p: {**{m: moments[m][n] for m in MOMENTS}, **({"main": main[n]} if main else {})}
                  for n, p in params.items()}  # fmt: skip
        self._last_mode = "grpo"
        self.optimizer.load_param_states(states, int(state["adam_step"]))
        self.nan_guard.in_a_row = int(state.get("num_nan_in_a_row", 0))

    def export(self, out_dir: str | Path) -> Path:
        """Write the policy as an HF dir on rank 0; every rank must call it."""
        weights = self.export_weights()
        out = Path(out_dir)
        if self.rank == 0:
            save_state_dict(dict(weights), out, source_dir=self.model_dir)
        return out


def _meta_model(args: ModelArgs) -> CausalLM:
    return CausalLM.without_init(args)
