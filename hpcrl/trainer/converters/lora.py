"""`lora`: low-rank adapters train instead of the model's weights (`train.lora`, docs/lora.md).

Each targeted linear layer becomes W x + (alpha / r) B A x with W frozen as loaded, A [r, in] and B [out, r] in
fp32 (B starts at zero: the run starts from the loaded policy). The optimizer holds only A and B; a push sends only
them (B with the scale multiplied in, hpcrl/model/lora.py), and the engines merge them into the base weights they
kept; the KL reference is the same model with its adapters off, not a second copy; an export writes the merged
model, a checkpoint the adapters and the base's identity (a hash).

The training forward computes the adapter beside the frozen GEMM (the cheap way: no gradient of W's size), but a
layer's `weight` is the merged W + B' A, which is what the batch-invariant forward reads (train.logprobs:
invariant): the trainer then scores with the very weights the engine serves, bit for bit.

Under parallelism fsdp2 the base and the adapters are DTensor shards: a push gathers each adapter as it is read,
the merged weights (`export_state`) are computed on the shards, the base's hash and the peft export's adapters are
gathered whole (collectively, on every rank).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from hpcrl.model.hf import publish_dir, staging_dir
from hpcrl.model.lora import LORA_A, LORA_B, merged_weight
from hpcrl.model.qwen3 import CausalLM
from hpcrl.trainer.config import LORA_ALL_LINEAR, LoRAConfig, TrainConfig
from hpcrl.trainer.converters.base import ModelConverter, ServesReference
from hpcrl.trainer.sharded_state import gather_full, host_state

INIT_SEED = 0x10A
"""A's initial values come from this seed and the layer's index, so every data-parallel rank starts the same."""


class LoRALinear(nn.Module):
    """A frozen linear layer (`base_layer`) with a trained low-rank adapter (`lora_A`, `lora_B`: peft's names)."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig, *, seed: int) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, cfg.rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(cfg.rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        bound = 1.0 / math.sqrt(base.in_features)  # peft's kaiming_uniform(a=sqrt(5)) bound
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.lora_A.weight.copy_(torch.rand(self.lora_A.weight.shape, generator=gen) * (2 * bound) - bound)
            self.lora_B.weight.zero_()
        self.scaling = cfg.scaling
        self.dropout = cfg.dropout
        self.enabled = True

    def scaled_b(self) -> Tensor:
        """B' = (alpha / r) B: what a push sends and the merged weight uses."""
        return self.lora_B.weight * self.scaling

    @property
    def weight(self) -> Tensor:
        """The weight this layer serves: the merged W + B' A (W alone with the adapter off)."""
        if not self.enabled:
            return self.base_layer.weight
        return merged_weight(self.base_layer.weight, self.lora_A.weight, self.scaled_b())

    @property
    def bias(self) -> Tensor | None:
        return self.base_layer.bias

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_layer(x)
        if not self.enabled:
            return out
        h = x.to(self.lora_A.weight.dtype)
        if self.dropout and self.training and torch.is_grad_enabled():  # the training forward only
            h = F.dropout(h, self.dropout, training=True)
        return out + (self.lora_B(self.lora_A(h)) * self.scaling).to(out.dtype)


class LoRA(ModelConverter, ServesReference):
    name = "lora"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        assert cfg.lora is not None, "the config checks converters: [lora] comes with lora"
        self.lora = cfg.lora
        self.layers: dict[str, LoRALinear] = {}  # module name (model.layers.N.self_attn.q_proj) -> its layer
        self.all_linear: list[str] = []  # every linear layer of the decoder layers, adapted or not
        self._base_hash: str | None = None
        self._gathered: dict[str, Tensor] | None = None  # the adapters gathered whole for an export's files

    def convert(self, model: CausalLM) -> None:
        linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("model.layers.")}
        self.all_linear = list(linears)
        chosen = set(linears) if self.lora.targets == (LORA_ALL_LINEAR,) else set()
        for target in self.lora.targets if not chosen else ():
            hits = {n for n in linears if n == target or n.endswith("." + target)}
            if not hits:
                kinds = sorted({n.rsplit(".", 1)[1] for n in linears}, key=_layer_order)
                raise ValueError(
                    f"train.lora.target_modules: the model has no linear layer {target!r}; each of its decoder "
                    f"layers has {', '.join(kinds)}: name some of those, or {LORA_ALL_LINEAR}"
                )
            chosen |= hits
        for p in model.parameters():
            p.requires_grad_(False)
        modules = dict(model.named_modules())
        for index, name in enumerate(n for n in linears if n in chosen):  # the model's order: seeds stable
            parent, _, attr = name.rpartition(".")
            layer = LoRALinear(linears[name], self.lora, seed=INIT_SEED + index)
            setattr(modules[parent], attr, layer)
            self.layers[name] = layer

    @contextlib.contextmanager
    def reference(self, model: CausalLM) -> Iterator[None]:
        """The model as loaded: every adapter off."""
        for layer in self.layers.values():
            layer.enabled = False
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.enabled = True

    def push_state(self, model: CausalLM, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Only the adapters, as `P.lora_A` and `P.lora_B` (B' = scale x B) for each adapted weight P: nothing
        else trains, so the engines keep the rest and merge these into the base weights they kept."""
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, layer in self.layers.items():
                out[f"{name}.weight{LORA_A}"] = layer.lora_A.weight.detach()
                out[f"{name}.weight{LORA_B}"] = layer.scaled_b().detach()
        return out

    def export_state(self, model: CausalLM, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The merged model in Hugging Face names: each adapted W replaced by W + B' A."""
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            for key, value in state.items():
                module, _, leaf = key.rpartition(".")
                owner, _, part = module.rpartition(".")
                if part in ("lora_A", "lora_B") and owner in self.layers:
                    continue
                if part == "base_layer" and owner in self.layers:
                    layer = self.layers[owner]
                    out[f"{owner}.{leaf}"] = layer.weight.detach() if leaf == "weight" else value
                    continue
                out[key] = value
        return out

    def gather_for_export(self, model: CausalLM) -> None:
        self._gathered = host_state(self.adapter_state(), keep=True)  # megabytes: every rank keeps them

    def adapter_state(self) -> dict[str, Tensor]:
        """A and B (unscaled) of every adapted layer, in the model's state-dict names (sharded: the whole copies
        `gather_for_export` took)."""
        if self._gathered is not None:
            return self._gathered
        return {
            f"{name}.{part}.weight": getattr(layer, part).weight.detach()
            for name, layer in self.layers.items()
            for part in ("lora_A", "lora_B")
        }

    # ----- checkpoints: the adapters and the base's identity -----
    def checkpoint_state(self, model: CausalLM, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Only the adapters: the base is model.path's, which `check_resume` makes sure of by its hash."""
        keep = set(self.adapter_state())
        return {k: v for k, v in state.items() if k in keep}

    def checkpoint_meta(self, model: CausalLM) -> dict[str, Any]:
        return {"base_sha256": self.base_hash(model), "rank": self.lora.rank, "alpha": self.lora.alpha}

    def check_resume(self, model: CausalLM, meta: dict[str, Any] | None) -> None:
        if meta is None:
            raise ValueError(
                "this checkpoint was written by a run without LoRA (it holds the whole model, not adapters); resume "
                "it without converters: [lora] and train.lora, or start the LoRA run in a new run directory"
            )
        if (meta.get("rank"), meta.get("alpha")) != (self.lora.rank, self.lora.alpha):
            raise ValueError(
                f"this checkpoint holds adapters of rank {meta.get('rank')} and alpha {meta.get('alpha')}, this run "
                f"asks for rank {self.lora.rank} and alpha {self.lora.alpha}; resume with the train.lora the run was "
                "started with"
            )
        if meta.get("base_sha256") != self.base_hash(model):
            raise ValueError(
                f"this checkpoint's adapters were trained on another base model (sha256 {meta.get('base_sha256')}); "
                f"this run's model.path holds sha256 {self.base_hash(model)}. Resume with the model.path (and "
                "train.dtype) the run was started with: adapters are only meaningful on their own base"
            )

    # ----- export: a peft adapter beside the merged model -----
    def export_files(self, model: CausalLM, out_dir: Path, *, base_dir: Path) -> None:
        """`out_dir/adapter`: peft's format (adapter_config.json, adapter_model.safetensors), which
        `PeftModel.from_pretrained(base, out_dir / "adapter")` loads onto the base model (model.path, not the
        merged model beside it)."""
        try:
            write_peft_adapter(self, out_dir / "adapter", base_model=str(base_dir))
        finally:
            self._gathered = None  # stale after the next step

    def base_hash(self, model: CausalLM) -> str:
        """The identity of the frozen base: a sha256 of every tensor that is not an adapter (name, dtype, shape,
        bytes), computed once (the base never changes)."""
        if self._base_hash is None:
            digest = hashlib.sha256()
            for key, value in sorted(model.state_dict().items()):
                if ".lora_A." in key or ".lora_B." in key:
                    continue
                t = gather_full(value.detach()).to("cpu").contiguous()  # a shard: gathered (every rank asks)
                digest.update(f"{key}|{t.dtype}|{list(t.shape)}|".encode())
                digest.update(t.view(torch.uint8).numpy().data)  # the buffer itself, no copy
            self._base_hash = digest.hexdigest()
        return self._base_hash


def peft_config(converter: LoRA) -> dict[str, Any]:
    """peft's adapter_config.json of these adapters (LoraConfig's fields)."""
    names = list(converter.layers)
    kinds = sorted({n.rsplit(".", 1)[1] for n in names}, key=_layer_order)
    # The kinds alone when every layer of those kinds is adapted, else each module by its full name (peft matches a
    # target as the module's name or a suffix of it).
    everywhere = {n for n in converter.all_linear if n.rsplit(".", 1)[1] in kinds}
    targets = kinds if everywhere == set(names) else names
    lora = converter.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_peft_adapter(converter: LoRA, out_dir: Path, *, base_model: str) -> Path:
    """The adapters as a peft adapter directory, written whole or not at all (a temporary directory renamed)."""
    tmp = staging_dir(out_dir)
    config = peft_config(converter) | {"base_model_name_or_path": base_model}
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # peft's names: the wrapped model's prefix, the adapter name left out.
    tensors = {f"base_model.model.{k}": v.to("cpu").contiguous() for k, v in converter.adapter_state().items()}
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return publish_dir(tmp, out_dir)


_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _layer_order(name: str) -> tuple[int, str]:
    return (_ORDER.index(name) if name in _ORDER else len(_ORDER), name)
