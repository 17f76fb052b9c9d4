"""Checkpoints in ``run_dir/checkpoints/step_NNNNNNNN.h5``: tensors plus JSON state, no pickle anywhere.

Layout of one file, format version 2, an HDF5 file that any HDF5 reader opens:
- ``/blob``: one contiguous uint8 dataset holding every tensor's raw bytes (C order, little-endian), back to
  back. It is written outside HDF5 at the dataset's file offset (aligned to 4 KiB for O_DIRECT; files written
  before that are not, and readers need nothing of it): whole 4 KiB blocks with O_DIRECT, four 8 MiB
  writes in flight, the rest with ``os.pwritev`` (everything, where the file system refuses O_DIRECT). It is
  read back the same way: O_DIRECT reads into staging buffers scattered into each tensor's memory, or
  ``os.preadv`` straight into it where O_DIRECT is refused (one system call per 1,024 tensors), checksums
  checked per run of 64 MiB beside the next reads. No copy through NumPy or HDF5 and none through the page
  cache, which is what makes a durable checkpoint as fast as ``torch.save`` (benchmarks/checkpoint_cpu_2026-12.md).
- ``/crc32``: uint32 per tensor, the CRC-32 of its name, dtype, shape and bytes (``zlib.crc32``, 3-4 GB/s
  a core and computed in threads beside the write and the read; BLAKE2b at 0.8 GB/s was the bottleneck).
NNNNNNNN in the file name is the number of steps done, as the console counts them (``step 32/300`` is saved
as ``step_00000032.h5``); the root attribute ``step`` is the step's index (31), as in metrics.h5. Files named
by the index, as runs written before that convention have them, still load and resume.
- root attributes: ``hpcrl_format="checkpoint"``, ``hpcrl_format_version``, ``step``, ``num_tensors``,
  ``state_json`` (the JSON-serialisable state: data cursor, weight version, RNG, optimizer skeleton...) and
  ``tensors_json`` (per tensor, in blob order: name, torch dtype name, shape, byte offset in the blob).

Version 1 files (one dataset per tensor under ``/tensors``, each with a BLAKE2b attribute) still load: a run
checkpointed before an upgrade resumes after it.

A checkpoint is written to ``.step_NNNNNNNN.h5.tmp``, fsynced and renamed, so a file with the final name is
complete unless the storage damaged it afterwards, which the checksums catch on load.

A sharded trainer's checkpoint also has ``step_NNNNNNNN.shards/``, one file of this format per rank (its pieces of
the sharded tensors, hpcrl/store/shards.py), and the root attribute ``shards_json`` lists them (name, size, CRC-32
of each one's checksum table). The ranks write them into ``.pending.shards/`` first; the save moves that folder
into place and then writes the checkpoint's own file, last: a checkpoint whose file exists has every shard, a
load refuses one whose shard files are missing, cut short or from another save, and shards that no file names
(a save killed midway) are deleted by the next resume (`remove_temp_files`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import re
import shutil
import sys
import warnings
import zlib
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import h5py
import numpy as np
import torch

from hpcrl.store.direct_io import DIRECT_ALIGN, fsync_path, preadv_all, pwritev_all, read_direct, write_blob
from hpcrl.store.metrics_file import FORMAT_ATTR, FORMAT_VERSION_ATTR, StoreError
from hpcrl.store.run_dir import RunDirError, make_subdir, open_no_follow, refuse_link

CHECKPOINT_FORMAT = "checkpoint"
CHECKPOINT_FORMAT_VERSION = 2
_V1_TENSORS_FORMAT_VERSION = 1
_BLOB, _CRC32 = "blob", "crc32"
# Tensors are read in runs of about this many bytes, so that each run's checksums overlap the next run's read.
_RUN_BYTES = 64 << 20
# Two checksum threads: the machines this runs on have at least two cores, and more do not speed up a
# write bound by the disk.
_CHECKSUM_THREADS = 2
_NAME = re.compile(r"step_(\d{8,})\.h5")
_TEMP_NAME = re.compile(r"\.step_(\d{8,})\.h5\.tmp")
_TENSORS = "tensors"
SHARDS_ATTR = "shards_json"
# Where the ranks of a sharded trainer write their shard files for the next checkpoint (hpcrl/store/shards.py);
# the next save moves them beside its file, as step_NNNNNNNN.shards/.
PENDING_SHARDS = ".pending.shards"
_SHARDS_DIR = re.compile(r"step_(\d{8,})\.shards")

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
    # The folder of its shard files (hpcrl/store/shards.py), checked present and the size they were written with;
    # None: every tensor is in `tensors`.
    shards: Path | None = None


def checkpoint_path(ckpt_dir: str | os.PathLike[str], step: int) -> Path:
    """The file of the checkpoint after step index `step`, named by the steps done (step + 1), as the console
    counts: `step 32/300` is saved as step_00000032.h5."""
    return Path(ckpt_dir) / f"step_{step + 1:08d}.h5"


def checkpoint_file(ckpt_dir: str | os.PathLike[str], step: int) -> Path:
    """The existing file of step index `step`: its name, or the name of runs written before checkpoints were
    named by the steps done (step_NNNNNNNN.h5 with the step index), so that those runs still resume."""
    path = checkpoint_path(ckpt_dir, step)
    old = Path(ckpt_dir) / f"step_{step:08d}.h5"
    return path if path.exists() or not old.exists() else old


def shards_dir(path: str | os.PathLike[str]) -> Path:
    """The folder of a checkpoint file's shard files: step_NNNNNNNN.h5 -> step_NNNNNNNN.shards."""
    return Path(path).with_suffix(".shards")


def checkpoint_step(path: str | os.PathLike[str]) -> int | None:
    """The step index a checkpoint file records, from its header alone (None if it cannot be read)."""
    try:
        with h5py.File(path, "r") as f:
            return int(f.attrs["step"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


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
    # Shards no checkpoint file names: written for a save that a kill cut short before its file landed.
    orphans = [ckpt_dir / PENDING_SHARDS] + [
        p
        for p in ckpt_dir.iterdir()
        if _SHARDS_DIR.fullmatch(p.name)
        and not p.with_suffix(".h5").exists()
        and not p.with_suffix(".h5.unreadable").exists()
    ]
    for path in orphans:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            removed.append(path)
    return removed


def _commit_pending_shards(ckpt_dir: Path, final_path: Path) -> str | None:
    """Moves the shard files waiting in PENDING_SHARDS to the checkpoint's shards folder; returns their manifest
    (JSON: per file its name, size and the CRC-32 of its checksum table), None where none wait."""
    pending = ckpt_dir / PENDING_SHARDS
    refuse_link(pending)
    if not pending.is_dir():
        return None
    target = shards_dir(final_path)
    refuse_link(target)
    if target.exists():  # an abandoned timeline's save of this step: its file no longer matches these shards
        shutil.rmtree(target)
    files = sorted(p for p in pending.iterdir() if p.suffix == ".h5" and not p.name.startswith("."))
    manifest = [{"name": p.name, "bytes": p.stat().st_size, "crc32_table": _crc_table_digest(p)} for p in files]
    os.replace(pending, target)
    fsync_path(ckpt_dir)
    return json.dumps(manifest)


def _crc_table_digest(path: Path) -> int:
    """The CRC-32 of a checkpoint-format file's checksum table: which write of the file this is, read cheaply."""
    with h5py.File(path, "r") as f:
        table = np.asarray(f[_CRC32][()], dtype="<u4") if f[_CRC32].shape[0] else np.zeros(0, dtype="<u4")
    return zlib.crc32(table.tobytes())


def _check_shards(path: Path, manifest_json: str) -> Path:
    """The shards folder of checkpoint `path`, refused (CheckpointError) unless it holds every file of the manifest,
    each the size and write it had when the checkpoint was saved."""
    folder = shards_dir(path)
    for entry in json.loads(manifest_json):
        shard = folder / entry["name"]
        if not shard.is_file():
            raise CheckpointError(f"shard file {shard} of checkpoint {path} is missing; the checkpoint is incomplete")
        size = shard.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"shard file {shard} of checkpoint {path} has {size} bytes, {entry['bytes']} when written; it is "
                "truncated or corrupt"
            )
        try:
            digest = _crc_table_digest(shard)
        except (OSError, KeyError, ValueError) as error:
            raise CheckpointError(f"cannot read shard file {shard} of checkpoint {path} ({error})") from error
        if digest != entry["crc32_table"]:
            raise CheckpointError(
                f"shard file {shard} of checkpoint {path} is not the one written with it (its checksums differ); "
                "it is corrupt or from another save"
            )
    return folder


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
    Tensors on a device are copied to the host first; the caller must not change the host tensors until
    this returns (``RunState`` hands it copies).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of JSON data, got {type(state).__name__}")
    _check_json(state, "state")
    state_json = json.dumps(state)
    host = {name: _host_tensor(name, tensor) for name, tensor in tensors.items()}
    ckpt_dir = make_subdir(Path(ckpt_dir))
    final_path = checkpoint_path(ckpt_dir, step)
    # Shards the ranks wrote for this checkpoint move beside it first; the file, written last, names them.
    shards = _commit_pending_shards(ckpt_dir, final_path)
    write_checkpoint_file(final_path, step, host, state_json, shards=shards)
    _prune(ckpt_dir, step, keep_last)
    return final_path


def write_checkpoint_file(
    final_path: Path, step: int, host: Mapping[str, torch.Tensor], state_json: str, shards: str | None = None
) -> None:
    """Writes one checkpoint-format file atomically (a temporary file, fsynced, renamed): a file under the final
    name is complete. `host`: contiguous host tensors (`_host_tensor`); `shards`: the manifest of the shard files
    beside it (JSON), if any."""
    ckpt_dir = final_path.parent
    refuse_link(final_path)
    temp_path = ckpt_dir / f".{final_path.name}.tmp"
    fd = _create_temp(temp_path)
    failure: str | None = None
    try:
        _write_file(temp_path, fd, step, host, state_json, shards)
        _check_same_file(temp_path, fd)
        os.replace(temp_path, final_path)
        fsync_path(ckpt_dir)
    except (OSError, RuntimeError) as error:
        temp_path.unlink(missing_ok=True)
        failure = _first_line(error)
    except BaseException:
        temp_path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    if failure is not None:
        raise CheckpointError(
            f"could not write checkpoint {final_path} ({failure}); the disk may be full or over quota: free "
            "space and rerun to resume from the previous checkpoint (left intact, if there is one)"
        )


def _host_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}; pass torch tensors (see flatten_state)")
    if tensor.layout != torch.strided:
        raise TypeError(f"tensor {name!r} has layout {tensor.layout}; convert it with .to_dense() first")
    if tensor.dtype not in _NATIVE_DTYPES and tensor.dtype not in _BITS_DTYPES:
        raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which hpcrl checkpoints do not store")
    return tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (reshape: a 0-d tensor has no byte view)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _crc32(name: str, dtype_name: str, shape: list[int], data: memoryview) -> int:
    # zlib releases the GIL for buffers over 5 KiB, so several of these run in parallel threads.
    return zlib.crc32(data, zlib.crc32(f"{name}\0{dtype_name}\0{shape}".encode()))


def _create_temp(temp_path: Path) -> int:
    """A new, empty temporary file of our own (O_EXCL, never through a link planted at its name)."""
    refuse_link(temp_path)
    temp_path.unlink(missing_ok=True)  # a killed writer's leftover
    return open_no_follow(temp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)


def _by_descriptor(path: Path, fd: int) -> Path:
    """A name that opens the very file `fd` is (Linux's /proc/self/fd), whatever is put at `path` meanwhile:
    HDF5 and the O_DIRECT writes open files by name."""
    proc = Path(f"/proc/self/fd/{fd}")
    return proc if proc.exists() else path


def _check_same_file(path: Path, fd: int) -> None:
    held, named = os.fstat(fd), os.lstat(path)
    if (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):
        raise RunDirError(
            f"{path} was replaced while the checkpoint was written (it is no longer the file hpcrl created); "
            "something else writes this run directory: stop it, or use another --run-dir"
        )


def _write_file(
    path: Path, fd: int, step: int, tensors: Mapping[str, torch.Tensor], state_json: str, shards: str | None
) -> None:
    if sys.byteorder != "little":
        raise RuntimeError("hpcrl checkpoints are little-endian; this machine is big-endian")
    entries: list[dict[str, Any]] = []
    views: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        entries.append({"name": name, "dtype": dtype_name, "shape": list(tensor.shape), "offset": offset})
        views.append(_raw_bytes(tensor))
        offset += views[-1].nbytes
    with ThreadPoolExecutor(_CHECKSUM_THREADS, thread_name_prefix="hpcrl-crc") as pool:
        # The checksums run while HDF5 lays out the file and the bytes go to it.
        crcs = [
            pool.submit(_crc32, e["name"], e["dtype"], e["shape"], view) for e, view in zip(entries, views, strict=True)
        ]
        by_fd = _by_descriptor(path, fd)
        blob_offset, crc_offset = _write_layout(by_fd, step, entries, offset, state_json, shards)
        if blob_offset is not None:
            write_blob(by_fd, fd, views, blob_offset)
        if crc_offset is not None:
            table = np.array([future.result() for future in crcs], dtype="<u4")
            pwritev_all(fd, [table.view(np.uint8).data], crc_offset)
        # Without fsync a node crash after the rename can leave a complete-looking name with missing data.
        os.fsync(fd)


def _write_layout(
    path: Path, step: int, entries: list[dict[str, Any]], blob_nbytes: int, state_json: str, shards: str | None
) -> tuple[int | None, int | None]:
    """Writes the HDF5 part of a checkpoint (attributes, the blob and crc32 datasets allocated but unfilled);
    returns the file offsets of the two datasets (None for an empty one), where the raw bytes go."""
    # v108 lets attributes exceed 64 KiB (an optimizer skeleton of a large model can).
    # The alignment puts the blob (and any other object of 4 KiB or more) at a multiple of 4 KiB, so that its
    # bytes can be written with O_DIRECT; readers need nothing of it.
    f = h5py.File(path, "w", libver="v108", alignment_threshold=DIRECT_ALIGN, alignment_interval=DIRECT_ALIGN)
    fd = f.id.get_vfd_handle()
    try:
        f.attrs[FORMAT_ATTR] = CHECKPOINT_FORMAT
        f.attrs[FORMAT_VERSION_ATTR] = CHECKPOINT_FORMAT_VERSION
        f.attrs["step"] = step
        f.attrs["num_tensors"] = len(entries)
        f.attrs["state_json"] = state_json
        f.attrs["tensors_json"] = json.dumps(entries)
        if shards is not None:
            f.attrs[SHARDS_ATTR] = shards
        # Every object stays open until the flush: one whose write fails inside close() is left half-closed,
        # which crashes the process at exit. Kept open, a failing flush raises here with every object intact
        # for _abandon (the flush is also where HDF5 extends the file over the allocated blob).
        blob = _allocated_dataset(f, _BLOB, h5py.h5t.NATIVE_UINT8, blob_nbytes)
        crc = _allocated_dataset(f, _CRC32, h5py.h5t.STD_U32LE, len(entries))
        offsets = (blob.get_offset() if blob_nbytes else None, crc.get_offset() if entries else None)
        f.flush()
    except BaseException:
        _abandon(f, fd)
        raise
    f.close()
    return offsets


def _allocated_dataset(f: h5py.File, name: str, dtype: h5py.h5t.TypeID, length: int) -> h5py.h5d.DatasetID:
    # Contiguous and allocated at creation, so the dataset has a file offset; never filled, so HDF5 writes
    # none of its bytes: they come from pwritev_all.
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    space = h5py.h5s.create_simple((length,))
    return h5py.h5d.create(f.id, name.encode(), dtype, space, dcpl=dcpl)


def _runs(views: list[memoryview]) -> list[tuple[int, int]]:
    """Splits tensors into consecutive runs [first, last) of about _RUN_BYTES each."""
    runs, first, run_bytes = [], 0, 0
    for index, view in enumerate(views):
        run_bytes += view.nbytes
        if run_bytes >= _RUN_BYTES or index == len(views) - 1:
            runs.append((first, index + 1))
            first, run_bytes = index + 1, 0
    return runs


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
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _prune(ckpt_dir: Path, step: int, keep_last: int) -> None:
    found = _checkpoints_by_step(ckpt_dir)
    # File names count steps done (step + 1); a name written before that convention (the step index) sorts
    # before every checkpoint saved after resuming from it, so the comparison holds for both.
    older = [path for steps_done, path in found if steps_done < step + 1]
    abandoned = [path for steps_done, path in found if steps_done > step + 1]
    if abandoned:
        warnings.warn(
            f"deleting checkpoints {[path.name for path in abandoned]} in {ckpt_dir}: their steps are after the step "
            f"{step + 1} just saved: they belong to a timeline the run abandoned when it resumed from an earlier one",
            RuntimeWarning,
            stacklevel=3,
        )
    for path in abandoned + older[: max(0, len(older) - (keep_last - 1))]:
        path.unlink(missing_ok=True)
        if shards_dir(path).is_dir() and not shards_dir(path).is_symlink():
            shutil.rmtree(shards_dir(path))


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
            version = int(f.attrs.get(FORMAT_VERSION_ATTR, _V1_TENSORS_FORMAT_VERSION))
            step = int(f.attrs["step"])
            state = json.loads(f.attrs["state_json"])
            num_tensors = int(f.attrs["num_tensors"])
            shards_json = f.attrs.get(SHARDS_ATTR)
            if version == _V1_TENSORS_FORMAT_VERSION:
                group = f[_TENSORS]
                tensors = {unquote(name): _read_v1_tensor(path, unquote(name), ds) for name, ds in group.items()}
            elif version == CHECKPOINT_FORMAT_VERSION:
                entries = json.loads(f.attrs["tensors_json"])
                blob, crc = f[_BLOB], f[_CRC32]
                blob_offset, blob_nbytes = blob.id.get_offset(), int(blob.shape[0])
                stored_crcs = [int(v) for v in crc[()]] if crc.shape[0] else []
            else:
                raise CheckpointError(
                    f"checkpoint {path} has format version {version}, newer than this hpcrl reads "
                    f"({CHECKPOINT_FORMAT_VERSION}); resume it with the hpcrl version that wrote it"
                )
        if version == CHECKPOINT_FORMAT_VERSION:
            tensors = _read_blob(path, entries, stored_crcs, blob_offset, blob_nbytes)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as error:
        raise CheckpointError(f"cannot read checkpoint {path} ({error}); the file is truncated or corrupt") from error
    if len(tensors) != num_tensors:
        raise CheckpointError(f"checkpoint {path} holds {len(tensors)} tensors instead of {num_tensors}; it is corrupt")
    name_match = _NAME.fullmatch(path.name)
    if name_match and int(name_match.group(1)) not in (step + 1, step):  # steps done, or the older step index
        raise CheckpointError(f"checkpoint {path} records step {step}, which does not match its file name")
    shards = _check_shards(path, str(shards_json)) if shards_json is not None else None
    return Checkpoint(step=step, tensors=tensors, state=state, path=path, shards=shards)


def _read_blob(
    path: Path, entries: list[dict[str, Any]], stored_crcs: list[int], blob_offset: int | None, blob_nbytes: int
) -> dict[str, torch.Tensor]:
    """Reads every tensor straight into its own memory, checking checksums in threads beside the reads."""
    if len(stored_crcs) != len(entries):
        raise CheckpointError(f"checkpoint {path} lists {len(entries)} tensors but {len(stored_crcs)} checksums")
    tensors: dict[str, torch.Tensor] = {}
    views: list[memoryview] = []
    end = 0
    for entry in entries:
        name, dtype_name, shape, offset = entry["name"], entry["dtype"], entry["shape"], entry["offset"]
        dtype = getattr(torch, dtype_name, None)
        if (dtype not in _NATIVE_DTYPES and dtype not in _BITS_DTYPES) or offset != end or name in tensors:
            raise CheckpointError(f"checkpoint {path} has a damaged entry for tensor {name!r}; the file is corrupt")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or end + nbytes > blob_nbytes:  # checked before a huge allocation
            raise CheckpointError(f"checkpoint {path} has a damaged entry for tensor {name!r}; the file is corrupt")
        tensor = torch.empty(shape, dtype=dtype)
        tensors[name] = tensor
        views.append(_raw_bytes(tensor))
        end += nbytes
    if end != blob_nbytes or (end and blob_offset is None):
        raise CheckpointError(f"checkpoint {path} holds {blob_nbytes} tensor bytes, its entries {end}; it is corrupt")

    def verify(first: int, last: int) -> str | None:
        for index in range(first, last):
            entry, view = entries[index], views[index]
            actual = _crc32(entry["name"], entry["dtype"], entry["shape"], view)
            if actual != stored_crcs[index]:
                return (
                    f"tensor {entry['name']!r} of checkpoint {path} fails its checksum (stored "
                    f"{stored_crcs[index]:08x}, computed {actual:08x}); the file is corrupt"
                )
        return None

    checks: list[Future[str | None]] = []
    runs = _runs(views)
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(_CHECKSUM_THREADS, thread_name_prefix="hpcrl-crc") as pool:
            # The checksums of one run overlap the read of the next.
            def check(run: int) -> None:
                checks.append(pool.submit(verify, *runs[run]))

            num_read = read_direct(path, views, blob_offset, runs, check) if end and blob_offset is not None else 0
            # The runs the direct reads did not finish (all of them where the file system refuses O_DIRECT).
            for run in range(num_read, len(runs)):
                first, last = runs[run]
                start = blob_offset + entries[first]["offset"] if blob_offset is not None else 0
                if not preadv_all(fd, views[first:last], start):
                    raise CheckpointError(
                        f"checkpoint {path} ends inside its tensor data; the file is truncated or corrupt"
                    )
                check(run)
            failures = [message for check in checks if (message := check.result()) is not None]
    finally:
        os.close(fd)
    if failures:
        raise CheckpointError(failures[0])
    return tensors


def _v1_digest(dtype_name: str, array: np.ndarray) -> str:
    digest = hashlib.blake2b(f"{dtype_name}{array.shape}".encode(), digest_size=16)
    digest.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def _read_v1_tensor(path: Path, name: str, ds: h5py.Dataset) -> torch.Tensor:
    dtype_name = str(ds.attrs["dtype"])
    array = np.empty(ds.shape, dtype=ds.dtype)
    if array.size:
        ds.read_direct(array)
    expected = str(ds.attrs["blake2b"])
    actual = _v1_digest(dtype_name, array)
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
