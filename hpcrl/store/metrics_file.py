"""The metrics.h5 file itself: its format marks, and opening it for a writer (created, appended, or recovered
after a killed writer). What goes into it is `MetricsWriter`'s (hpcrl/store/metrics.py)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import h5py

FORMAT_ATTR = "hpcrl_format"
FORMAT_VERSION_ATTR = "hpcrl_format_version"
METRICS_FORMAT = "metrics"
METRICS_FORMAT_VERSION = 1

EVENT_FIELDS = ("time_s", "step", "kind", "detail")
_REQUIRED_DATASETS = ("metrics/step", *(f"events/{name}" for name in EVENT_FIELDS))
# 512 float64 rows = 4 KiB per chunk: a run of a few hundred steps stays small, long runs need few chunks.
CHUNK_ROWS = 512
SUPERBLOCK_OPEN_FOR_WRITE = 0x01
# What h5py raises on a damaged file: an object header whose checksum fails is a KeyError, not an OSError.
H5_ERRORS = (OSError, KeyError, RuntimeError)


class StoreError(Exception):
    """A store file is missing, foreign, damaged or used in a way it cannot support."""


def is_open_for_write(error: OSError) -> bool:
    return "already open for write" in str(error)


def damaged(path: Path, error: BaseException) -> StoreError:
    return StoreError(
        f"cannot read {path} ({error}); the file is truncated or corrupt: move it aside to start a new metrics file"
    )


def open_for_writer(path: Path) -> h5py.File:
    """`path` opened for appending, created when missing, rewritten first when a killed writer left it open."""
    from hpcrl.store.run_dir import refuse_link

    refuse_link(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # locking=False: HDF5's lock would make the writer fail whenever a reader has the file open.
        f = h5py.File(path, "w-", libver="latest", locking=False)
        f.attrs[FORMAT_ATTR] = METRICS_FORMAT
        f.attrs[FORMAT_VERSION_ATTR] = METRICS_FORMAT_VERSION
        f.create_dataset("metrics/step", shape=(0,), maxshape=(None,), chunks=(CHUNK_ROWS,), dtype="i8")
        event_dtypes = {"time_s": "f8", "step": "i8", "kind": h5py.string_dtype(), "detail": h5py.string_dtype()}
        for name, dtype in event_dtypes.items():
            f.create_dataset(f"events/{name}", shape=(0,), maxshape=(None,), chunks=(64,), dtype=dtype)
        return f
    if not h5py.is_hdf5(path):
        raise StoreError(
            f"{path} exists but is not an HDF5 file; move it aside so that a new metrics file can be created"
        )
    try:
        f = open_append(path)
    except OSError as error:
        if not is_open_for_write(error):
            raise StoreError(
                f"cannot open {path} for appending ({error}); the file is truncated or corrupt: "
                "move it aside to start a new metrics file"
            ) from error
        _recover_from_killed_writer(path)
        f = open_append(path)
    try:
        if f.attrs.get(FORMAT_ATTR) != METRICS_FORMAT:
            raise StoreError(
                f"{path} is an HDF5 file but not an hpcrl metrics file (no root attribute "
                f"{FORMAT_ATTR}={METRICS_FORMAT!r}); refusing to append to it: choose another run directory"
            )
        missing = [name for name in _REQUIRED_DATASETS if not isinstance(f.get(name), h5py.Dataset)]
        if missing:
            raise StoreError(f"{path} lacks the datasets {missing}; it is damaged: move it aside")
    except H5_ERRORS as error:
        f.close()
        raise damaged(path, error) from error
    except StoreError:
        f.close()
        raise
    return f


def open_append(path: Path) -> h5py.File:
    return h5py.File(path, "a", libver="latest", locking=False)


def _recover_from_killed_writer(path: Path) -> None:
    # A killed writer leaves the file flagged "open for write", which HDF5 only clears with the
    # h5clear tool. Everything it flushed is readable through SWMR, so rewrite that into a fresh file.
    warnings.warn(
        f"{path} was not closed by its last writer (killed or preempted); rewriting its flushed rows into a fresh file",
        RuntimeWarning,
        stacklevel=4,
    )
    from hpcrl.store.run_dir import open_no_follow, refuse_link

    temp_path = path.with_name(f".{path.name}.recover.tmp")
    refuse_link(temp_path)
    temp_path.unlink(missing_ok=True)
    # A file of our own (never through a link planted at its name), written by HDF5 through its descriptor.
    fd = open_no_follow(temp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with (
            h5py.File(path, "r", swmr=True, locking=False) as src,
            h5py.File(f"/proc/self/fd/{fd}", "w", libver="latest", locking=False) as dst,
        ):
            for name in src:
                src.copy(src[name], dst, name=name)
            for name, value in src.attrs.items():
                dst.attrs[name] = value
        os.replace(temp_path, path)
    except OSError as error:
        temp_path.unlink(missing_ok=True)
        raise StoreError(
            f"{path} was left open by a killed writer and cannot be recovered ({error}); "
            "move it aside to start a new metrics file"
        ) from error
    finally:
        os.close(fd)
