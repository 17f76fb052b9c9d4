"""Weight push through a shared file system: per version the trainer writes what changed since the version before
(format: hpcrl/weightwire/delta.py), and every engine patches its own weights from those files.

For clusters where the trainer and the engines share no NCCL, gloo or MPI path (different partitions or jobs) but
a file system. Per push:
  begin(v)       the first push of this process (a fresh run, a resume) removes versions >= v and leftovers of a
                 writer killed midway: they belong to a trajectory this process does not continue
  send(bucket)   per tensor, its bits against the last pushed version's (kept on the CPU): XOR or index+value
                 encoding (whichever the changed share makes smaller), zlib-compressed, CRC-checked; every
                 sync.snapshot_every versions (and on the first push) also the whole tensor, uncompressed, for
                 engines that start, restart or find a delta corrupt. A bucket's tensors are encoded on threads
                 (zlib and numpy release the GIL) and written in order
  finish(v)      data files fsynced and renamed, then each manifest, written last and atomically; older
                 snapshots beyond sync.keep_snapshots and the deltas they cover are removed; then every engine is
                 asked to load the manifest (`/update_weights_from_delta`). An engine that fails to (a corrupt
                 delta) is asked once more with a snapshot of v, written then if there is none.
Stock SGLang engines read no delta: beside each of them, on its node, the launcher that started it runs an agent
process (hpcrl/sync/delta_agent_server.py) that patches a copy of the weights and has SGLang load it from a
node-local directory (`/update_weights_from_disk`); this transport asks each agent over HTTP to apply version v
and waits for its answer (hpcrl/engine/delta_agent_client.py), bounded by sync.group_timeout_s.
A failed write (disk full) raises DiskDeltaError with the fix and publishes nothing: the engines keep serving the
version before, and the next push writes a snapshot. A manifest is never written through a link.
"""

from __future__ import annotations

import errno
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from hpcrl.engine.client import EngineClient
from hpcrl.engine.delta_agent_client import AgentRecord, DeltaAgentUnreachable, apply_version, find_agent
from hpcrl.engine.protocol.control import UpdateWeightsFromDelta
from hpcrl.sync.errors import WeightSyncError
from hpcrl.sync.transport import Transport, TransportContext
from hpcrl.weightwire.buckets import Bucket
from hpcrl.weightwire.delta import (
    Manifest,
    Payload,
    TensorEntry,
    bits,
    crc32,
    data_name,
    encode,
    manifest_name,
    parse_manifest_name,
    published,
)

RAW_ALIGN = 64
ENCODE_THREADS = min(8, os.cpu_count() or 1)


class DiskDeltaError(RuntimeError):
    """Writing a weight version failed; nothing of it was published."""


class VersionFile:
    """One version's data file and manifest, written through temporary names: data, fsync, rename, then the
    manifest, fsync, rename. `abort` removes what was written."""

    def __init__(self, directory: Path, kind: str, version: int, base_version: int | None) -> None:
        self.directory, self.kind, self.version, self.base_version = directory, kind, version, base_version
        self.data = directory / data_name(kind, version)
        self.tmp = directory / f".{self.data.name}.tmp"
        self.entries: list[TensorEntry] = []
        self.offset = 0
        self._fd = _create(self.tmp)

    def add(
        self, name: str, dtype: str, shape: list[int], encoding: str, payload: Payload, result: int, changed: int
    ) -> None:
        view = memoryview(payload).cast("B")
        if encoding == "raw" and self.offset % RAW_ALIGN:  # readers use raw bits in place: keep them aligned
            pad = RAW_ALIGN - self.offset % RAW_ALIGN
            self._write(memoryview(bytes(pad)))
            self.offset += pad
        checksum = result if encoding == "raw" else crc32(view)  # raw bits are the result: one CRC for both
        self.entries.append(
            TensorEntry(name, dtype, shape, encoding, self.offset, len(view), checksum, result, changed)
        )
        self._write(view)
        self.offset += len(view)

    def _write(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self._fd, view) :]

    def commit(self) -> Path:
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self.tmp, self.data)
        manifest = Manifest(self.version, self.kind, self.base_version, self.data.name, self.offset, self.entries)
        path = self.directory / manifest_name(self.kind, self.version)
        tmp = self.directory / f".{path.name}.tmp"
        fd = _create(tmp)
        try:
            os.write(fd, manifest.to_json())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # the version exists from here on
        _fsync_dir(self.directory)
        return path

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for path in (self.tmp, self.data, self.directory / f".{manifest_name(self.kind, self.version)}.tmp"):
            path.unlink(missing_ok=True)


class DiskDeltaTransport(Transport):
    def __init__(self, ctx: TransportContext) -> None:
        if ctx.engine_kind == "sglang" and ctx.run_dir is None:
            raise WeightSyncError(
                "sync.transport disk_delta with SGLang engines needs the run directory (where the agents beside "
                "the engines announce themselves)"
            )
        self.engine_kind, self.run_dir = ctx.engine_kind, ctx.run_dir
        self.agents: dict[str, AgentRecord] = {}  # SGLang engines' agents, by engine URL
        self.agent_mode: str | None = None  # how they hand weights to SGLang (None: theirs, "disk"); benchmarks set it
        self.cfg = ctx.cfg
        if ctx.cfg.delta_dir:
            self.directory = Path(ctx.cfg.delta_dir).expanduser().absolute()
        elif ctx.run_dir is not None:
            self.directory = Path(ctx.run_dir).absolute() / "weights"
        else:
            raise WeightSyncError("sync.transport disk_delta needs a directory: set sync.delta_dir")
        self.engines = list(ctx.engines)
        self.each = ctx.each
        self.prev: dict[str, np.ndarray] = {}  # the last published version's bits, per tensor
        self.meta: dict[str, tuple[str, list[int]]] = {}  # its dtype and shape, per tensor
        self.prev_version: int | None = None
        self.last_snapshot: int | None = None
        self.files: list[VersionFile] = []
        self._changed = self._numel = 0
        self._write_s = 0.0
        self._metrics: dict[str, float] = {}
        self._pool: ThreadPoolExecutor | None = None

    def connect(self) -> None:
        if self.directory.is_symlink():
            raise DiskDeltaError(f"sync.delta_dir {self.directory} is a symbolic link; name the real directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskDeltaError(f"cannot create the weight directory {self.directory}: {exc.strerror}") from None
        if not os.access(self.directory, os.W_OK):
            raise DiskDeltaError(f"the weight directory {self.directory} is not writable; set sync.delta_dir")

    def reconnect(self, engines: Any) -> None:
        self.engines = list(engines)
        self.agents = {}  # a restarted engine has a new agent

    def begin(self, version: int) -> None:
        self._metrics, self._changed, self._numel, self._write_s = {}, 0, 0, 0.0
        if version == self.prev_version:
            return  # the version the engines should hold again (a restarted engine): nothing new to write
        if self.prev_version is None:
            self._remove_from(version)
        t0 = time.perf_counter()
        try:
            if self.prev_version is not None:
                self.files.append(VersionFile(self.directory, "delta", version, self.prev_version))
            if self.last_snapshot is None or version - self.last_snapshot >= self.cfg.snapshot_every:
                self.files.append(VersionFile(self.directory, "snapshot", version, None))
        except Exception as exc:
            self._fail(version, exc)
        self._write_s += time.perf_counter() - t0

    def send(self, bucket: Bucket) -> None:
        if not self.files:
            return
        t0 = time.perf_counter()
        try:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="disk-delta")
            kinds = [file.kind for file in self.files]
            for name, _ in bucket:
                if "delta" in kinds and name not in self.prev:
                    raise DiskDeltaError(f"weight {name!r} was not in version {self.prev_version}")
            # The bits are read here, on the caller's stream (a pool thread's stream would not wait for the kernels
            # that produced a device tensor); a CPU tensor's bits alias the trainer's storage and are copied on the
            # pool.
            jobs = [
                self._pool.submit(self._encode, name, bits(tensor), tensor.device.type != "cpu", kinds)
                for name, tensor in bucket
            ]
            for (name, tensor), job in zip(bucket, jobs, strict=True):
                new, result, encoded = job.result()  # in bucket order: the data file's layout is deterministic
                dtype = str(tensor.dtype).removeprefix("torch.")
                for file, (encoding, payload, changed) in zip(self.files, encoded, strict=True):
                    file.add(name, dtype, list(tensor.shape), encoding, payload, result, changed)
                    if file.kind == "delta":
                        self._changed += changed
                self._numel += new.size
                self.prev[name] = new
                self.meta[name] = (dtype, list(tensor.shape))
        except Exception as exc:
            self._fail(self.files[0].version, exc)
        self._write_s += time.perf_counter() - t0

    def _encode(
        self, name: str, new: np.ndarray, private: bool, kinds: list[str]
    ) -> tuple[np.ndarray, int, list[tuple[str, Payload, int]]]:
        """A tensor's bits (`private`: already a copy of their own), their CRC and its payload per file being
        written (on a pool thread)."""
        if not private:
            new = new.copy()
        return new, crc32(new), [encode(self.prev[name] if kind == "delta" else None, new) for kind in kinds]

    def finish(self, version: int) -> None:
        t0 = time.perf_counter()
        manifests: dict[str, Path] = {}
        try:
            for file in self.files:
                manifests[file.kind] = file.commit()
        except Exception as exc:
            self._fail(version, exc)
        written = {f.kind: f.offset for f in self.files}
        self.files = []
        if manifests:
            self.prev_version = version
            if "snapshot" in manifests:
                self.last_snapshot = version
            self._retain()
        self._write_s += time.perf_counter() - t0
        target = manifests.get("delta") or manifests.get("snapshot") or self._newest(version)
        try:
            seconds = self._load(target, version)
        except WeightSyncError:
            if target.name.startswith("snapshot"):
                raise
            snapshot = self.directory / manifest_name("snapshot", version)
            if not snapshot.exists():
                snapshot = self._write_snapshot(version)
            seconds = self._load(snapshot, version)
        if manifests:
            self._metrics = {
                "sync/delta_bytes": float(written.get("delta", 0)),
                "sync/delta_changed_share": self._changed / self._numel if "delta" in written and self._numel else 1.0,
                "sync/delta_write_s": self._write_s,
            }
            if "snapshot" in written:
                self._metrics["sync/snapshot_bytes"] = float(written["snapshot"])
        self._metrics["sync/engine_apply_s"] = max(seconds, default=0.0)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for file in self.files:
            file.abort()
        self.files = []
        self.agents = {}

    # ----- helpers -----
    def _load(self, manifest: Path, version: int) -> list[float]:
        request = UpdateWeightsFromDelta(manifest=str(manifest), weight_version=str(version))

        def load(engine: EngineClient) -> float:
            if self.engine_kind == "sglang":
                try:
                    done = apply_version(
                        self._agent(engine), manifest, version, timeout_s=self.cfg.group_timeout_s, mode=self.agent_mode
                    )
                except DeltaAgentUnreachable as exc:
                    self.agents.pop(engine.url, None)  # looked up again: its engine may have been restarted
                    raise WeightSyncError(str(exc)) from exc
                return float(done.get("seconds", 0.0))
            # Rebuilding from a snapshot reads the whole model: bounded as a broadcast is, not as a control call.
            reply = engine.call(request.endpoint, request, timeout_s=self.cfg.group_timeout_s)
            return float(reply.get("seconds", 0.0)) if isinstance(reply, dict) else 0.0

        out: list[float] = self.each(load, f"loading {manifest.name}")
        return out

    def _agent(self, engine: EngineClient) -> AgentRecord:
        record = self.agents.get(engine.url)
        if record is None:
            assert self.run_dir is not None
            record = self.agents[engine.url] = find_agent(Path(self.run_dir), engine.url)
        return record

    def _newest(self, version: int) -> Path:
        """The manifest of `version` already on disk (a push of the version the engines hold)."""
        for kind in ("delta", "snapshot"):
            path = self.directory / manifest_name(kind, version)
            if path.exists():
                return path
        raise WeightSyncError(f"weight version {version} has no manifest in {self.directory}")

    def _write_snapshot(self, version: int) -> Path:
        """A snapshot of `version` from the kept bits (for engines whose delta was corrupt)."""
        file = VersionFile(self.directory, "snapshot", version, None)
        try:
            for name, new in self.prev.items():
                encoding, payload, _ = encode(None, new)
                dtype, shape = self.meta[name]
                file.add(name, dtype, shape, encoding, payload, crc32(new), new.size)
            path = file.commit()
        except OSError as exc:
            file.abort()
            raise DiskDeltaError(f"writing a snapshot of weight version {version} failed: {exc}") from exc
        self.last_snapshot = version
        return path

    def _fail(self, version: int, exc: Exception) -> NoReturn:
        for file in self.files:
            file.abort()
        self.files = []
        # The kept bits may now mix two versions: the next push starts over with a snapshot.
        self.prev, self.prev_version, self.last_snapshot = {}, None, None
        if not isinstance(exc, OSError):
            raise exc
        fix = (
            "free space there or set sync.delta_dir to a larger shared file system"
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            else "check that sync.delta_dir is a writable shared file system"
        )
        raise DiskDeltaError(
            f"writing weight version {version} to {self.directory} failed ({exc.strerror or exc}): {fix}. Nothing "
            "of it was published; the engines serve the version before, and the run's checkpoints are untouched"
        ) from exc

    def _remove_from(self, version: int) -> None:
        """Remove versions >= `version` and files of writers killed midway (temporaries, data without manifest)."""
        have = published(self.directory)
        for entry in os.scandir(self.directory):
            name = entry.name
            stem = name.removesuffix(".json").removesuffix(".bin")
            parsed = parse_manifest_name(stem + ".json")
            orphan = name.endswith(".bin") and parsed is not None and parsed[1] not in have[parsed[0]]
            if name.endswith(".tmp") or orphan or (parsed is not None and parsed[1] >= version):
                if not entry.is_symlink() and entry.is_file():
                    os.unlink(entry.path)
        self.last_snapshot = None

    def _retain(self) -> None:
        snapshots = published(self.directory)["snapshot"]
        if len(snapshots) <= self.cfg.keep_snapshots:
            return
        oldest_kept = snapshots[-self.cfg.keep_snapshots]
        have = published(self.directory)
        doomed = [("snapshot", v) for v in snapshots if v < oldest_kept]
        doomed += [("delta", v) for v in have["delta"] if v <= oldest_kept]
        for kind, v in doomed:
            # The manifest first: a version without one is never read, so its data can go after it.
            (self.directory / manifest_name(kind, v)).unlink(missing_ok=True)
            (self.directory / data_name(kind, v)).unlink(missing_ok=True)


def _create(path: Path) -> int:
    """A new file at `path`, opened for writing; a file or link planted there is removed, never written through."""
    path.unlink(missing_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
