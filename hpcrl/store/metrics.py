"""Per-step metrics and run events in ``run_dir/metrics.h5``, readable while the run writes them.

Layout:
- ``/metrics/step`` int64 and ``/metrics/<group>/<name>`` float64, 1-D, resizable, all the same length:
  row ``i`` holds the metrics of step ``/metrics/step[i]``; a metric missing from a step is NaN.
- ``/events/{time_s,step,kind,detail}``: one entry per event (unix time, step or -1, kind, JSON detail).
- root attributes: ``hpcrl_format="metrics"``, ``hpcrl_format_version`` and the caller's strings
  (config YAML, versions JSON, git commit, hosts).

The writer keeps the file in SWMR mode, so ``load_metrics`` can read a run in progress. SWMR forbids new
datasets, attributes and variable-length writes, so those (new metric keys, events, root attributes,
truncation) briefly reopen the file outside SWMR; they are rare, while per-step rows only append.
"""

from __future__ import annotations

import json
import numbers
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import h5py
import numpy as np

from hpcrl.store.metrics_file import (
    CHUNK_ROWS,
    EVENT_FIELDS,
    FORMAT_ATTR,
    FORMAT_VERSION_ATTR,
    H5_ERRORS,
    METRICS_FORMAT,
    SUPERBLOCK_OPEN_FOR_WRITE,
    StoreError,
    damaged,
    is_open_for_write,
    open_append,
    open_for_writer,
)

if TYPE_CHECKING:
    import pandas as pd

    from hpcrl.store.sinks import SinkSet

_RESERVED_ATTRS = frozenset({FORMAT_ATTR, FORMAT_VERSION_ATTR})
DEFAULT_GROUP = "misc"
_KEY_PART = re.compile(r"[A-Za-z0-9_.\-]+")
_T = TypeVar("_T")
# A writer outside SWMR (adding a key or an event) holds the file for milliseconds, and an append under SWMR is
# readable whole a moment later; readers wait this long.
_READ_RETRY_S = 2.0
_READ_RETRY_SLEEP_S = 0.02


def metric_path(key: str) -> str:
    """Returns the dataset path under ``/metrics`` for a metric key: ``"loss"`` -> ``"misc/loss"``.

    Keys are ``/``-separated parts of letters, digits, ``_``, ``.`` and ``-`` (``"timing/step/generate"``).
    """
    if not isinstance(key, str):
        raise TypeError(f"metric key {key!r} is a {type(key).__name__}; metric keys are strings like 'train/loss'")
    parts = key.split("/")
    for part in parts:
        # "." and ".." are HDF5 path navigation, not names.
        if not _KEY_PART.fullmatch(part) or set(part) == {"."}:
            raise ValueError(
                f"invalid metric key {key!r}: use '/'-separated parts made of letters, digits, '_', '.' and '-' "
                "(not only dots), e.g. 'train/loss' or 'timing/rollout_s'"
            )
    if len(parts) == 1:
        return f"{DEFAULT_GROUP}/{key}"
    if parts[0] == "step":
        raise ValueError(f"invalid metric key {key!r}: '/metrics/step' is the step index, so 'step/' cannot be a group")
    return key


def _check_no_nesting_clash(path: str, existing: Iterable[str]) -> None:
    # HDF5 cannot hold both a dataset "a/b" and a group "a/b" (for "a/b/c").
    for other in existing:
        if path.startswith(other + "/") or other.startswith(path + "/"):
            raise ValueError(
                f"metric key {path!r} clashes with {other!r}: one would be both a value and a group; rename one"
            )


def _as_float(key: str, value: object) -> float:
    if isinstance(value, numbers.Real):
        return float(value)
    hint = " (call .item() on a tensor)" if hasattr(value, "item") else ""
    raise TypeError(f"metric {key!r} has a {type(value).__name__} value; log Python or NumPy numbers{hint}")


def _as_step(step: object, what: str) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(step).__name__} {step!r}")
    return int(step)


_F = TypeVar("_F", bound=Callable[..., Any])


def _serialized(method: _F) -> _F:
    """One write at a time: the engine fleet's monitor, the async producer and the thermal guard record events from
    their own threads while the driver logs rows, and interleaved HDF5 writes invalidate the file's handles."""

    @wraps(method)
    def call(self: MetricsWriter, *args: Any, **kwargs: Any) -> Any:
        with self._write_lock:
            return method(self, *args, **kwargs)

    return cast(_F, call)


class MetricsWriter:
    """Appends one row of metrics per step, and events, to ``metrics.h5`` (created or appended).

    Rows are buffered and written ``flush_every_steps`` rows at a time, or on the first ``log`` after
    ``flush_interval_s`` seconds, because one resize and write per value per step costs ~0.6 ms each.
    Events and root attributes are written at once. Call ``flush()`` before saving a checkpoint and, on
    resume, ``truncate_after(checkpoint_step)`` before logging: then no step is duplicated or missing, even
    though a killed writer loses its buffered rows. A file left by a killed writer is rewritten from its
    flushed content when it is opened again, with a RuntimeWarning.
    """

    _step_ds: h5py.Dataset
    _events: dict[str, h5py.Dataset]

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        root_attrs: Mapping[str, str] | None = None,
        flush_every_steps: int = 10,
        flush_interval_s: float = 5.0,
        sinks: SinkSet | None = None,
    ) -> None:
        """sinks: copies of every row and event (TensorBoard, wandb, MLflow); they never fail a write here."""
        self._write_lock = threading.RLock()
        if flush_every_steps < 1:
            raise ValueError(f"flush_every_steps must be >= 1, got {flush_every_steps}")
        if not flush_interval_s >= 0:
            raise ValueError(f"flush_interval_s must be >= 0, got {flush_interval_s}")
        self.path = Path(path)
        self.flush_every_steps = flush_every_steps
        self.flush_interval_s = flush_interval_s
        self._rows: list[tuple[int, dict[str, float]]] = []
        self._sinks = sinks
        self._key_paths: dict[str, str] = {}
        self._columns: dict[str, h5py.Dataset] = {}
        self._last_flush_s = time.monotonic()
        self._file = open_for_writer(self.path)
        try:
            try:
                self._bind()
                self._num_rows, self._num_events = self._repair_lengths()
                self._last_step: int | None = int(self._step_ds[self._num_rows - 1]) if self._num_rows else None
                self._file.swmr_mode = True
            except H5_ERRORS as error:
                raise damaged(self.path, error) from error
            if root_attrs:
                self.set_root_attrs(root_attrs)
        except BaseException:
            self._file.close()
            raise

    # -- opening (hpcrl/store/metrics_file.py opens the file) ----------------------------------------

    def _bind(self) -> None:
        """Looks up the dataset handles again, as every reopen invalidates them."""
        self._columns = {}

        def visit(name: str, obj: h5py.HLObject) -> None:
            if isinstance(obj, h5py.Dataset) and name != "step":
                self._columns[name] = obj

        metrics = self._file["metrics"]
        metrics.visititems(visit)
        self._step_ds = metrics["step"]
        self._events = {name: self._file[f"events/{name}"] for name in EVENT_FIELDS}

    def _repair_lengths(self) -> tuple[int, int]:
        # The step index is written after the values and event times after the rest, so a writer killed
        # mid-flush leaves some datasets longer: cut all back to the rows that were completely written.
        num_rows = min([self._step_ds.shape[0], *(ds.shape[0] for ds in self._columns.values())])
        num_events = min(ds.shape[0] for ds in self._events.values())
        for ds in [self._step_ds, *self._columns.values()]:
            if ds.shape[0] != num_rows:
                ds.resize((num_rows,))
        for ds in self._events.values():
            if ds.shape[0] != num_events:
                ds.resize((num_events,))
        return num_rows, num_events

    @contextmanager
    def _outside_swmr(self) -> Iterator[h5py.File]:
        """Reopens the file outside SWMR for the changes SWMR forbids, then returns to SWMR."""
        self._check_open()
        self._file.close()
        self._file = open_append(self.path)
        self._bind()
        try:
            yield self._file
        finally:
            # Picks up the datasets the caller created.
            self._bind()
            self._file.flush()
            self._file.swmr_mode = True

    def _check_open(self) -> None:
        if not self._file.id.valid:
            raise StoreError(f"the MetricsWriter of {self.path} is closed; create a new one to write again")

    # -- writing -------------------------------------------------------------------------------------

    @_serialized
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Buffers the metrics of one step. Steps must strictly increase; missing keys read as NaN."""
        self._check_open()
        step = _as_step(step, "step")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        last_step = self._rows[-1][0] if self._rows else self._last_step
        if last_step is not None and step <= last_step:
            raise ValueError(
                f"step {step} is not after the last logged step {last_step}: steps must strictly increase "
                "(on resume, call truncate_after(checkpoint_step) before logging)"
            )
        row: dict[str, float] = {}
        for key, value in metrics.items():
            path = self._key_paths.get(key)
            if path is None:
                path = self._register_key(key)
            if path in row:
                raise ValueError(f"metric key {key!r} names the same metric {path!r} as another key of this step")
            row[path] = _as_float(key, value)
        self._rows.append((step, row))
        if self._sinks is not None:
            self._sinks.log(step, {key: row[self._key_paths[key]] for key in metrics})
        now_s = time.monotonic()
        if len(self._rows) >= self.flush_every_steps or now_s - self._last_flush_s >= self.flush_interval_s:
            self.flush()

    def _register_key(self, key: str) -> str:
        path = metric_path(key)
        if path not in self._columns and path not in self._key_paths.values():
            _check_no_nesting_clash(path, {*self._columns, *self._key_paths.values()})
        self._key_paths[key] = path
        return path

    @_serialized
    def flush(self) -> None:
        """Writes the buffered rows (one resize per dataset) and flushes the file to the OS."""
        self._check_open()
        self._last_flush_s = time.monotonic()
        if not self._rows:
            return
        new_paths = list(dict.fromkeys(p for _, row in self._rows for p in row if p not in self._columns))
        if new_paths:
            with self._outside_swmr() as f:
                for path in new_paths:
                    # The fill value backfills the rows logged before this key existed.
                    f.create_dataset(
                        f"metrics/{path}",
                        shape=(self._num_rows,),
                        maxshape=(None,),
                        chunks=(CHUNK_ROWS,),
                        dtype="f8",
                        fillvalue=np.nan,
                    )
        start, stop = self._num_rows, self._num_rows + len(self._rows)
        for path, ds in self._columns.items():
            ds.resize((stop,))
            ds[start:stop] = np.array([row.get(path, np.nan) for _, row in self._rows], dtype=np.float64)
        # The step index grows last: a reader never sees a step whose values are not written yet.
        self._step_ds.resize((stop,))
        self._step_ds[start:stop] = np.array([step for step, _ in self._rows], dtype=np.int64)
        self._file.flush()
        self._num_rows = stop
        self._last_step = self._rows[-1][0]
        self._rows.clear()

    @_serialized
    def event(
        self,
        kind: str,
        *,
        step: int | None,
        detail: Mapping[str, Any] | None = None,
        time_s: float | None = None,
    ) -> None:
        """Appends an event (``preempted``, ``thermal_pause``, ...) and flushes it, with the buffered rows, at once."""
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        step_value = -1 if step is None else _as_step(step, "event step")
        if step is not None and step_value < 0:
            raise ValueError(f"event step must be >= 0, or None for an event outside any step; got {step_value}")
        try:
            detail_json = json.dumps(dict(detail or {}), sort_keys=True)
        except (TypeError, ValueError) as error:
            raise TypeError(f"the detail of event {kind!r} is not JSON-serialisable: {error}") from error
        time_value = time.time() if time_s is None else float(time_s)
        # A preemption event is often the last thing a job writes: the rows before it must not be lost.
        self.flush()
        index = self._num_events
        with self._outside_swmr():
            values = {"step": step_value, "kind": kind, "detail": detail_json, "time_s": time_value}
            # time_s goes last: _repair_lengths cuts an event whose writer died half way.
            for name in ("step", "kind", "detail", "time_s"):
                ds = self._events[name]
                ds.resize((index + 1,))
                ds[index] = values[name]
        self._num_events = index + 1
        if self._sinks is not None:
            self._sinks.event(kind, None if step is None else step_value, json.loads(detail_json))

    @_serialized
    def rename_events(self, kind: str, new_kind: str) -> int:
        """Renames every event of `kind` (a `finished` that a resumed run supersedes); returns how many."""
        if not new_kind:
            raise ValueError("new_kind must be a non-empty string")
        self.flush()
        kinds = self._events["kind"].asstr()[: self._num_events]
        indices = [i for i, k in enumerate(kinds) if k == kind]
        if indices:
            with self._outside_swmr():
                for i in indices:
                    self._events["kind"][i] = new_kind
        return len(indices)

    @_serialized
    def truncate_after(self, step: int) -> None:
        """Drops the metric rows after ``step`` (all of them for ``step=-1``); events are kept as history."""
        step = _as_step(step, "step")
        self.flush()
        steps = self._step_ds[: self._num_rows]
        num_rows = int(np.searchsorted(steps, step, side="right"))
        if num_rows == self._num_rows:
            return
        with self._outside_swmr():
            # The step index shrinks first, so a reader never pairs a step with a dropped value.
            self._step_ds.resize((num_rows,))
            for ds in self._columns.values():
                ds.resize((num_rows,))
        self._num_rows = num_rows
        self._last_step = int(steps[num_rows - 1]) if num_rows else None

    @_serialized
    def set_root_attrs(self, attrs: Mapping[str, str]) -> None:
        """Sets (or replaces) string root attributes: config YAML, versions JSON, git commit, hosts."""
        for name, value in attrs.items():
            if not isinstance(name, str) or not name or name in _RESERVED_ATTRS:
                raise ValueError(f"invalid root attribute name {name!r} (empty, or reserved by hpcrl)")
            if not isinstance(value, str):
                raise TypeError(
                    f"root attribute {name!r} is a {type(value).__name__}; pass a string (e.g. json.dumps(value))"
                )
        with self._outside_swmr() as f:
            for name, value in attrs.items():
                f.attrs[name] = value

    @property
    def last_step(self) -> int | None:
        """The step of the last row logged (buffered or written), None when there is none."""
        return self._rows[-1][0] if self._rows else self._last_step

    @property
    def num_rows(self) -> int:
        """Rows written to the file plus rows still buffered."""
        return self._num_rows + len(self._rows)

    @_serialized
    def close(self) -> None:
        """Flushes the buffered rows and closes the file; closing twice is harmless."""
        if self._sinks is not None:
            sinks, self._sinks = self._sinks, None
            sinks.close()
        if self._file.id.valid:
            try:
                self.flush()
            finally:
                self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


# -- reading -----------------------------------------------------------------------------------------


# What h5py raises reading a file that is truncated, corrupt, or being extended: RuntimeError comes from its object
# visitation (HDF5's H5Ovisit) walking a group header that a SWMR writer is still extending.
_READ_ERRORS = (OSError, KeyError, ValueError, RuntimeError)


@contextmanager
def _open_for_read(path: str | os.PathLike[str]) -> Iterator[h5py.File]:
    path = Path(path)
    if not path.exists():
        raise StoreError(f"metrics file {path} does not exist; pass the metrics.h5 of an hpcrl run directory")
    if not h5py.is_hdf5(path):
        raise StoreError(f"{path} is not an HDF5 file (no HDF5 signature), so not an hpcrl metrics file")
    f = _open_hdf5_for_read(path)
    try:
        try:
            format_name = f.attrs.get(FORMAT_ATTR)
        except _READ_ERRORS as error:  # a bit flip in the root's header fails its checksum here
            raise StoreError(f"cannot read {path} ({error}); the file is truncated or corrupt") from error
        if format_name != METRICS_FORMAT:
            raise StoreError(
                f"{path} is an HDF5 file but not an hpcrl metrics file (no root attribute "
                f"{FORMAT_ATTR}={METRICS_FORMAT!r}); pass the metrics.h5 of an hpcrl run directory"
            )
        try:
            yield f
        except _READ_ERRORS as error:
            raise StoreError(f"cannot read {path} ({error}); the file is truncated or corrupt") from error
    finally:
        f.close()


def _read(path: str | os.PathLike[str], read: Callable[[h5py.File], _T]) -> _T:
    """read(f) on the metrics file. While a writer has the file open, a read that fails is retried for up to
    _READ_RETRY_S: under SWMR, HDF5 does not order an appended variable-length string (an event's kind or detail)
    with its dataset's new extent, so a reader between the two fails with "len not positive after adjustment for
    EOA" (seen in CI), and a moment later reads it whole; the same holds for a group the writer is adding a metric
    to, where visiting the group failed with "Object visitation failed (address of object past end of
    allocation)" (seen in CI). A file no writer has open fails at once."""
    deadline_s = time.monotonic() + _READ_RETRY_S
    while True:
        with _open_for_read(path) as f:
            try:
                return read(f)
            except _READ_ERRORS:
                live = _superblock_write_flags(Path(path)) & SUPERBLOCK_OPEN_FOR_WRITE
                if not live or time.monotonic() > deadline_s:
                    raise  # _open_for_read names the file and the problem
        time.sleep(_READ_RETRY_SLEEP_S)


def _superblock_write_flags(path: Path) -> int:
    """The file-consistency flags of a version ≥ 2 superblock at offset 0 (bit 0: open for write, bit 2: SWMR
    writing); 0 for older superblocks, which hpcrl's writers never make."""
    with open(path, "rb") as f:
        head = f.read(12)
    return head[11] if len(head) == 12 and head[8] >= 2 else 0


def _open_hdf5_for_read(path: Path) -> h5py.File:
    # A closed file opens normally, which also checks that it is not truncated; a file that a writer has
    # open only opens through SWMR. locking=False so that readers never block the writer.
    deadline_s = time.monotonic() + _READ_RETRY_S
    while True:
        try:
            return h5py.File(path, "r", locking=False)
        except OSError as error:
            # HDF5 checks the stored end of file before the write flags, so a file a writer is extending also
            # reads as truncated. The flags tell them apart; SWMR must not open a closed file that is truncated,
            # because it skips that check and reads the missing bytes as zeros.
            truncated = "truncated file" in str(error)
            if truncated and not _superblock_write_flags(path) & SUPERBLOCK_OPEN_FOR_WRITE:
                raise StoreError(f"cannot open {path} ({error}); the file is truncated or corrupt") from error
            if not truncated and not is_open_for_write(error):
                raise StoreError(f"cannot open {path} ({error}); the file is truncated or corrupt") from error
        try:
            return h5py.File(path, "r", swmr=True, locking=False)
        except OSError as error:
            # The writer is briefly outside SWMR (adding a metric key or an event): wait for it. HDF5 says
            # "already open for write", or "not already open for SWMR writing" when it caught the switch.
            outside_swmr = is_open_for_write(error) or "not already open for SWMR writing" in str(error)
            if not outside_swmr or time.monotonic() > deadline_s:
                raise StoreError(
                    f"cannot open {path} while it is being written ({error}); the writer has held it outside "
                    f"SWMR for over {_READ_RETRY_S} s or was killed there: retry, or wait for the run to resume"
                ) from error
        time.sleep(_READ_RETRY_SLEEP_S)


def load_metrics(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Returns ``{"step": int64 array, "<group>/<name>": float64 array, ...}``, all the same length.

    Works while a writer has the file open; rows it has not flushed yet are not seen.
    """

    def read(f: h5py.File) -> dict[str, np.ndarray]:
        datasets: dict[str, h5py.Dataset] = {}

        def visit(name: str, obj: h5py.HLObject) -> None:
            if isinstance(obj, h5py.Dataset):
                datasets[name] = obj

        f["metrics"].visititems(visit)
        # A reader may land between two dataset resizes of one flush: keep the rows all datasets have.
        num_rows = min(ds.shape[0] for ds in datasets.values())
        return {name: ds[:num_rows] for name, ds in datasets.items()}

    columns = _read(path, read)
    return {"step": columns.pop("step"), **dict(sorted(columns.items()))}


def load_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Returns the events in order as ``{"time_s", "step" (None if none), "kind", "detail" (dict)}``."""

    def read(f: h5py.File) -> tuple[Any, ...]:
        datasets = {name: f[f"events/{name}"] for name in EVENT_FIELDS}
        num_events = min(ds.shape[0] for ds in datasets.values())
        return (
            datasets["time_s"][:num_events],
            datasets["step"][:num_events],
            datasets["kind"].asstr()[:num_events],
            datasets["detail"].asstr()[:num_events],
        )

    time_s, steps, kinds, details = _read(path, read)
    return [
        {
            "time_s": float(t),
            "step": None if s < 0 else int(s),
            "kind": str(k),
            "detail": json.loads(d),
        }
        for t, s, k, d in zip(time_s, steps, kinds, details, strict=True)
    ]


def load_root_attrs(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Returns the root attributes set by the writer's caller (config, versions, git commit, hosts)."""
    attrs = _read(path, lambda f: {name: value for name, value in f.attrs.items() if name not in _RESERVED_ATTRS})
    return {name: value.decode() if isinstance(value, bytes) else _to_python(value) for name, value in attrs.items()}


def _to_python(value: object) -> object:
    return value.tolist() if isinstance(value, np.ndarray | np.generic) else value


def load_metrics_frame(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Returns the metrics as a pandas DataFrame indexed by step (needs ``pip install hpcrl[report]``)."""
    try:
        import pandas as pd
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "load_metrics_frame needs pandas: pip install 'hpcrl[report]' (or use load_metrics)"
        ) from error
    columns = load_metrics(path)
    steps = columns.pop("step")
    return pd.DataFrame(columns, index=pd.Index(steps, name="step"))
