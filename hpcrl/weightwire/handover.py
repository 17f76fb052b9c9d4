"""Same-host weight handover in one flat buffer: shared memory on CPU, one CUDA IPC handle on GPU.

Handing tensors over one by one costs an IPC handle (and on CUDA an event and a mapping) per tensor:
seconds for a 0.6B model. One flat buffer costs one mapping, then plain copies.

The payload is JSON (no pickle): the receiver never unpickles request data. Whoever can reach an engine's
port may send one, so the engine maps only what this user's create_handover made (docs/security.md): a
0600 file of the announced size in the private directory /dev/shm/hpcrl-<uid>/ (0700), named by a random
token, in a payload whose HMAC-SHA256 under a per-user key file only this user can read matches.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import hmac
import json
import mmap
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hpcrl.weightwire.buckets import DTYPES, dtype_name

_ALIGN = 256
_FILE_PREFIX, _FILE_SUFFIX = "hpcrl-weights-", ".bin"
_FILE_NAME = re.compile(re.escape(_FILE_PREFIX) + "[0-9a-f]{32}" + re.escape(_FILE_SUFFIX))
_KEY_NAME, _KEY_BYTES = "handover.key", 32


class UntrustedHandoverError(PermissionError):
    """A handover the engine refuses to map: the message names the rule it breaks."""


def _layout(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[dict[str, Any]], int]:
    entries, offset = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return entries, max(offset, _ALIGN)


def _handover_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def private_dir() -> str:
    """This user's handover directory, created 0700 on first use; refused when anyone else could write it.

    Sender and engine are the same user on the same host (a handover maps the sender's memory), so both
    compute the same directory and neither ever names a file outside it.
    """
    path = os.path.join(_handover_root(), f"hpcrl-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedHandoverError(
            f"{path} is not a directory (a symlink or file is in the place of hpcrl's private handover "
            f"directory); remove it and retry"
        )
    if st.st_uid != os.getuid():
        raise UntrustedHandoverError(
            f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): someone else made hpcrl's "
            "private handover directory; have it removed (ask the node's administrator) and retry"
        )
    if st.st_mode & 0o077:
        raise UntrustedHandoverError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}; hpcrl's private handover directory must be 0700 "
            f"(no access for group or others): run `chmod 700 {path}`"
        )
    return path


def _check_private_file(fd: int, path: str, *, size: int | None) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedHandoverError(f"{path} is not a regular file; a handover is a regular file")
    if st.st_uid != os.getuid():
        raise UntrustedHandoverError(f"{path} belongs to uid {st.st_uid}; a handover file must be this user's")
    if stat.S_IMODE(st.st_mode) != 0o600:
        raise UntrustedHandoverError(f"{path} has mode {stat.S_IMODE(st.st_mode):o}; a handover file must be 0600")
    if size is not None and st.st_size != size:
        raise UntrustedHandoverError(f"{path} holds {st.st_size} bytes, the payload announces {size}")


def _open_private(path: str, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedHandoverError(f"{path} is a symlink; a handover file must not be one") from exc
        raise


def _mac_key() -> bytes:
    """The per-user secret that signs payloads: a 0600 file in the private directory, made once.

    Why not the engine's API key: whoever holds it passes the Bearer check anyway, an engine on loopback may
    have none, and one bucket goes to several engines with different keys. Only this user can read the file.
    """
    folder = private_dir()
    path = os.path.join(folder, _KEY_NAME)
    for _ in range(2):
        try:
            fd = _open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            _make_key(folder, path)
            continue
        try:
            _check_private_file(fd, path, size=_KEY_BYTES)
            return os.read(fd, _KEY_BYTES)
        finally:
            os.close(fd)
    raise UntrustedHandoverError(f"{path} disappeared while it was read; retry")


def _make_key(folder: str, path: str) -> None:
    # Written whole under a temporary name, then linked into place: a reader never sees half a key, and of
    # two processes making it at once the second keeps the first one's.
    tmp = os.path.join(folder, f".key-{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secrets.token_bytes(_KEY_BYTES))
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def _mac(payload: dict[str, Any]) -> str:
    fields = {k: v for k, v in payload.items() if k != "mac"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(_mac_key(), canonical, hashlib.sha256).hexdigest()


def _sealed(payload: dict[str, Any]) -> str:
    payload = {**payload, "mac": _mac(payload)}
    return base64.b64encode(json.dumps(payload).encode()).decode()


@contextlib.contextmanager
def create_handover(named: Sequence[tuple[str, torch.Tensor]]) -> Iterator[str]:
    """Pack tensors into one shared buffer; yields the base64 payload for serialized_named_tensors.

    The buffer lives until the context exits: keep it open until the engine has answered.
    """
    entries, nbytes = _layout(named)
    device = named[0][1].device if named else torch.device("cpu")
    if device.type == "cuda":
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _pack(flat, named, entries)
        torch.cuda.current_stream(device).synchronize()
        storage = flat.untyped_storage()
        (dev, handle, size, off, ref_handle, ref_off, event_handle, event_sync) = storage._share_cuda_()
        payload = {
            "kind": "cuda_ipc",
            "device": dev,
            "handle": base64.b64encode(handle).decode(),
            "storage_size": size,
            "storage_offset": off,
            "ref_counter_handle": base64.b64encode(ref_handle).decode(),
            "ref_counter_offset": ref_off,
            "event_handle": base64.b64encode(event_handle).decode() if event_handle else None,
            "event_sync_required": bool(event_sync),
            "nbytes": nbytes,
            "tensors": entries,
        }
        try:
            yield _sealed(payload)
        finally:
            del flat
        return
    path = os.path.join(private_dir(), f"{_FILE_PREFIX}{secrets.token_hex(16)}{_FILE_SUFFIX}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes, access=mmap.ACCESS_WRITE) as mm:
            flat = torch.frombuffer(mm, dtype=torch.uint8)
            _pack(flat, named, entries)
            del flat
        os.close(fd)
        fd = -1
        yield _sealed({"kind": "shm", "path": path, "nbytes": nbytes, "tensors": entries})
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _pack(flat: torch.Tensor, named: Sequence[tuple[str, torch.Tensor]], entries: list[dict[str, Any]]) -> None:
    for (_, t), e in zip(named, entries, strict=True):
        src = t.detach().contiguous().view(-1).view(torch.uint8)
        flat[e["offset"] : e["offset"] + src.numel()].copy_(src)


def decode_payload(serialized: str) -> dict[str, Any]:
    """The payload, with its fields and tensor layout checked (ValueError names the first bad field)."""
    try:
        payload = json.loads(base64.b64decode(serialized, validate=True))
    except (ValueError, json.JSONDecodeError) as exc:
        raise ValueError(
            "serialized_named_tensors[0] is not an hpcrl handover payload (base64 JSON). The embedded engine "
            "does not unpickle SGLang's MultiprocessingSerializer format; use hpcrl.weightwire.handover.create_handover"
        ) from exc
    if not isinstance(payload, dict) or payload.get("kind") not in ("shm", "cuda_ipc"):
        raise ValueError("handover payload kind must be 'shm' or 'cuda_ipc'")
    nbytes = payload.get("nbytes")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ValueError("handover payload field 'nbytes' must be a positive integer (the buffer's size)")
    if payload["kind"] == "shm" and not isinstance(payload.get("path"), str):
        raise ValueError("handover payload field 'path' must be a string (the shared-memory file)")
    tensors = payload.get("tensors")
    if not isinstance(tensors, list):
        raise ValueError(
            "handover payload field 'tensors' is missing or not a list; it lists {name, dtype, shape, offset} "
            "per tensor"
        )
    for i, e in enumerate(tensors):
        _check_entry(i, e, nbytes)
    if not isinstance(payload.get("mac"), str):
        raise ValueError(
            "handover payload field 'mac' is missing: make payloads with hpcrl.weightwire.handover.create_handover"
        )
    return payload


def _check_entry(i: int, e: Any, nbytes: int) -> None:
    where = f"handover payload tensors[{i}]"
    if not isinstance(e, dict) or set(e) != {"name", "dtype", "shape", "offset"}:
        raise ValueError(f"{where} must be an object with exactly the fields name, dtype, shape, offset")
    if not isinstance(e["name"], str):
        raise ValueError(f"{where}.name must be a string")
    if e["dtype"] not in DTYPES:
        raise ValueError(f"{where}.dtype {e['dtype']!r} is not one of {', '.join(DTYPES)}")
    shape, offset = e["shape"], e["offset"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"{where}.shape must be a list of non-negative integers")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"{where}.offset must be a non-negative integer")
    itemsize = DTYPES[e["dtype"]].itemsize
    if offset % itemsize:
        raise ValueError(f"{where}.offset {offset} is not a multiple of its dtype's {itemsize} bytes")
    size = int(torch.Size(shape).numel()) * itemsize
    if offset + size > nbytes:
        raise ValueError(f"{where} ({e['name']}) ends at byte {offset + size}, past the buffer's {nbytes} bytes")


def _verify(payload: dict[str, Any]) -> None:
    if not hmac.compare_digest(str(payload["mac"]), _mac(payload)):
        raise UntrustedHandoverError(
            "handover payload's mac does not match: it was not made by create_handover of this user on this host "
            "(or it was altered)"
        )


def _check_path(path: str) -> None:
    folder = private_dir()
    name = os.path.basename(path)
    if os.path.dirname(path) != folder or not _FILE_NAME.fullmatch(name):
        raise UntrustedHandoverError(
            f"handover file {path} is not in this user's private handover directory {folder} under a name "
            f"create_handover makes ({_FILE_PREFIX}<32 hex>{_FILE_SUFFIX}); the engine maps no other file"
        )


@contextlib.contextmanager
def _map_shm(payload: dict[str, Any]) -> Iterator[torch.Tensor]:
    path, nbytes = payload["path"], int(payload["nbytes"])
    _check_path(path)
    _verify(payload)
    try:
        fd = _open_private(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise ValueError(
            f"handover file {path} does not exist: the sender must keep it until the engine answers"
        ) from exc
    try:
        _check_private_file(fd, path, size=nbytes)
        # Mapped from the descriptor just checked, never reopened by name: no swap in between.
        mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    try:
        yield torch.frombuffer(mm, dtype=torch.uint8)
    finally:
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            mm.close()


@contextlib.contextmanager
def open_handover(payload: dict[str, Any], *, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Map the sender's buffer and yield (name, tensor) views of it; views die with the context.

    `payload` comes from decode_payload. A shared-memory file is mapped only when it is this user's regular
    0600 file of the announced size in the private directory, named as create_handover names it, and the
    payload's mac (HMAC-SHA256 under this user's key) matches; UntrustedHandoverError says which rule failed.
    """
    if payload["kind"] == "shm":
        with _map_shm(payload) as flat:
            with _views(payload, flat) as named:
                yield named
        return
    if device.type != "cuda":
        raise ValueError("a cuda_ipc handover needs an engine on CUDA")
    _verify(payload)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    def b(x: str | None) -> bytes:
        return base64.b64decode(x) if x else b""

    nbytes = int(payload["nbytes"])
    flat = rebuild_cuda_tensor(
        torch.Tensor,
        (nbytes,),
        (1,),
        0,
        torch.storage.UntypedStorage,
        torch.uint8,
        int(payload["device"]),
        b(payload["handle"]),
        int(payload["storage_size"]),
        int(payload["storage_offset"]),
        False,
        b(payload["ref_counter_handle"]),
        int(payload["ref_counter_offset"]),
        b(payload["event_handle"]) if payload["event_handle"] else None,
        bool(payload["event_sync_required"]),
    )
    try:
        with _views(payload, flat) as named:
            yield named
    finally:
        del flat


@contextlib.contextmanager
def _views(payload: dict[str, Any], flat: torch.Tensor) -> Iterator[list[tuple[str, torch.Tensor]]]:
    named: list[tuple[str, torch.Tensor]] = []
    for e in payload["tensors"]:
        dtype = DTYPES[e["dtype"]]
        numel = int(torch.Size(e["shape"]).numel())
        nbytes = numel * dtype.itemsize
        raw = flat[e["offset"] : e["offset"] + nbytes]
        named.append((e["name"], raw.view(dtype).view(e["shape"])))
    try:
        yield named
    finally:
        del named
