"""Positional file I/O of many buffers at once, around the page cache (O_DIRECT) where the file system takes it.

Checkpoint blobs go through here: gathered into aligned staging buffers with several writes in flight, read back
the same way and scattered into each tensor's memory, with ``os.pwritev``/``os.preadv`` of the buffers
themselves as the fallback where O_DIRECT is refused.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

__all__ = ["DIRECT_ALIGN", "fsync_path", "preadv_all", "pwritev_all", "read_direct", "write_blob"]

# Linux accepts at most IOV_MAX (1024) buffers in one pwritev/preadv.
_IOV_MAX = 1024
# The blob goes to the disk around the page cache (O_DIRECT) in chunks of this many bytes, copied through
# staging buffers aligned to DIRECT_ALIGN bytes (what O_DIRECT asks of addresses, offsets and lengths), with
# this many writes in flight: one at a time, 16 MiB chunks wrote 0.43 GB in 0.19-0.38 s here; four of 8 MiB
# in 0.20-0.22 s, the disk's speed (what fsync of the same bytes from the page cache takes).
_DIRECT_CHUNK_BYTES = 8 << 20
_DIRECT_WRITES_IN_FLIGHT = 4
DIRECT_ALIGN = 4096
# One set of staging buffers kept between writes (32 MiB): fresh memory costs a page fault per 4 KiB, and on
# this VM, whose idle memory goes back to the host, a fresh set doubled the write's time.
_spare_buffers: list[list[memoryview]] = []
_spare_buffers_lock = threading.Lock()


def write_blob(path: Path, fd: int, views: list[memoryview], offset: int) -> None:
    """Writes the tensor bytes at ``offset``: the whole 4 KiB blocks with O_DIRECT where the file system takes
    it, the rest (a last partial block, or everything) through ``fd`` and the page cache.

    Why O_DIRECT: a checkpoint is fsynced at once, so the page cache only adds a copy and the allocation of a
    page per 4 KiB; on a VM whose idle memory went back to the host, that allocation made a buffered write
    of 0.43 GB take 0.7-7 s against 0.5-0.9 s around the cache. fsync still follows:
    O_DIRECT data may sit in the disk's volatile cache, and the file's extents are metadata.
    """
    nbytes = sum(view.nbytes for view in views)
    direct_nbytes = nbytes // DIRECT_ALIGN * DIRECT_ALIGN if offset % DIRECT_ALIGN == 0 else 0
    written = _pwrite_direct(path, fd, views, offset, direct_nbytes) if direct_nbytes else 0
    pwritev_all(fd, _advance([view for view in views if view.nbytes], written), offset + written)


def _open_direct(path: Path, flags: int) -> int | None:
    """``path`` opened with O_DIRECT, or None where the file system refuses it (EINVAL at open)."""
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return None
        raise


def _pwrite_direct(path: Path, fd: int, views: list[memoryview], offset: int, nbytes: int) -> int:
    """Writes the first ``nbytes`` (a multiple of DIRECT_ALIGN) of ``views`` with O_DIRECT, copying them into
    staging buffers while threads write the others; returns the bytes written, 0 if the file system refuses
    O_DIRECT (tmpfs before Linux 6.6, some network file systems: EINVAL)."""
    direct_fd = _open_direct(path, os.O_WRONLY)
    if direct_fd is None:
        return 0
    buffers: list[memoryview] = []
    try:
        chunk_nbytes = min(_DIRECT_CHUNK_BYTES, nbytes)
        buffers = _take_buffers()
        writes: list[Future[None] | None] = [None] * len(buffers)
        pending = [view for view in views if view.nbytes]
        with ThreadPoolExecutor(len(buffers), thread_name_prefix="hpcrl-write") as writer:
            for index, start in enumerate(range(0, nbytes, chunk_nbytes)):
                slot = index % len(buffers)
                if (write := writes[slot]) is not None:
                    write.result()  # its buffer is free again
                buffer = buffers[slot][: min(chunk_nbytes, nbytes - start)]
                pending = _gather(pending, buffer)
                if index == 0:
                    if not _first_direct_write(direct_fd, fd, buffer, offset):
                        return 0
                    continue
                writes[slot] = writer.submit(_write_chunk, direct_fd, fd, buffer, offset + start)
            for write in writes:
                if write is not None:
                    write.result()
    finally:
        os.close(direct_fd)
        with _spare_buffers_lock:  # the writes using them are done: the executor waited for them
            if buffers and not _spare_buffers:
                _spare_buffers.append(buffers)
    return nbytes


def _take_buffers() -> list[memoryview]:
    with _spare_buffers_lock:
        buffers = _spare_buffers.pop() if _spare_buffers else []
    if len(buffers) == _DIRECT_WRITES_IN_FLIGHT and buffers[0].nbytes >= _DIRECT_CHUNK_BYTES:
        return buffers
    return [_aligned_buffer(_DIRECT_CHUNK_BYTES) for _ in range(_DIRECT_WRITES_IN_FLIGHT)]


def _first_direct_write(direct_fd: int, fd: int, buffer: memoryview, offset: int) -> bool:
    # A file system may take O_DIRECT at open and refuse its first write (alignment stricter than 4 KiB).
    try:
        _write_chunk(direct_fd, fd, buffer, offset)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    return True


def _write_chunk(direct_fd: int, fd: int, buffer: memoryview, offset: int) -> None:
    written = os.pwritev(direct_fd, [buffer], offset)
    if written < buffer.nbytes:  # a short direct write (a size limit): the rest goes through the page cache
        pwritev_all(fd, [buffer[max(written, 0) :]], offset + max(written, 0))


def _aligned_buffer(nbytes: int) -> memoryview:
    raw = np.empty(nbytes + DIRECT_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % DIRECT_ALIGN
    return raw[start : start + nbytes].data


def _gather(views: list[memoryview], buffer: memoryview) -> list[memoryview]:
    """Copies the first ``buffer.nbytes`` bytes of ``views`` into ``buffer``; returns the views left."""
    filled = 0
    for view in views:
        size = min(view.nbytes, buffer.nbytes - filled)
        buffer[filled : filled + size] = view[:size]
        filled += size
        if filled == buffer.nbytes:
            break
    return _advance(views, filled)


def pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    pending = [view for view in views if view.nbytes]
    while pending:
        written = os.pwritev(fd, pending[:_IOV_MAX], offset)
        if written <= 0:
            raise OSError(f"pwritev wrote {written} bytes at offset {offset}")
        offset += written
        pending = _advance(pending, written)


def preadv_all(fd: int, views: list[memoryview], offset: int) -> bool:
    """Fills ``views`` from ``offset`` on; False if the file ends first (a truncated checkpoint)."""
    pending = [view for view in views if view.nbytes]
    while pending:
        read = os.preadv(fd, pending[:_IOV_MAX], offset)
        if read <= 0:
            return False
        offset += read
        pending = _advance(pending, read)
    return True


def _advance(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """The part of ``views`` left after the first ``nbytes`` bytes (a short pwritev/preadv)."""
    index = 0
    while index < len(views) and nbytes >= views[index].nbytes:
        nbytes -= views[index].nbytes
        index += 1
    rest = views[index:]
    if rest and nbytes:
        rest[0] = rest[0][nbytes:]
    return rest


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_direct(
    path: Path, views: list[memoryview], blob_offset: int, runs: list[tuple[int, int]], check: Callable[[int], None]
) -> int:
    """Fills ``views`` from the blob with O_DIRECT reads into staging buffers, four in flight, calling
    ``check(run)`` as each run is complete; returns the number of runs filled: 0 where the file system refuses
    O_DIRECT, fewer than all after a short read (the end of a truncated file), for the caller to read again
    through the page cache.

    Why: a read through the page cache allocates a page per 4 KiB, which on this VM cost as much as the disk
    (benchmarks/checkpoint_cpu_2026-12.md), and the blob is not in the cache anyway: it was written around it.
    """
    direct_fd = _open_direct(path, os.O_RDONLY)
    if direct_fd is None:
        return 0
    run_ends = list(itertools.accumulate(sum(view.nbytes for view in views[first:last]) for first, last in runs))
    nbytes = run_ends[-1]
    skip = blob_offset % DIRECT_ALIGN  # files written before the blob was aligned
    start = blob_offset - skip
    positions = range(0, -(-(skip + nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN, _DIRECT_CHUNK_BYTES)
    end = positions.stop
    buffers: list[memoryview] = []
    num_checked = 0
    try:
        buffers = _take_buffers()
        with ThreadPoolExecutor(len(buffers), thread_name_prefix="hpcrl-read") as reader:
            reads: list[tuple[memoryview, Future[int]]] = []

            def submit(index: int) -> None:
                buffer = buffers[index % len(buffers)][: min(_DIRECT_CHUNK_BYTES, end - positions[index])]
                reads.append((buffer, reader.submit(os.preadv, direct_fd, [buffer], start + positions[index])))

            for index in range(min(len(buffers), len(positions))):
                submit(index)
            pending, filled = [view for view in views if view.nbytes], 0
            for index in range(len(positions)):
                buffer, read = reads[index]
                try:
                    num_bytes_read = read.result()
                except OSError as error:
                    if index == 0 and error.errno == errno.EINVAL:
                        return 0
                    raise
                data = buffer[skip if index == 0 else 0 : max(num_bytes_read, 0)][: nbytes - filled]
                pending = _scatter(data, pending)
                filled += data.nbytes
                while num_checked < len(runs) and run_ends[num_checked] <= filled:
                    check(num_checked)
                    num_checked += 1
                if num_bytes_read < buffer.nbytes or filled == nbytes:
                    break
                if index + len(buffers) < len(positions):
                    submit(index + len(buffers))  # into the buffer just emptied
    finally:
        os.close(direct_fd)
        with _spare_buffers_lock:
            if buffers and not _spare_buffers:
                _spare_buffers.append(buffers)
    return num_checked


def _scatter(data: memoryview, views: list[memoryview]) -> list[memoryview]:
    """Copies ``data`` into the head of ``views``; returns the views left to fill."""
    copied = 0
    for view in views:
        if copied == data.nbytes:
            break
        size = min(view.nbytes, data.nbytes - copied)
        view[:size] = data[copied : copied + size]
        copied += size
    return _advance(views, copied)
