"""Same-host weight handover in one flat buffer: shared memory on CPU, one CUDA IPC handle on GPU.

Handing tensors over one by one costs an IPC handle (and on CUDA an event and a mapping) per tensor:
seconds for a 0.6B model. One flat buffer costs one mapping, then plain copies.

The payload is JSON (no pickle): the receiver never unpickles request data.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_ALIGN = 256
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"cannot hand over dtype {name}; supported: {', '.join(_DTYPES)}")
    return name


def _layout(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[dict[str, Any]], int]:
    entries, offset = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return entries, max(offset, _ALIGN)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


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
            yield base64.b64encode(json.dumps(payload).encode()).decode()
        finally:
            del flat
        return
    fd, path = tempfile.mkstemp(prefix="hpcrl-weights-", suffix=".bin", dir=_shm_dir())
    os.close(fd)
    try:
        flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        _pack(flat, named, entries)
        payload = {"kind": "shm", "path": path, "nbytes": nbytes, "tensors": entries}
        yield base64.b64encode(json.dumps(payload).encode()).decode()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _pack(flat: torch.Tensor, named: Sequence[tuple[str, torch.Tensor]], entries: list[dict[str, Any]]) -> None:
    for (_, t), e in zip(named, entries, strict=True):
        src = t.detach().contiguous().view(-1).view(torch.uint8)
        flat[e["offset"] : e["offset"] + src.numel()].copy_(src)


def decode_payload(serialized: str) -> dict[str, Any]:
    try:
        payload = json.loads(base64.b64decode(serialized, validate=True))
    except (ValueError, json.JSONDecodeError) as exc:
        raise ValueError(
            "serialized_named_tensors[0] is not an hpcrl handover payload (base64 JSON). The embedded engine "
            "does not unpickle SGLang's MultiprocessingSerializer format; use hpcrl.sync.handover.create_handover"
        ) from exc
    if not isinstance(payload, dict) or payload.get("kind") not in ("shm", "cuda_ipc"):
        raise ValueError("handover payload kind must be 'shm' or 'cuda_ipc'")
    return payload


@contextlib.contextmanager
def open_handover(payload: dict[str, Any], *, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Map the sender's buffer and yield (name, tensor) views of it; views die with the context."""
    if payload["kind"] == "shm":
        path = payload["path"]
        if not os.path.isfile(path):
            raise ValueError(f"handover file {path} does not exist: the sender must keep it until the engine answers")
        flat = torch.from_file(path, shared=False, size=int(payload["nbytes"]), dtype=torch.uint8)
    else:
        if device.type != "cuda":
            raise ValueError("a cuda_ipc handover needs an engine on CUDA")
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
    named = []
    for e in payload["tensors"]:
        dtype = _DTYPES[e["dtype"]]
        numel = int(torch.Size(e["shape"]).numel())
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        raw = flat[e["offset"] : e["offset"] + nbytes]
        named.append((e["name"], raw.view(dtype).view(e["shape"])))
    try:
        yield named
    finally:
        del named, flat
