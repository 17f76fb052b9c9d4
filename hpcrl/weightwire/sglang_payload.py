"""Weights for a stock SGLang server's `/update_weights_from_tensor`, made without importing sglang.

SGLang 0.5.16 accepts only its own payload there (sglang-contract.md, "Verified against a real server"):
each entry of `serialized_named_tensors` (one per TP rank) is base64 of a `ForkingPickler` dump, read back
by SGLang's `SafeUnpickler`, which loads classes from an allowlist of module prefixes (`builtins.`,
`types.`, `torch.`, `sglang.srt.weight_sync.tensor_bucket.`, ...). Anything else makes the scheduler raise
and the whole server exit. With `load_format="flattened_bucket"` the pickled object is
`{"flattened_tensor": uint8 CUDA tensor, "metadata": [m, ...]}`, and SGLang reads only the attributes
`name, shape, dtype, start_idx, end_idx, numel` of each `m` (weight_updater.py,
`_update_weights_from_flattened_bucket`): a `types.SimpleNamespace` carries them through the allowlist,
so hpcrl needs no sglang class to build it. One bucket is then one CUDA IPC handle, not one per tensor.

The CUDA tensor is reduced as SGLang's own sender does (utils/patch_torch.py): the device index in the
IPC arguments becomes the device's UUID, which SGLang's patched rebuild maps back to its local index,
so a server whose CUDA_VISIBLE_DEVICES numbers the GPU differently still opens the right one.

The embedded engine never unpickles: it takes hpcrl's JSON handover (hpcrl/weightwire/handover.py).
"""

from __future__ import annotations

import base64
import contextlib
import copyreg
import io
import types
from collections.abc import Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

LOAD_FORMAT = "flattened_bucket"
# Position of the device index in torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments
# (unchanged for years; SGLang patches the same index).
_DEVICE_ARG = 6


def flatten_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """One uint8 buffer holding every tensor's bytes, and the metadata SGLang rebuilds them from."""
    if not named:
        raise ValueError("cannot hand over an empty bucket")
    parts, metadata, start = [], [], 0
    for name, t in named:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=torch.Size(t.shape),
                dtype=t.dtype,
                start_idx=start,
                end_idx=start + flat.numel(),
                numel=flat.numel(),
            )  # fmt: skip
        )
        parts.append(flat)
        start += flat.numel()
    return torch.cat(parts), metadata


def _reduce_cuda_tensor_by_uuid(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def serialize(obj: object) -> str:
    """base64 of a ForkingPickler dump, as SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`."""
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    table = copyreg.dispatch_table.copy()
    table.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]  # torch registers tensors here
    table[torch.Tensor] = _reduce_cuda_tensor_by_uuid
    table[torch.nn.Parameter] = _reduce_cuda_tensor_by_uuid
    pickler.dispatch_table = table
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


@contextlib.contextmanager
def sglang_bucket_payload(named: Sequence[tuple[str, torch.Tensor]], *, tp_size: int) -> Iterator[list[str]]:
    """`serialized_named_tensors` for one bucket (the same handle for every TP rank: each rank loads its
    own shard from the full tensors). The buffer lives until the context exits: keep it open until the
    server has answered, since the server maps it in place."""
    flat, metadata = flatten_bucket(named)
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()
    payload = serialize({"flattened_tensor": flat, "metadata": metadata})
    try:
        yield [payload] * tp_size
    finally:
        del flat
