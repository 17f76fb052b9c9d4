"""Hugging Face directory in and out: config.json + safetensors (single file or sharded index)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hpcrl.model.moe import split_fused_experts
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


def _open_safetensors(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}, named by the model's safetensors index, does not exist") from None
    except Exception as exc:  # safetensors raises its own SafetensorError for a damaged header
        raise ValueError(
            f"{path} cannot be read as safetensors ({exc}); the file is truncated or corrupt: download or "
            "export the model again"
        ) from None


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _safetensors_files(Path(model_dir)):
        with _open_safetensors(path) as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:  # a file cut short after its header
                    raise ValueError(
                        f"{path}: weight {name!r} cannot be read ({exc}); the file is truncated or corrupt: "
                        "download or export the model again"
                    ) from None
                # A checkpoint written with transformers 5's fused expert tensors reads as one tensor per expert.
                yield from split_fused_experts({name: tensor}).items()


def _header_shapes(f: Any, name: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a stored tensor as the model names it (fused expert tensors as one entry per expert)."""
    shape = tuple(f.get_slice(name).get_shape())
    if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) or len(shape) != 3:
        yield name, shape
        return
    for split, tensor in split_fused_experts({name: torch.empty(shape, device="meta")}).items():
        yield split, tuple(tensor.shape)


def check_model_dir(model_dir: str | Path) -> None:
    """Check config.json and the safetensors headers against each other without reading the weights, so
    that a damaged or mismatched model directory fails before a run writes anything."""
    model_dir = Path(model_dir)
    args = ModelArgs.from_dir(model_dir)
    params = dict(CausalLM.without_init(args).named_parameters())
    seen: set[str] = set()
    for path in _safetensors_files(model_dir):
        with _open_safetensors(path) as f:
            for stored in f.keys():
                for name, shape in _header_shapes(f, stored):
                    if _expected_weight(model_dir, name, shape, params, args):
                        seen.add(name)
    _check_complete(model_dir, params, seen)


def _expected_weight(
    model_dir: Path, name: str, shape: tuple[int, ...], params: Mapping[str, torch.Tensor], args: ModelArgs
) -> bool:
    """True for a weight the model loads, False for one it may skip; raises for one that does not fit."""
    if name not in params:
        if name == "lm_head.weight" and args.tie_word_embeddings:
            return False  # some tied checkpoints still store the head
        if "rotary_emb" in name:
            return False
        raise ValueError(_unexpected_weight(model_dir, name, args))
    if shape != tuple(params[name].shape):
        raise ValueError(f"{model_dir}: weight {name} has shape {shape}, expected {tuple(params[name].shape)}")
    return True


def _check_complete(model_dir: Path, params: Mapping[str, torch.Tensor], seen: set[str]) -> None:
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


def load_model(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """Build the model from an HF dir; every parameter must be present in the checkpoint."""
    model_dir = Path(model_dir)
    args = ModelArgs.from_dir(model_dir)
    model = CausalLM.without_init(args, device).to(dtype)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in iter_safetensors(model_dir):
            if _expected_weight(model_dir, name, tuple(tensor.shape), params, args):
                params[name].copy_(tensor)
                seen.add(name)
    _check_complete(model_dir, params, seen)
    model.eval()
    return model


def _unexpected_weight(model_dir: Path, name: str, args: ModelArgs) -> str:
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if name.endswith(("q_norm.weight", "k_norm.weight")) and not args.qk_norm:
        return (
            f"{model_dir}: the weights have QK-norm ({name!r}), which Qwen3 models have, but config.json says "
            f"model_type {model_type!r}, which has none: set model_type to 'qwen3' in {model_dir / 'config.json'}"
        )
    return (
        f"{model_dir}: weight {name!r} does not belong to the model config.json describes (model_type "
        f"{model_type!r}, {args.num_layers} layers): the config and the weights come from different models"
    )


class ExportLinkError(ValueError):
    """An export would write through a symbolic link planted where the model folder goes."""


def _refuse_link(path: Path) -> None:
    # Whoever can write the run directory could plant `model` (or `model.tmp`) as a link to another of the
    # user's folders, which the export would then delete and fill.
    if path.is_symlink():
        raise ExportLinkError(
            f"{path} is a symbolic link (to {os.readlink(path)}); hpcrl never writes through a link in a run "
            "directory. Remove the link (nothing was written to its target), or use another --run-dir"
        )


def save_state_dict(state: Mapping[str, torch.Tensor], out_dir: str | Path, *, source_dir: str | Path) -> Path:
    """Write HF-named tensors as an HF dir (config and tokenizer copied from `source_dir`), atomically."""
    out_dir = Path(out_dir)
    tmp = staging_dir(out_dir)
    copy_config_and_tokenizer(Path(source_dir), tmp)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return publish_dir(tmp, out_dir)


def copy_config_and_tokenizer(source_dir: Path, tmp: Path) -> None:
    """The files of an HF dir besides its weights: config.json, and the tokenizer's files that `source_dir` has."""
    shutil.copy2(source_dir / "config.json", tmp / "config.json")
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, tmp / name)


def staging_dir(out_dir: Path) -> Path:
    """An empty OUT.tmp beside `out_dir` to write a directory into, whole or not at all (publish_dir); neither
    path may be a link."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    for path in (out_dir, tmp):
        _refuse_link(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(tmp: Path, out_dir: Path) -> Path:
    """Make the files of `tmp` durable, then put it in the place of `out_dir` (a directory there is replaced)."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return out_dir
