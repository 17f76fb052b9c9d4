"""What the torch backend's model state costs each rank, and whether it fits: `hpcrl doctor` and the start-up line.

Per rank: the weights, their gradients and AdamW's two moments, all in train.dtype, each divided by the ranks a
copy is sharded over (parallelism: fsdp2; 1 under ddp), plus, under FSDP2, two groups gathered whole in the
compute dtype (the one running and the one prefetched: decoder layers; for a mixture-of-experts model, whose
experts are groups of their own, one layer and the next one's non-expert weights). Activations come on top and
depend on the batch (train.micro_batch_size, sequence lengths, train.activation_checkpointing), so the check leaves
them a margin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpcrl.model.moe import SparseMoeBlock
from hpcrl.model.qwen3 import CausalLM, ModelArgs
from hpcrl.trainer.config import LORA_ALL_LINEAR, LoRAConfig, TrainConfig, fsdp_dtypes

_BYTES = {"float32": 4, "bfloat16": 2}
_GB = 1e9
# Activations, the CUDA context and the allocator's fragmentation need room beside the model state.
STATE_SHARE = 0.85


@dataclass(frozen=True)
class MemoryPlan:
    parameters: int
    ranks: int
    shards: int
    """Ranks one copy of the model is sharded over (1: every rank holds it whole)."""
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    gathered_bytes: int
    """FSDP2: the groups gathered whole on the device at once: two decoder layers (one running, one prefetched); for
    a mixture-of-experts model one layer and the next one's non-expert weights (its experts are a group apart)."""
    offload: bool

    @property
    def state_bytes(self) -> int:
        return self.weights_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def device_bytes(self) -> int:
        """What the device holds: the state (unless offloaded to host memory) and the gathered layers."""
        return (0 if self.offload else self.state_bytes) + self.gathered_bytes

    def line(self, parallelism: str) -> str:
        where = "host" if self.offload else "device"
        split = f"sharded over {self.shards}" if self.gathered_bytes else "whole on every rank"
        return (
            f"trainer plan: {_count(self.parameters)} parameters, {parallelism} x{self.ranks} ({split}): per rank "
            f"{_size(self.weights_bytes)} weights + {_size(self.gradient_bytes)} gradients + "
            f"{_size(self.optimizer_bytes)} AdamW state = {_size(self.state_bytes)} in {where} memory"
            + (f", + {_size(self.gathered_bytes)} of gathered layers" if self.gathered_bytes else "")
            + " (+ activations)"
        )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _size(n: int) -> str:
    return f"{n / _GB:.2f} GB" if n >= _GB else f"{n / 1e6:.2f} MB"


def count_parameters(args: ModelArgs) -> tuple[int, int]:
    """(all parameters, those FSDP2 holds gathered at once at most), from the model's structure (built on meta: no
    memory). FSDP2 gathers a group while it runs and prefetches the next one: a dense model holds two decoder layers.
    A mixture-of-experts layer's experts are a group of their own (hpcrl.trainer.parallel.apply_fsdp2), and the
    group prefetched beside a whole layer is then the next layer without its experts (attention, norms, router)."""
    model = CausalLM.without_init(args, "meta")
    whole = rest = 0
    for layer in model.model.decoder_layers:
        params = sum(p.numel() for p in layer.parameters())
        mlp = layer.mlp
        experts = sum(p.numel() for p in mlp.experts.parameters()) if isinstance(mlp, SparseMoeBlock) else 0
        whole, rest = max(whole, params), max(rest, params - experts)
    return sum(p.numel() for p in model.parameters()), whole + rest


def count_adapter_parameters(lora: LoRAConfig, args: ModelArgs) -> int:
    """Parameters of train.lora's adapters, r x (in + out) per adapted linear layer of every decoder layer (as
    converters/lora.py picks them; a target the model lacks counts nothing, the converter refuses it)."""
    model = CausalLM.without_init(args, "meta")
    total = 0
    for layer in model.model.decoder_layers:
        for name, m in layer.named_modules():
            adapted = lora.targets == (LORA_ALL_LINEAR,) or any(
                name == t or name.endswith("." + t) for t in lora.targets
            )
            if isinstance(m, torch.nn.Linear) and adapted:
                total += lora.rank * (m.in_features + m.out_features)
    return total


def plan_memory(cfg: TrainConfig, args: ModelArgs) -> MemoryPlan:
    parameters, gathered_parameters = count_parameters(args)
    size = _BYTES[cfg.dtype]
    fsdp = cfg.parallelism == "fsdp2"
    shards = (cfg.fsdp.shard_group_size or cfg.num_ranks) if fsdp else 1
    per_rank = -(-parameters // shards)
    gathered = gathered_parameters * _BYTES[fsdp_dtypes(cfg)[0]] if fsdp else 0
    weights, trained = per_rank * size, per_rank * size
    if cfg.lora is not None:  # the base is frozen: gradients and AdamW hold the fp32 adapters alone
        trained = -(-count_adapter_parameters(cfg.lora, args) // shards) * 4
        weights += trained
    return MemoryPlan(
        parameters=parameters, ranks=cfg.num_ranks, shards=shards, weights_bytes=weights,
        gradient_bytes=trained, optimizer_bytes=2 * trained, gathered_bytes=gathered,
        offload=fsdp and cfg.fsdp.offload,
    )  # fmt: skip


def fit_problem(plan: MemoryPlan, cfg: TrainConfig, device: torch.device) -> str | None:
    """Why the plan cannot fit this machine (numbers and the fix), None when it can or there is nothing to measure."""
    capacity = None
    if device.type == "cuda" and torch.cuda.is_available():
        capacity = torch.cuda.get_device_properties(device).total_memory
    return fit_problem_on(plan, cfg, gpu_bytes=capacity, host_bytes=_host_available_bytes())


def fit_problem_on(plan: MemoryPlan, cfg: TrainConfig, *, gpu_bytes: int | None, host_bytes: int | None) -> str | None:
    """`fit_problem` against a GPU of `gpu_bytes` and `host_bytes` of available host memory (None: unknown)."""
    if plan.offload:
        host = host_bytes
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or plan.ranks)
        need = plan.state_bytes * ranks_here
        if host is not None and need > host * STATE_SHARE:
            return (
                f"fsdp.offload keeps {_size(plan.state_bytes)} of model state per rank in host memory, "
                f"{_size(need)} for the {ranks_here} ranks of this node, but {_size(host)} is available; "
                "use more ranks on more nodes (each then holds less), or train.dtype: bfloat16"
            )
        return None
    capacity = gpu_bytes
    if capacity is None or plan.device_bytes <= capacity * STATE_SHARE:
        return None
    fixes = []
    if cfg.parallelism == "ddp":
        fixes.append("train.parallelism: fsdp2 (each rank then holds 1/num_ranks of the state)")
    else:
        fixes.append("more ranks (train.num_ranks; fsdp.shard_group_size: null shards over all of them)")
        fixes.append("fsdp.offload: true (the state in host memory)")
    if cfg.dtype == "float32":
        fixes.append("train.dtype: bfloat16 (half the bytes)")
    return (
        f"the trainer's model state needs {_size(plan.device_bytes)} per GPU ({plan.line(cfg.parallelism)}), "
        f"more than {STATE_SHARE:.0%} of the GPU's {_size(capacity)} (the rest is for activations); use "
        + ", or ".join(fixes)
    )


def _host_available_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


# ----- micro_batch_size: auto -----

MICRO_BATCH_SIZES = (16, 8, 4, 2, 1)
# Of the memory free after the model state, the share activations may plan on: the allocator's fragmentation,
# the compiled kernels' workspaces and the optimizer step's temporaries need the rest.
ACTIVATION_SHARE = 0.8


def activation_bytes(cfg: TrainConfig, args: ModelArgs, rows: int, seq_len: int) -> int:
    """An estimate (generous, not exact) of what one micro-batch of `rows` sequences of `seq_len` tokens keeps for
    its backward: per token and decoder layer the tensors autograd saves (train.activation_checkpointing decides
    which), plus the log-prob head (the whole [tokens x vocab] logits and their fp32 softmax and gradient, or one
    chunk of them under the fused head)."""
    size = _BYTES[fsdp_dtypes(cfg)[0] if cfg.parallelism == "fsdp2" else cfg.dtype]
    h, inter = args.hidden_size, args.intermediate_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    # Residuals, q/k/v before and after RoPE, attention's output, SwiGLU's four [tokens x intermediate] tensors,
    # and the RMSNorms' float32 copies of their inputs (eager; compiled layers keep less).
    whole_layer = 14 * h + 7 * q + 8 * kv + 4 * inter
    kept = {"none": whole_layer, "selective": 2 * h + 2 * q + 2 * kv + 2 * inter, "full": h}
    # Under checkpointing one layer's activations are rebuilt whole during its backward.
    per_token = args.num_layers * kept[cfg.activation_checkpointing] + (
        whole_layer if cfg.activation_checkpointing != "none" else 0
    )
    tokens = rows * seq_len
    head_tokens = tokens if cfg.chunk_tokens is None else min(tokens, cfg.chunk_tokens)
    head = head_tokens * args.vocab_size * (size + 8)  # logits + fp32 log-softmax + fp32 gradient
    return tokens * per_token * size + head


def activation_budget(plan: MemoryPlan, cfg: TrainConfig, device: torch.device) -> int:
    """Bytes this rank's activations may use: the GPU's free memory less the model state not yet allocated
    (measured before the model loads), times ACTIVATION_SHARE. Agreed over the ranks (the smallest), so every
    rank cuts a batch alike."""
    free, _ = torch.cuda.mem_get_info(device)
    state = plan.device_bytes + (plan.weights_bytes if cfg.kl_coef > 0 else 0)  # + the reference copy
    budget = torch.tensor([max(0, int((free - state) * ACTIVATION_SHARE))], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    return int(budget.item())


def micro_batch_for(cfg: TrainConfig, args: ModelArgs, budget_bytes: int, seq_len: int) -> int:
    """The largest of MICRO_BATCH_SIZES whose activation estimate fits `budget_bytes` (1 when none does)."""
    for rows in MICRO_BATCH_SIZES:
        if activation_bytes(cfg, args, rows, seq_len) <= budget_bytes:
            return rows
    return 1


def auto_micro_batch_line(cfg: TrainConfig, args: ModelArgs, budget_bytes: int) -> str:
    """`micro_batch_size auto (N GB for activations): 16 up to 3840 tokens, 8 up to 7680, ..., 1 beyond` for the
    trainer plan line: the size a batch of each padded length gets."""
    steps: list[str] = []
    for rows in MICRO_BATCH_SIZES[:-1]:
        if longest := _longest_fitting(cfg, args, budget_bytes, rows):
            steps.append(f"{rows} up to {longest}" + ("" if steps else " tokens"))
    return f"micro_batch_size auto ({_size(budget_bytes)} for activations): {', '.join([*steps, '1 beyond'])}"


def _longest_fitting(cfg: TrainConfig, args: ModelArgs, budget_bytes: int, rows: int) -> int:
    """The longest sequence length (a multiple of 256) at which `rows` sequences fit the budget; 0 if none."""
    lo, hi = 0, 1 << 24
    while hi - lo > 256:
        mid = (lo + hi) // 2 // 256 * 256
        lo, hi = (mid, hi) if activation_bytes(cfg, args, rows, mid) <= budget_bytes else (lo, mid)
    return lo


def settings_line(cfg: TrainConfig) -> str:
    """The resolved speed settings, for the trainer plan line (whether set or `auto`)."""
    head = f"fused log-prob head in chunks of {cfg.chunk_tokens} tokens" if cfg.chunk_tokens else "plain log-prob head"
    compiled = "on" if cfg.compiled else "off"
    return f"torch_compile {compiled}, {head}, activation_checkpointing {cfg.activation_checkpointing}"
