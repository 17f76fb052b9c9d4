"""Structured state without pickle: nested containers of tensors split into tensors and a JSON skeleton, and the
random generators captured as such, for checkpoints to store."""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import numpy as np
import torch

__all__ = ["capture_rng_state", "flatten_state", "restore_rng_state", "unflatten_state"]


def flatten_state(nested: object, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Splits a nested structure into tensors and a JSON skeleton that ``unflatten_state`` reverses.

    Handles dicts (keys str, int, float, bool or None, kept with their type), lists, tuples, tensors, str,
    int, float, bool and None: e.g. ``optimizer.state_dict()``, whose int keys must stay ints. Tensor names
    are ``prefix`` followed by the path of the tensor: prefix ``"optimizer/"`` gives ``"optimizer/state/0/exp_avg"``.
    NumPy scalars come back as Python numbers; a tensor reached twice comes back as two tensors.
    """
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: object, path: list[str]) -> Any:
        if isinstance(value, torch.Tensor):
            name = prefix + "/".join(quote(part, safe="") for part in path) if path else prefix or "value"
            base, counter = name, 1
            while name in tensors:  # keys 0 and "0" share a path
                name, counter = f"{base}~{counter}", counter + 1
            tensors[name] = value
            return {"tensor": name}
        if value is None or isinstance(value, str | bool | int | float):
            return value
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, Mapping):
            items = []
            for key, item in value.items():
                if key is not None and not isinstance(key, str | int | float):
                    raise TypeError(f"flatten_state: key {key!r} at /{'/'.join(path)} is not str, int, float or None")
                items.append([key, encode(item, [*path, str(key)])])
            return {"dict": items}
        if isinstance(value, list | tuple):
            encoded = [encode(item, [*path, str(index)]) for index, item in enumerate(value)]
            return encoded if isinstance(value, list) else {"tuple": encoded}
        raise TypeError(
            f"flatten_state: {type(value).__name__} at /{'/'.join(path)} is not supported; use tensors, dicts, "
            "lists, tuples, str, int, float, bool or None"
        )

    return tensors, encode(nested, [])


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: Any) -> Any:
    """Rebuilds the structure that ``flatten_state`` split into ``tensors`` and ``skeleton``."""

    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(item) for item in value]
        if not isinstance(value, dict):
            return value
        if value.keys() == {"tensor"}:
            name = value["tensor"]
            if name not in tensors:
                raise KeyError(f"unflatten_state: the skeleton names tensor {name!r}, which is not among the tensors")
            return tensors[name]
        if value.keys() == {"tuple"}:
            return tuple(decode(item) for item in value["tuple"])
        if value.keys() == {"dict"}:
            return {key: decode(item) for key, item in value["dict"]}
        raise ValueError(f"unflatten_state: malformed skeleton node {value!r}")

    return decode(skeleton)


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Captures the python ``random``, NumPy global, torch CPU and CUDA generators as (tensors, JSON state)."""
    py_version, py_internal, py_gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple), "legacy=True returns a tuple"
    np_algorithm, np_keys, np_pos, np_has_gauss, np_cached_gaussian = np_state
    tensors = {
        "rng/python": torch.tensor(py_internal, dtype=torch.int64),
        "rng/numpy": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "rng/torch_cpu": torch.get_rng_state(),
    }
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    for index, cuda_state in enumerate(cuda_states):
        tensors[f"rng/cuda/{index}"] = cuda_state
    state = {
        "python_version": py_version,
        "python_gauss_next": py_gauss_next,
        "numpy_algorithm": np_algorithm,
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_cached_gaussian": float(np_cached_gaussian),
        "num_cuda_devices": len(cuda_states),
    }
    return tensors, state


def restore_rng_state(tensors: Mapping[str, torch.Tensor], state: Mapping[str, Any]) -> None:
    """Restores the generators captured by ``capture_rng_state`` (``tensors`` may hold other tensors too)."""
    py_internal = tuple(int(v) for v in tensors["rng/python"].tolist())
    random.setstate((state["python_version"], py_internal, state["python_gauss_next"]))
    np_keys = tensors["rng/numpy"].numpy().astype(np.uint32)
    np.random.set_state(
        (
            state["numpy_algorithm"],
            np_keys,
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_cached_gaussian"],
        )
    )
    torch.set_rng_state(tensors["rng/torch_cpu"])
    num_saved = int(state["num_cuda_devices"])
    num_here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_saved != num_here:
        warnings.warn(
            f"the checkpoint has CUDA generator states for {num_saved} devices and this process sees {num_here}; "
            f"restoring the first {min(num_saved, num_here)}",
            RuntimeWarning,
            stacklevel=2,
        )
    for index in range(min(num_saved, num_here)):
        torch.cuda.set_rng_state(tensors[f"rng/cuda/{index}"], device=index)
