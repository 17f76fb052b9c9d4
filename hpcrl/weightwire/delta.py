"""The disk-delta format: weight versions as files on a shared file system, each a delta against the version
before it or a full snapshot, read by engines that patch their own weights.

A directory holds, per published version v (8 digits, so names sort by version):
  delta-0000000v.bin / .json      what changed since v-1 (base_version v-1)
  snapshot-0000000v.bin / .json   every tensor whole (base_version null)
The `.bin` holds each tensor's payload back to back (a "raw" one starts at a multiple of 64 bytes); the `.json`
(the manifest) is written last, through a temporary file, fsync and a rename, so a version exists exactly when its
manifest does: a writer killed midway leaves a `.bin` without a manifest, which no reader opens.
The manifest lists per tensor:
  name, dtype, shape
  encoding   "same" (nothing changed, no payload), "xor" (zlib of new XOR old bits, whole tensor),
             "index" (zlib of the changed elements' index gaps as uint32, then their new bits), "raw" (the new
             bits as they are; snapshots), "full" (zlib of the new bits; snapshots of earlier writers, still read)
  offset, nbytes, crc32   where the payload lies in the .bin and the CRC-32 of its bytes (checked before any
                          write into a model: a payload that fails it is never applied)
  result_crc32            the CRC-32 of the tensor's new bits (checked after a patch: a base that differed from
                          the writer's shows here)
  changed                 how many elements changed
CRC-32 detects storage and transfer corruption; it authenticates nothing (the directory is the run's own,
docs/security.md). Per tensor the writer picks "index" when under INDEX_SHARE of the elements changed and "xor"
otherwise, and compresses with zlib's run-length strategy (Z_RLE: any inflate reads it), which on bf16 deltas is
both faster and smaller than zlib's default. Snapshots are not compressed: zlib takes 40-80 s per GB of bf16
weights to save a fifth of the bytes, which the disk writes in well under a second. Nothing here imports from hpcrl.

`.hpcrl-shared-probe.json` holds a random nonce the trainer writes when the run starts (`write_probe`); every
process that reads versions on another node checks at its start that it sees that nonce there (`check_probe`):
a directory that is not shared between the nodes (a node-local /tmp, a home that differs per node) is refused
before the first push instead of failing at it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "hpcrl-weight-delta/1"
KINDS = ("delta", "snapshot")
ENCODINGS = ("same", "xor", "index", "raw", "full")
_NAME = re.compile(r"^(delta|snapshot)-(\d{8})\.json$")
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_NP_BITS = {torch.int16: np.int16, torch.int32: np.int32}
ZLIB_LEVEL = 1  # the payload is mostly zeros: level 1 gets nearly all of the gain at a fraction of the time
INDEX_SHARE = 1 / 32
"""Below this share of changed elements a delta is encoded as index+value, above it as XOR. Measured on bf16 weights
changed by one unit in the last place (zlib Z_RLE): index+value costs 3.0 bytes per changed element at a 2% share,
the XOR 2.0, but the XOR compresses 2 bytes of every element where index+value compresses 6 of every changed one,
so below 1/32 index+value is several times faster to write and to apply for at most 1.5x the bytes; at 15% the XOR
is both faster and half the size."""


def _compress(data: Payload) -> bytes:
    """zlib with the run-length strategy: a delta is runs of zero bytes between changes, which Z_RLE finds at
    about twice the speed of the default strategy's searches, in fewer bytes."""
    packer = zlib.compressobj(ZLIB_LEVEL, zlib.DEFLATED, 15, 8, zlib.Z_RLE)
    return packer.compress(data) + packer.flush()


class DeltaFormatError(ValueError):
    """A manifest or payload that is not what the format says (unreadable, wrong checksum, wrong base)."""


def manifest_name(kind: str, version: int) -> str:
    return f"{kind}-{version:08d}.json"


def data_name(kind: str, version: int) -> str:
    return f"{kind}-{version:08d}.bin"


def parse_manifest_name(name: str) -> tuple[str, int] | None:
    """(kind, version) of a manifest's file name; None for any other file."""
    match = _NAME.match(name)
    return (match.group(1), int(match.group(2))) if match else None


def published(directory: Path) -> dict[str, list[int]]:
    """The versions that have a manifest in `directory`, by kind, ascending."""
    out: dict[str, list[int]] = {kind: [] for kind in KINDS}
    if directory.is_dir():
        for entry in os.scandir(directory):
            parsed = parse_manifest_name(entry.name)
            if parsed is not None:
                out[parsed[0]].append(parsed[1])
    return {kind: sorted(versions) for kind, versions in out.items()}


def bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bits as a flat integer array on the CPU (bf16/fp16 as int16, fp32 as int32)."""
    int_dtype = _BITS.get(tensor.dtype)
    if int_dtype is None:
        raise ValueError(f"dtype {tensor.dtype} has no disk-delta encoding; use one of {sorted(map(str, _BITS))}")
    return tensor.detach().contiguous().view(int_dtype).reshape(-1).cpu().numpy()


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype that holds `dtype`'s bits."""
    return _BITS[dtype]


Payload = bytes | memoryview


def crc32(data: np.ndarray | Payload) -> int:
    if isinstance(data, np.ndarray):
        return zlib.crc32(np.ascontiguousarray(data).data.cast("B"))
    return zlib.crc32(data)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    encoding: str
    offset: int
    nbytes: int
    crc32: int
    result_crc32: int
    changed: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def encode(old: np.ndarray | None, new: np.ndarray) -> tuple[str, Payload, int]:
    """(encoding, payload, changed elements) of `new` against `old` (bits from `bits`); None: a snapshot's payload,
    `new`'s own memory (keep `new` unchanged until the payload is written)."""
    if old is None:
        return "raw", new.data.cast("B"), int(new.size)
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(
            f"the previous version holds {old.dtype}{list(old.shape)}, this one {new.dtype}{list(new.shape)}"
        )
    differs = np.not_equal(old, new)
    changed = int(np.count_nonzero(differs))
    if changed == 0:
        return "same", b"", 0
    if changed >= INDEX_SHARE * new.size or new.size >= 2**32:
        del differs
        return "xor", _compress(np.bitwise_xor(old, new).data.cast("B")), changed
    index = np.flatnonzero(differs)  # on booleans: twice as fast as on the integers
    del differs
    gaps = np.diff(index, prepend=0).astype(np.uint32)
    return "index", _compress(gaps.tobytes() + new[index].tobytes()), changed


XorPatch = np.ndarray
"""A delta entry's patch as the XOR of old and new bits, flat, every element."""
IndexPatch = tuple[np.ndarray, np.ndarray]
"""A delta entry's patch as the changed elements' flat indices (int64, ascending) and their new bits."""


def decode_patch(entry: TensorEntry, payload: Payload, dtype: torch.dtype) -> XorPatch | IndexPatch:
    """A delta entry's patch for a parameter of `dtype` (CPU arrays; thread-safe, the GIL mostly released).
    `payload` has passed its CRC; every size and index is checked here, before the patch reaches a parameter."""
    if entry.encoding not in ("xor", "index"):
        raise DeltaFormatError(f"{entry.name}: encoding {entry.encoding!r} is not a patch")
    try:
        raw = zlib.decompress(payload)
    except zlib.error as exc:
        raise DeltaFormatError(f"{entry.name}: the payload does not decompress ({exc})") from exc
    np_dtype = _NP_BITS[_BITS[dtype]]
    if entry.encoding == "xor":
        xor = np.frombuffer(raw, dtype=np_dtype)
        if xor.size != entry.numel:
            raise DeltaFormatError(f"{entry.name}: the xor payload holds {xor.size} elements, not {entry.numel}")
        return xor.copy()  # writable, for torch.from_numpy (a copy on the pool thread, not the scheduler's)
    count = len(raw) // (4 + np.dtype(np_dtype).itemsize)
    gaps = np.frombuffer(raw, dtype=np.uint32, count=count)
    values = np.frombuffer(raw, dtype=np_dtype, offset=4 * count)
    if values.size != count:
        raise DeltaFormatError(f"{entry.name}: the index payload is cut short")
    index = np.cumsum(gaps, dtype=np.int64)
    if count and int(index[-1]) >= entry.numel:
        raise DeltaFormatError(f"{entry.name}: an index lies past the tensor's {entry.numel} elements")
    return index, values.copy()


def decode_full(entry: TensorEntry, payload: Payload, dtype: torch.dtype) -> torch.Tensor:
    """A snapshot entry's tensor (CPU, its own dtype and shape; a "raw" one shares the payload's memory, which
    `read_payloads` makes writable); its result CRC checked."""
    np_dtype = _NP_BITS[_BITS[dtype]]
    if entry.encoding == "raw":
        if len(payload) != entry.numel * np.dtype(np_dtype).itemsize or entry.crc32 != entry.result_crc32:
            raise DeltaFormatError(f"{entry.name}: the snapshot's tensor fails its checksum")
        # The payload passed its CRC in read_payloads, and for raw bits that CRC is the result's.
        return torch.from_numpy(np.frombuffer(payload, dtype=np_dtype)).view(dtype).view(entry.shape)
    if entry.encoding != "full":
        raise DeltaFormatError(f"{entry.name}: encoding {entry.encoding!r} is not a snapshot's")
    flat = np.frombuffer(zlib.decompress(payload), dtype=np_dtype)
    if flat.size != entry.numel or crc32(flat) != entry.result_crc32:
        raise DeltaFormatError(f"{entry.name}: the snapshot's tensor fails its checksum")
    return torch.from_numpy(flat.copy()).view(dtype).view(entry.shape)


@dataclass(frozen=True)
class Manifest:
    version: int
    kind: str
    base_version: int | None
    data: str
    data_bytes: int
    tensors: list[TensorEntry]
    format: str = FORMAT

    def to_json(self) -> bytes:
        body = asdict(self)
        return (json.dumps(body, indent=None, separators=(",", ":")) + "\n").encode()


def read_manifest(path: Path) -> Manifest:
    """The manifest at `path`; DeltaFormatError naming what is wrong with it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            body: dict[str, Any] = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise DeltaFormatError(f"cannot read the weight manifest {path}: {exc}") from exc
    if body.get("format") != FORMAT:
        raise DeltaFormatError(f"{path} is format {body.get('format')!r}, this hpcrl reads {FORMAT!r}")
    try:
        tensors = [TensorEntry(**t) for t in body["tensors"]]
        manifest = Manifest(**{**body, "tensors": tensors})
    except (KeyError, TypeError) as exc:
        raise DeltaFormatError(f"the weight manifest {path} is malformed: {exc}") from exc
    if manifest.kind not in KINDS or any(t.encoding not in ENCODINGS for t in tensors):
        raise DeltaFormatError(f"the weight manifest {path} names an unknown kind or encoding")
    if parse_manifest_name(path.name) != (manifest.kind, manifest.version):
        raise DeltaFormatError(f"the weight manifest {path} holds {manifest.kind} {manifest.version}, not its name's")
    return manifest


def read_payloads(path: Path, manifest: Manifest) -> dict[str, memoryview]:
    """Every tensor's payload from the manifest's data file, each CRC checked: DeltaFormatError before anything is
    returned when one fails (so a corrupt version is never half applied)."""
    data = path.parent / manifest.data
    try:
        fd = os.open(data, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != manifest.data_bytes:
                raise DeltaFormatError(f"{data} holds {size} bytes, its manifest says {manifest.data_bytes}")
            blob = bytearray(size)  # writable: a raw snapshot's tensors are used in place, without a copy
            got = f.readinto(blob)
    except OSError as exc:
        raise DeltaFormatError(f"cannot read {data}: {exc}") from exc
    if got != manifest.data_bytes:
        raise DeltaFormatError(f"{data} holds {got} bytes, its manifest says {manifest.data_bytes}")
    view = memoryview(blob)  # slices of it share the one read buffer
    out: dict[str, memoryview] = {}
    for entry in manifest.tensors:
        payload = view[entry.offset : entry.offset + entry.nbytes]
        if len(payload) != entry.nbytes or crc32(payload) != entry.crc32:
            raise DeltaFormatError(
                f"{data}: the payload of {entry.name!r} fails its checksum (the file is corrupt); nothing of "
                f"{manifest.kind} {manifest.version} was applied"
            )
        out[entry.name] = payload
    return out


PROBE = ".hpcrl-shared-probe.json"


class DeltaDirNotShared(RuntimeError):
    """The weight directory a process sees is not the one the trainer writes (not shared between their nodes)."""


def write_probe(directory: Path) -> str:
    """Write a fresh nonce into `directory`'s probe file, atomically (a reader sees the old file or the new one);
    the nonce, for the readers to compare (they learn it through the run directory)."""
    nonce = secrets.token_hex(16)
    body = json.dumps({"nonce": nonce, "host": socket.gethostname(), "time_s": time.time()}).encode()
    path = directory / PROBE
    tmp = directory / f".{PROBE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return nonce


def read_probe(directory: Path) -> dict[str, Any] | None:
    """The probe file's content as this process sees it (None: none there, or unreadable)."""
    try:
        fd = os.open(directory / PROBE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            body = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def check_probe(directory: Path, nonce: str, *, wait_s: float = 0.0, poll_s: float = 0.5) -> None:
    """Return when this process sees `nonce` in `directory`'s probe; DeltaDirNotShared naming the directory, this
    node and the fix otherwise. `wait_s`: how long a file system that shows writes late may take."""
    deadline = time.monotonic() + wait_s
    while True:
        probe = read_probe(directory)
        if probe is not None and probe.get("nonce") == nonce:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    if probe is None:
        seen = "no probe file there" if directory.is_dir() else "no such directory"
    else:
        seen = f"another run's probe (written on {probe.get('host')!r})"
    raise DeltaDirNotShared(
        f"the weight directory {directory} is not shared between the trainer's node and this node "
        f"({socket.gethostname()}): this node sees {seen}, not the probe the trainer wrote there. Put sync.delta_dir "
        "on a file system both nodes mount (e.g. leave it unset: the run directory's weights/ on the cluster's "
        "shared file system), not a node-local path such as /tmp or a per-node home"
    )
