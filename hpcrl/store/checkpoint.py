"""Checkpoints in ``run_dir/checkpoints/step_NNNNNNNN.h5``: tensors plus JSON state, no pickle anywhere.

Layout of one file (DESIGN.md §4):
- ``/tensors/<escaped name>``: one dataset per tensor, with attributes ``dtype`` (the torch dtype name)
  and ``blake2b`` (checksum of dtype, shape and raw bytes). Tensor names are percent-escaped
  (``urllib.parse.quote``) so that any name, '/' and '.' included, round-trips exactly.
  Dtypes without a NumPy twin (bfloat16, float8) are stored bit-exact as unsigned ints of their width.
- root attributes: ``hpcrl_format="checkpoint"``, ``hpcrl_format_version``, ``step``, ``num_tensors``,
  ``state_json`` (the JSON-serialisable state: data cursor, weight version, RNG, optimizer skeleton...).

A checkpoint is written to ``.step_NNNNNNNN.h5.tmp``, fsynced and renamed, so a file with the final name is
complete unless the storage damaged it afterwards, which the checksums catch on load.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import h5py
import numpy as np
import torch

from hpcrl.store.metrics import FORMAT_ATTR, FORMAT_VERSION_ATTR, StoreError

CHECKPOINT_FORMAT = "checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
_NAME = re.compile(r"step_(\d{8,})\.h5")
_TEMP_NAME = re.compile(r"\.step_(\d{8,})\.h5\.tmp")
_TENSORS = "tensors"

# Dtypes NumPy lacks, stored as their raw bits.
_BITS_DTYPES: dict[torch.dtype, tuple[torch.dtype, type[np.unsignedinteger[Any]]]] = {
    torch.bfloat16: (torch.int16, np.uint16),
    **{
        dtype: (torch.int8, np.uint8)
        for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
        if isinstance(dtype := getattr(torch, name, None), torch.dtype)
    },
}
_NATIVE_DTYPES = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.bool,
    }
)


class CheckpointError(StoreError):
    """A checkpoint file is missing, damaged (truncated, failed checksum) or not an hpcrl checkpoint."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint: every tensor passed its checksum."""

    step: int
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]
    path: Path


def checkpoint_path(ckpt_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}.h5"


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[Path]:
    """Returns the checkpoint files of a directory, oldest step first (temporary files excluded)."""
    return [path for _, path in _checkpoints_by_step(Path(ckpt_dir))]


def _checkpoints_by_step(ckpt_dir: Path) -> list[tuple[int, Path]]:
    if not ckpt_dir.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _NAME.fullmatch(p.name)))


def remove_temp_files(ckpt_dir: str | os.PathLike[str]) -> list[Path]:
    """Deletes the temporary files left by writers that were killed mid-save; returns them."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    removed = sorted(p for p in ckpt_dir.iterdir() if _TEMP_NAME.fullmatch(p.name))
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


# -- saving ------------------------------------------------------------------------------------------


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    step: int,
    tensors: Mapping[str, torch.Tensor],
    state: Mapping[str, Any],
    keep_last: int = 2,
) -> Path:
    """Writes ``step_NNNNNNNN.h5`` atomically and keeps the ``keep_last`` newest checkpoints.

    ``state`` must be JSON data (dicts with string keys, lists, str, int, float, bool, None); use
    ``flatten_state`` for nested structures holding tensors or non-string keys (optimizer state).
    Checkpoints of steps after ``step`` are deleted too: they belong to a timeline the run abandoned when it
    resumed from an earlier checkpoint, and ``load_latest_checkpoint`` must not return to it.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of JSON data, got {type(state).__name__}")
    _check_json(state, "state")
    state_json = json.dumps(state)
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final_path = checkpoint_path(ckpt_dir, step)
    temp_path = ckpt_dir / f".{final_path.name}.tmp"
    failure: str | None = None
    try:
        _write_file(temp_path, step, tensors, state_json)
        _fsync_path(temp_path)
        os.replace(temp_path, final_path)
        _fsync_path(ckpt_dir)
    except (OSError, RuntimeError) as error:
        temp_path.unlink(missing_ok=True)
        failure = _first_line(error)
    except BaseException:
        temp_path.unlink(missing_ok=True)
        raise
    if failure is not None:
        raise CheckpointError(
            f"could not write checkpoint {final_path} ({failure}); the disk may be full or over quota: free "
            "space and rerun to resume from the previous checkpoint (left intact, if there is one)"
        )
    _prune(ckpt_dir, step, keep_last)
    return final_path


def _write_file(path: Path, step: int, tensors: Mapping[str, torch.Tensor], state_json: str) -> None:
    # v108 lets attributes exceed 64 KiB (an optimizer skeleton of a large model can).
    f = h5py.File(path, "w", libver="v108")
    fd = f.id.get_vfd_handle()
    try:
        f.attrs[FORMAT_ATTR] = CHECKPOINT_FORMAT
        f.attrs[FORMAT_VERSION_ATTR] = CHECKPOINT_FORMAT_VERSION
        f.attrs["step"] = step
        f.attrs["num_tensors"] = len(tensors)
        f.attrs["state_json"] = state_json
        group = f.create_group(_TENSORS)
        # Every object stays open until the flush: a dataset closed on the way may write metadata, and one
        # whose write fails inside close() is left half-closed, which crashes the process at exit. Kept
        # open, a failing write raises here with every object intact for _abandon.
        opened = [group]
        for name, tensor in tensors.items():
            opened.append(_write_tensor(group, name, tensor))
        f.flush()
    except BaseException:
        _abandon(f, fd)
        raise
    f.close()


def _abandon(f: h5py.File, fd: int) -> None:
    """Close a file whose write failed (disk full, file size limit) so that nothing is left to flush.

    Closing it normally would flush the unwritten metadata again, fail again, and leave half-closed
    objects that HDF5 frees at interpreter exit, crashing the process (exit 139). Pointing its descriptor
    at /dev/null lets that last flush succeed into nothing; the caller deletes the partial file.
    """
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            f.close()
        except Exception:  # noqa: BLE001 - the write error already raised is what the caller reports
            pass
    gc.collect()


def _first_line(error: BaseException) -> str:
    # HDF5 buries the system's reason ("File too large", "No space left on device") deep in its message.
    reason = re.search(r"error message = '([^']+)'", str(error))
    if reason:
        return reason.group(1)
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _escape(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    escaped = quote(name, safe="")
    # "." and ".." are HDF5 path navigation, not names.
    return escaped.replace(".", "%2E") if set(escaped) == {"."} else escaped


def _digest(dtype_name: str, array: np.ndarray) -> str:
    digest = hashlib.blake2b(f"{dtype_name}{array.shape}".encode(), digest_size=16)
    digest.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def _write_tensor(group: h5py.Group, name: str, tensor: torch.Tensor) -> h5py.Dataset:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}; pass torch tensors (see flatten_state)")
    if tensor.layout != torch.strided:
        raise TypeError(f"tensor {name!r} has layout {tensor.layout}; convert it with .to_dense() first")
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    cpu = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if tensor.dtype in _BITS_DTYPES:
        bits_dtype, np_dtype = _BITS_DTYPES[tensor.dtype]
        array = cpu.view(bits_dtype).numpy().view(np_dtype)
    elif tensor.dtype in _NATIVE_DTYPES:
        array = cpu.numpy()
    else:
        raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which hpcrl checkpoints do not store")
    ds = group.create_dataset(_escape(name), data=array)
    ds.attrs["dtype"] = dtype_name
    ds.attrs["blake2b"] = _digest(dtype_name, array)
    return ds


def _fsync_path(path: Path) -> None:
    # Without fsync a node crash after the rename can leave a complete-looking name with missing data.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(ckpt_dir: Path, step: int, keep_last: int) -> None:
    found = _checkpoints_by_step(ckpt_dir)
    older = [path for path_step, path in found if path_step < step]
    abandoned = [path for path_step, path in found if path_step > step]
    if abandoned:
        warnings.warn(
            f"deleting checkpoints {[path.name for path in abandoned]} in {ckpt_dir}: their steps are after the step "
            f"{step} just saved, so they belong to a timeline the run abandoned when it resumed from an earlier one",
            RuntimeWarning,
            stacklevel=3,
        )
    for path in abandoned + older[: max(0, len(older) - (keep_last - 1))]:
        path.unlink(missing_ok=True)


def _check_json(value: object, where: str) -> None:
    # json.dumps would turn int keys into strings and tuples into lists without a word; refuse them here
    # so that a state always loads back equal to what was saved.
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where} has the non-string key {key!r}; JSON keys are strings: use flatten_state to keep "
                    "int keys, or convert the key"
                )
            _check_json(item, f"{where}[{key!r}]")
        return
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check_json(item, f"{where}[{index}]")
        return
    hint = " (tensors go in `tensors`, see flatten_state)" if isinstance(value, torch.Tensor) else ""
    raise TypeError(
        f"{where} is a {type(value).__name__}, which JSON state cannot hold{hint}; "
        "use dict, list, str, int, float, bool or None"
    )


# -- loading -----------------------------------------------------------------------------------------


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Loads one checkpoint, verifying every tensor's checksum; raises CheckpointError if damaged."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get(FORMAT_ATTR) != CHECKPOINT_FORMAT:
                raise CheckpointError(
                    f"{path} is an HDF5 file but not an hpcrl checkpoint (no root attribute "
                    f"{FORMAT_ATTR}={CHECKPOINT_FORMAT!r})"
                )
            step = int(f.attrs["step"])
            state = json.loads(f.attrs["state_json"])
            group = f[_TENSORS]
            tensors = {unquote(name): _read_tensor(path, unquote(name), ds) for name, ds in group.items()}
            num_tensors = int(f.attrs["num_tensors"])
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as error:
        raise CheckpointError(f"cannot read checkpoint {path} ({error}); the file is truncated or corrupt") from error
    if len(tensors) != num_tensors:
        raise CheckpointError(f"checkpoint {path} holds {len(tensors)} tensors instead of {num_tensors}; it is corrupt")
    name_match = _NAME.fullmatch(path.name)
    if name_match and int(name_match.group(1)) != step:
        raise CheckpointError(f"checkpoint {path} records step {step}, which does not match its file name")
    return Checkpoint(step=step, tensors=tensors, state=state, path=path)


def _read_tensor(path: Path, name: str, ds: h5py.Dataset) -> torch.Tensor:
    dtype_name = str(ds.attrs["dtype"])
    array = np.empty(ds.shape, dtype=ds.dtype)
    if array.size:
        ds.read_direct(array)
    expected = str(ds.attrs["blake2b"])
    actual = _digest(dtype_name, array)
    if actual != expected:
        raise CheckpointError(
            f"tensor {name!r} of checkpoint {path} fails its checksum (stored {expected}, computed {actual}); "
            "the file is corrupt"
        )
    dtype = getattr(torch, dtype_name, None)
    if dtype in _BITS_DTYPES:
        bits_dtype, _ = _BITS_DTYPES[dtype]
        return torch.from_numpy(array).view(bits_dtype).view(dtype)
    tensor = torch.from_numpy(array)
    if tensor.dtype != dtype:
        raise CheckpointError(f"tensor {name!r} of checkpoint {path} is {tensor.dtype} but records dtype {dtype_name}")
    return tensor


def load_latest_checkpoint(ckpt_dir: str | os.PathLike[str]) -> Checkpoint | None:
    """Returns the newest checkpoint that loads and passes its checksums, or None if there is none.

    A damaged checkpoint is skipped with a RuntimeWarning naming the file and the reason.
    """
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return load_checkpoint(path)
        except CheckpointError as error:
            warnings.warn(f"skipping checkpoint {path}: {error}", RuntimeWarning, stacklevel=2)
    return None


# -- structured state without pickle ------------------------------------------------------------------


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
