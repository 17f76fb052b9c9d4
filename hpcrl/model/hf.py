"""Hugging Face directory in and out: config.json + safetensors (single file or sharded index)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hpcrl.model.qwen3 import CausalLM, ModelArgs

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir}: "
        "hpcrl loads Hugging Face checkpoints saved with safetensors"
    )


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """Build the model from an HF dir; every parameter must be present in the checkpoint."""
    model_dir = Path(model_dir)
    args = ModelArgs.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(args)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in iter_safetensors(model_dir):
            if name not in params:
                if name == "lm_head.weight" and args.tie_word_embeddings:
                    continue  # some tied checkpoints still store the head
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"{model_dir}: unexpected weight {name!r} for a {args.num_layers}-layer model")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"{model_dir}: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    model.eval()
    return model


def save_model(model: CausalLM, out_dir: str | Path, *, source_dir: str | Path) -> Path:
    """Write the model as an HF dir (config and tokenizer copied from `source_dir`), atomically."""
    return save_state_dict(model.state_dict(), out_dir, source_dir=source_dir)


def save_state_dict(state: Mapping[str, torch.Tensor], out_dir: str | Path, *, source_dir: str | Path) -> Path:
    """Write HF-named tensors as an HF dir (config and tokenizer copied from `source_dir`), atomically."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    source_dir = Path(source_dir)
    shutil.copy2(source_dir / "config.json", tmp / "config.json")
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, tmp / name)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return out_dir
