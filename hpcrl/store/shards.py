"""Shard files of a checkpoint: each rank of a sharded trainer writes the pieces of the tensors it holds.

A checkpoint of a sharded run is its ``step_NNNNNNNN.h5`` (the tensors every rank holds whole, the JSON state and
the manifest of its shards, ``shards_json``) plus ``step_NNNNNNNN.shards/rank-RRRRR-of-WWWWW.h5``, one file per
rank that holds a distinct piece. A shard file has the checkpoint format of hpcrl/store/checkpoint.py (raw bytes,
CRC-32 per tensor, no pickle); its ``state_json`` says, per tensor, the whole tensor's shape and where the piece
starts in it (``{"rank": R, "world": W, "pieces": {name: {"shape": [...], "offset": [...]}}}``). A piece is a
box: its own shape from that offset.

The ranks write into ``checkpoints/.pending.shards/`` (each file atomic, as a checkpoint file is); the save of the
checkpoint file moves that folder beside it and writes the file last, so a checkpoint whose file exists has every
shard, and a save cut short leaves only shards that the next resume deletes (remove_temp_files). A rank of any rank
count reads back the box it holds: from each file whose pieces overlap it, only the tensors it needs, each checked
against its checksum.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import h5py
import torch

from hpcrl.store.checkpoint import (
    _BITS_DTYPES,
    _BLOB,
    _CRC32,
    _NATIVE_DTYPES,
    CHECKPOINT_FORMAT,
    CHECKPOINT_FORMAT_VERSION,
    PENDING_SHARDS,
    CheckpointError,
    _crc32,
    _host_tensor,
    _raw_bytes,
    write_checkpoint_file,
)
from hpcrl.store.direct_io import preadv_all
from hpcrl.store.metrics_file import FORMAT_ATTR, FORMAT_VERSION_ATTR
from hpcrl.store.run_dir import make_subdir

Box = tuple[list[int], list[int]]  # (offset, shape) inside the whole tensor


def shard_file_name(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.h5"


def clear_pending(ckpt_dir: Path) -> None:
    """Deletes shards left waiting by a save that failed, before the ranks write the next ones."""
    pending = ckpt_dir / PENDING_SHARDS
    if pending.is_dir() and not pending.is_symlink():
        shutil.rmtree(pending)


def write_shard(
    ckpt_dir: Path, rank: int, world: int, pieces: dict[str, tuple[torch.Tensor, list[int], list[int]]]
) -> Path:
    """Writes this rank's pieces ({name: (local tensor, whole shape, offset)}) for the next checkpoint of
    `ckpt_dir`, atomically. Every rank calls it, a file each (an empty one where a rank holds no distinct piece,
    so that the files say how many ranks wrote)."""
    folder = make_subdir(ckpt_dir / PENDING_SHARDS)
    host = {name: _host_tensor(name, local) for name, (local, _, _) in pieces.items()}
    layout = {
        name: {"shape": [int(n) for n in shape], "offset": [int(n) for n in offset]}
        for name, (_, shape, offset) in pieces.items()
    }
    path = folder / shard_file_name(rank, world)
    write_checkpoint_file(path, -1, host, json.dumps({"rank": rank, "world": world, "pieces": layout}))
    return path


class _ShardFile:
    """One shard file's index: where each tensor's bytes are, its checksum and its box."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with h5py.File(path, "r") as f:
                if f.attrs.get(FORMAT_ATTR) != CHECKPOINT_FORMAT or (
                    int(f.attrs.get(FORMAT_VERSION_ATTR, 0)) != CHECKPOINT_FORMAT_VERSION
                ):
                    raise CheckpointError(f"shard file {path} is not an hpcrl checkpoint shard")
                state = json.loads(f.attrs["state_json"])
                entries = json.loads(f.attrs["tensors_json"])
                blob, crc = f[_BLOB], f[_CRC32]
                self.blob_offset = blob.id.get_offset()
                crcs = [int(v) for v in crc[()]] if crc.shape[0] else []
        except CheckpointError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as error:
            raise CheckpointError(f"cannot read shard file {path} ({error}); it is truncated or corrupt") from error
        if len(crcs) != len(entries):
            raise CheckpointError(f"shard file {path} lists {len(entries)} tensors but {len(crcs)} checksums")
        self.world = int(state["world"])
        self.entries = {e["name"]: (e, crc) for e, crc in zip(entries, crcs, strict=True)}
        pieces = state["pieces"]
        self.boxes: dict[str, Box] = {
            name: (list(piece["offset"]), list(self.entries[name][0]["shape"])) for name, piece in pieces.items()
        }
        self.shapes = {name: list(piece["shape"]) for name, piece in state["pieces"].items()}

    def read(self, name: str) -> torch.Tensor:
        entry, stored = self.entries[name]
        dtype = getattr(torch, entry["dtype"], None)
        if dtype not in _NATIVE_DTYPES and dtype not in _BITS_DTYPES:
            raise CheckpointError(f"shard file {self.path} has a damaged entry for tensor {name!r}; it is corrupt")
        tensor = torch.empty(entry["shape"], dtype=dtype)
        view = _raw_bytes(tensor)
        if view.nbytes:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                if self.blob_offset is None or not preadv_all(fd, [view], self.blob_offset + int(entry["offset"])):
                    raise CheckpointError(f"shard file {self.path} ends inside its tensor data; it is truncated")
            finally:
                os.close(fd)
        actual = _crc32(name, entry["dtype"], entry["shape"], view)
        if actual != stored:
            raise CheckpointError(
                f"tensor {name!r} of shard file {self.path} fails its checksum (stored {stored:08x}, computed "
                f"{actual:08x}); the file is corrupt: resume from an earlier checkpoint (move this one's "
                f"{self.path.parent.with_suffix('.h5').name} away)"
            )
        return tensor


class ShardReader:
    """Reads boxes of the whole tensors a checkpoint's shard files hold, on any rank count."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files = [_ShardFile(p) for p in sorted(folder.glob("rank-*-of-*.h5"))]
        worlds = {f.world for f in self.files}
        if len(worlds) != 1 or len(self.files) != next(iter(worlds)):
            raise CheckpointError(
                f"the shards of {folder} are {len(self.files)} files written by rank counts {sorted(worlds)}; "
                "the checkpoint is incomplete"
            )

    def names(self) -> set[str]:
        return {name for f in self.files for name in f.boxes}

    def shape(self, name: str) -> list[int]:
        for f in self.files:
            if name in f.shapes:
                return f.shapes[name]
        raise KeyError(name)

    def read(self, name: str, offset: list[int], shape: list[int]) -> torch.Tensor:
        """The box of tensor `name` from `offset` of size `shape`, put together from the pieces that overlap it
        (each piece read whole, checksum checked); refused where the pieces leave part of it uncovered."""
        out: torch.Tensor | None = None
        covered = 0
        for f in self.files:
            box = f.boxes.get(name)
            if box is None:
                continue
            if not math.prod(shape):  # an empty box (a rank past a short tensor's end): only its dtype is read
                return torch.empty(shape, dtype=getattr(torch, f.entries[name][0]["dtype"]))
            lo = [max(a, b) for a, b in zip(offset, box[0], strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, box[0], box[1], strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            piece = f.read(name)
            if out is None:
                out = torch.empty(shape, dtype=piece.dtype)
            src = tuple(slice(a - b, h - b) for a, h, b in zip(lo, hi, box[0], strict=True))
            dst = tuple(slice(a - b, h - b) for a, h, b in zip(lo, hi, offset, strict=True))
            out[dst] = piece[src]
            covered += math.prod(h - a for a, h in zip(lo, hi, strict=True))
        if out is None or covered != math.prod(shape):
            raise CheckpointError(
                f"the shards of {self.folder} do not cover tensor {name!r} at {offset} + {shape}; the checkpoint is "
                "incomplete"
            )
        return out
