"""The embedded engine's side of disk-delta weight versions (format: hpcrl/weightwire/delta.py): bring the model to
the version a manifest names, strictly in version order, patching the parameters in place.

Plan for a request naming version t:
  a snapshot manifest                       load it whole
  a delta, the engine holds t               nothing
  a delta, the engine holds a < t cleanly   the deltas a+1 .. t, each on the one before (base_version checked)
  otherwise (fresh, unknown, or broken)     the newest snapshot s <= t, then the deltas s+1 .. t
Before a version is written into the model every payload's checksum is checked (a corrupt delta is never applied,
not even in part), and the engine's version is forgotten while it writes: if a tensor's result then fails its
checksum, or anything breaks midway, the next request rebuilds from a snapshot instead of patching an unknown
state. Everything here runs on the scheduler thread, between forward passes (the engine is paused for a push);
the CPU work (decoding patches ahead of the one being written, the results' checksums) runs on a few pool threads
meanwhile, zlib and numpy releasing the GIL. An "xor" patch is applied with the `xor` strategy over the whole
tensor; an "index" one writes the changed elements' new bits at their indices (the same bits, in O(changed)).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hpcrl.engine.embedded import apply
from hpcrl.weightwire.delta import (
    DeltaFormatError,
    IndexPatch,
    Manifest,
    TensorEntry,
    XorPatch,
    bits,
    bits_dtype,
    crc32,
    decode_full,
    decode_patch,
    manifest_name,
    parse_manifest_name,
    published,
    read_manifest,
    read_payloads,
)


class DeltaLoader:
    def __init__(self) -> None:
        self.directory: Path | None = None
        self.applied: int | None = None
        """The version the parameters hold exactly (None: unknown, e.g. the launch weights or a broken apply)."""

    def load(self, params: Mapping[str, torch.Tensor], manifest: Path) -> dict[str, Any]:
        """Bring `params` to the version of `manifest`; DeltaFormatError naming the file when that cannot be done."""
        t0 = time.perf_counter()
        parsed = parse_manifest_name(manifest.name)
        if parsed is None:
            raise DeltaFormatError(f"{manifest} is not a weight manifest (delta-NNNNNNNN.json or snapshot-...)")
        kind, target = parsed
        directory = manifest.parent
        if directory != self.directory:
            self.directory, self.applied = directory, None
        steps = self._plan(directory, kind, target)
        nbytes = 0
        for path in steps:
            nbytes += self._apply(params, path)
        return {
            "version": target,
            "applied": [p.name for p in steps],
            "bytes": nbytes,
            "seconds": time.perf_counter() - t0,
        }

    def _plan(self, directory: Path, kind: str, target: int) -> list[Path]:
        if kind == "snapshot":
            return [directory / manifest_name("snapshot", target)]
        if self.applied == target:
            return []
        have = published(directory)
        deltas = set(have["delta"])
        start = self.applied
        if start is None or start > target or not all(v in deltas for v in range(start + 1, target + 1)):
            snapshots = [s for s in have["snapshot"] if s <= target]
            if not snapshots:
                raise DeltaFormatError(
                    f"{directory} holds no snapshot at or before version {target} to rebuild from; the trainer "
                    "writes one with its first push (is this the run's weight directory?)"
                )
            start = snapshots[-1]
            missing = [v for v in range(start + 1, target + 1) if v not in deltas]
            if missing:
                raise DeltaFormatError(f"{directory} lacks the deltas {missing} after snapshot {start}")
            return [directory / manifest_name("snapshot", start)] + [
                directory / manifest_name("delta", v) for v in range(start + 1, target + 1)
            ]
        return [directory / manifest_name("delta", v) for v in range(start + 1, target + 1)]

    def _apply(self, params: Mapping[str, torch.Tensor], path: Path) -> int:
        manifest = read_manifest(path)
        if manifest.kind == "delta" and manifest.base_version != self.applied:
            raise DeltaFormatError(
                f"{path} applies on version {manifest.base_version}; this engine holds {self.applied}"
            )
        _check_names(params, manifest, path)
        payloads = read_payloads(path, manifest)  # every checksum, before anything is written
        self.applied = None  # from here until the last tensor the parameters hold no single version
        if manifest.kind == "snapshot":
            replace = apply.strategy("replace")
            for entry in manifest.tensors:
                tensor = decode_full(entry, payloads[entry.name], params[entry.name].dtype)
                replace.apply(params, [(entry.name, tensor)])
        else:
            xor = apply.strategy("xor")
            entries = [e for e in manifest.tensors if e.encoding != "same"]
            with ThreadPoolExecutor(THREADS, thread_name_prefix="delta-load") as pool:
                checks: list[tuple[TensorEntry, Future[int]]] = []
                for entry, patch in _ahead(pool, entries, payloads, params):
                    param = params[entry.name]
                    if isinstance(patch, tuple):  # the changed elements' new bits, written where they go
                        flat = param.detach().view(bits_dtype(param.dtype)).view(-1)
                        index, values = (torch.from_numpy(a).to(param.device) for a in patch)
                        with torch.no_grad():
                            flat.index_copy_(0, index, values)
                    else:
                        xor_bits = torch.from_numpy(patch).view(param.dtype).view(param.shape)
                        xor.apply(params, [(entry.name, xor_bits)])
                    # The bits are read here, on the scheduler's stream; only their CRC runs on the pool.
                    checks.append((entry, pool.submit(crc32, bits(param))))
                for entry, check in checks:
                    if check.result() != entry.result_crc32:
                        raise DeltaFormatError(
                            f"{path}: {entry.name!r} differs from the trainer's after the patch (this engine's "
                            f"version {manifest.base_version} was not the trainer's); the next update rebuilds "
                            "from a snapshot"
                        )
        self.applied = manifest.version
        return manifest.data_bytes


THREADS = min(8, os.cpu_count() or 1)


def _ahead(
    pool: ThreadPoolExecutor,
    entries: list[TensorEntry],
    payloads: Mapping[str, memoryview],
    params: Mapping[str, torch.Tensor],
) -> Iterator[tuple[TensorEntry, XorPatch | IndexPatch]]:
    """Each entry with its decoded patch, in order, decoding up to THREADS entries ahead (so that at most that many
    patches are in memory at once)."""
    pending: list[tuple[TensorEntry, Future[XorPatch | IndexPatch]]] = []
    for entry in entries:
        pending.append((entry, pool.submit(decode_patch, entry, payloads[entry.name], params[entry.name].dtype)))
        if len(pending) > THREADS:
            done, job = pending.pop(0)
            yield done, job.result()
    for done, job in pending:
        yield done, job.result()


def _check_names(params: Mapping[str, torch.Tensor], manifest: Manifest, path: Path) -> None:
    for entry in manifest.tensors:
        param = params.get(entry.name)
        if param is None:
            raise DeltaFormatError(f"{path} names {entry.name!r}, which the engine's model does not have")
        if list(param.shape) != entry.shape or str(param.dtype).removeprefix("torch.") != entry.dtype:
            raise DeltaFormatError(
                f"{path}: {entry.name!r} is {entry.dtype}{entry.shape}, the engine holds "
                f"{param.dtype}{list(param.shape)} (another model, or engine.dtype differs from the trainer's)"
            )
