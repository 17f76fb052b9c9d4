"""What keeps a run directory safe: one writer at a time, and nothing a restart or a resume would lose.

- `RunDirLock`: one `hpcrl run` per run directory, also across the nodes of a shared filesystem. A POSIX
  record lock (`fcntl.lockf`, which NFS and Lustre forward to their lock managers) on
  `run_dir/.hpcrl.lock`, plus an owner record (host, pid, job id, start time) in that file so that a
  refused run can say who holds the directory. The kernel drops the lock when its holder dies, however
  it dies, so a stale record never blocks a rerun.
- `RunDirContents`: what a directory holds that a fresh start would overwrite (metric rows, checkpoint
  files, an exported model) and the config it recorded (config.yaml, else metrics.h5's root attribute).
- `check_can_continue`: whether this config may run here, decided before anything is written. It refuses
  a fresh start over rows, checkpoints or a model, a resume under a different config (naming each key,
  old -> new, and how many steps the directory holds), and a num_steps below the steps recorded.
- `set_aside`: `hpcrl run --restart` moves the old contents into `run_dir/superseded-<UTC time>/`;
  nothing is deleted.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import fcntl
import json
import os
import re
import socket
import stat
import time
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCK_NAME = ".hpcrl.lock"
SUPERSEDED_PREFIX = "superseded-"
# Held by the driver while it runs; everything else in the directory may be set aside by --restart.
_KEEP_IN_PLACE = (LOCK_NAME,)


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message says what is there and what to do."""


# ---------------------------------------------------------------------------------------------------
# One writer per run directory


class RunDirLock:
    """An exclusive lock on a run directory, held from `acquire` until `release` or the process's end."""

    def __init__(self, run_dir: Path, fd: int, job_id: str) -> None:
        self.run_dir = run_dir
        self.job_id = job_id
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: Path, *, job_id: str) -> RunDirLock:
        """Lock `run_dir` (created if missing) or raise RunDirError naming the process that holds it."""
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(
                f"cannot create the run directory {run_dir}: {exc.strerror}; choose a --run-dir on a writable "
                "filesystem"
            ) from None
        path = run_dir / LOCK_NAME
        # No O_TRUNC: the record of a live holder must survive a refused attempt.
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_owner(fd)
            os.close(fd)
            raise RunDirError(
                f"{run_dir} is in use by another hpcrl run ({_describe_owner(holder)}); one run writes a run "
                "directory at a time. Wait for it to end (or stop it), or use another --run-dir"
            ) from None
        return cls(run_dir, fd, job_id)

    def record_owner(self) -> None:
        """Write who holds the lock (host, pid, job id, time) for a refused run to name. Separate from
        `acquire`, so that a run refused by the checks after it leaves the directory exactly as it was."""
        assert self._fd is not None, "record_owner after release"
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": self.job_id, "started_s": time.time()}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(owner) + "\n").encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the POSIX lock
            self._fd = None


def open_no_follow(path: Path, flags: int, mode: int = 0o600) -> int:
    """`os.open` of a run-directory file that is never a symbolic link or anything but a regular file.

    Whoever can write the directory could plant `path` as a link to another of the user's files, which the
    run would then overwrite; a FIFO would block the run. Both are refused, naming the file. Errors of the
    filesystem (read-only, no permission) become a RunDirError naming the file and the fix."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RunDirError(
                f"{path} is a symbolic link (to {_link_target(path)}); hpcrl never writes through a link in a run "
                "directory. Remove the link (nothing was written to its target), or use another --run-dir"
            ) from None
        if exc.errno == errno.ENXIO:  # a FIFO without a reader
            raise RunDirError(f"{path} is not a regular file; remove it, or use another --run-dir") from None
        raise RunDirError(
            f"cannot write {path}: {exc.strerror}; the run directory must be writable by you (use another "
            "--run-dir, or fix its permissions)"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunDirError(f"{path} is not a regular file; remove it, or use another --run-dir")
    os.set_blocking(fd, True)
    return fd


def write_file_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `path` whole through `<path>.tmp` and a rename, refusing a link planted at either name."""
    refuse_link(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def refuse_link(path: Path) -> None:
    """Raise RunDirError when `path` (a file or folder of the run directory) is a symbolic link."""
    if path.is_symlink():
        raise RunDirError(
            f"{path} is a symbolic link (to {_link_target(path)}); hpcrl never writes through a link in a run "
            "directory. Remove the link (nothing was written to its target), or use another --run-dir"
        )


# What a run writes into its directory by name (checked before its first write there).
RUN_DIR_ENTRIES = (
    "config.yaml",
    "metrics.h5",
    "checkpoints",
    "logs",
    "engines",
    "model",
    "model.tmp",
    "prompt_ledger.json",
    "sinks.json",
    "tensorboard",
    "mlruns",
    "wandb",
)


def refuse_planted_links(run_dir: Path) -> None:
    """Raise RunDirError when one of the names a run writes in `run_dir` is a symbolic link."""
    for name in RUN_DIR_ENTRIES:
        refuse_link(run_dir / name)
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        # A checkpoint's name planted as a link: a save of that step would replace it, a resume would read it.
        for entry in sorted(checkpoints.iterdir()):
            refuse_link(entry)


def make_subdir(path: Path) -> Path:
    """Create a folder of the run directory (a planted link in its place is refused)."""
    refuse_link(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create {path}: {exc.strerror}; the run directory must be writable by you") from None
    return path


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _read_owner(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe_owner(owner: Mapping[str, Any]) -> str:
    if not owner:
        return "no owner record yet"
    started = owner.get("started_s")
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, float) else "?"
    job = owner.get("job_id")
    job_text = f", Slurm job {job}" if job and job != "local" else ""
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}{job_text}, since {since}"


_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x1b": "an escape character"}


def checked_path_text(text: str) -> str:
    """`text` when it can name a file or folder hpcrl writes (argparse's type= for an output path or a run dir);
    otherwise ValueError (argparse.ArgumentTypeError from the type= wrappers) naming the character.

    A control character (a newline, a tab, an escape) is legal in a Linux file name, but the name is printed
    into logs, progress lines and generated scripts, where it would split a line or forge one."""
    for char in text:
        if unicodedata.category(char) == "Cc":
            what = _CONTROL_NAMES.get(char, "a control character")
            raise ValueError(
                f"{text!r} contains {what} (U+{ord(char):04X}); hpcrl does not write to a path with a control "
                "character: choose a path of printable characters"
            )
    if not text:
        raise ValueError("an empty path; name a file or folder")
    return text


def path_arg(text: str) -> str:
    """argparse's type= for a path hpcrl writes (-o, --run-dir)."""
    try:
        return checked_path_text(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---------------------------------------------------------------------------------------------------
# What is there


@dataclass(frozen=True)
class RunDirContents:
    """What a run directory holds that a fresh start would overwrite, and the config it recorded."""

    run_dir: Path
    num_metric_rows: int = 0
    last_step: int | None = None
    metrics_error: str | None = None
    """Why metrics.h5 could not be read (it exists but is damaged), None if it reads or is absent."""
    checkpoints: list[Path] = field(default_factory=list)
    set_aside_checkpoints: list[Path] = field(default_factory=list)
    """Checkpoints an earlier resume found unreadable and renamed to `*.unreadable`."""
    has_model: bool = False
    recorded_config: dict[str, Any] | None = None
    config_source: str | None = None
    """Where `recorded_config` comes from: "config.yaml" or "metrics.h5"."""

    @property
    def num_steps_recorded(self) -> int:
        """Steps whose metric rows the directory holds (0 to last_step)."""
        return 0 if self.last_step is None else self.last_step + 1

    def holds_results(self) -> bool:
        """True when a fresh start here would overwrite something a run produced."""
        produced = (self.num_metric_rows, self.metrics_error, self.checkpoints, self.set_aside_checkpoints)
        return any(produced) or self.has_model

    def describe(self, unreadable: Mapping[str, str] | None = None) -> str:
        """ "12 metric rows (steps 1 to 12), 2 unreadable checkpoints (...) and model/"."""
        parts = []
        if self.num_metric_rows:
            parts.append(f"{self.num_metric_rows} metric rows (steps 1 to {self.num_steps_recorded}) in metrics.h5")
        if self.metrics_error:
            parts.append(f"a metrics.h5 that cannot be read ({self.metrics_error})")
        unreadable = unreadable or {}
        if unreadable:
            reasons = "; ".join(f"{name}: {reason}" for name, reason in unreadable.items())
            parts.append(f"{len(unreadable)} unreadable checkpoint(s) ({reasons})")
        readable = [p for p in self.checkpoints if p.name not in unreadable]
        if readable:
            parts.append(f"{len(readable)} checkpoint(s) ({', '.join(p.name for p in readable)})")
        if self.set_aside_checkpoints:
            names = ", ".join(p.name for p in self.set_aside_checkpoints)
            parts.append(f"{len(self.set_aside_checkpoints)} checkpoint(s) found unreadable earlier ({names})")
        if self.has_model:
            parts.append("an exported model in model/")
        if not parts:
            return "nothing a run produced"
        return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def inspect_run_dir(run_dir: Path) -> RunDirContents:
    """Read what `run_dir` holds without changing anything (a missing directory holds nothing)."""
    from hpcrl.config import ConfigError, load_yaml
    from hpcrl.store.checkpoint import list_checkpoints
    from hpcrl.store.metrics import StoreError, load_metrics, load_root_attrs

    num_rows, last_step, metrics_error = 0, None, None
    metrics_config: dict[str, Any] | None = None
    metrics_path = run_dir / "metrics.h5"
    if metrics_path.exists():
        try:
            steps = load_metrics(metrics_path)["step"]
            num_rows, last_step = len(steps), (int(steps[-1]) if len(steps) else None)
            text = load_root_attrs(metrics_path).get("config")
            if isinstance(text, str) and text:
                metrics_config = _parse_config_text(text)
        except StoreError as exc:
            metrics_error = str(exc)
    recorded, source = None, None
    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        try:
            recorded, source = load_yaml(config_path), "config.yaml"
        except ConfigError as exc:
            raise RunDirError(
                f"{config_path} is unreadable ({exc}); move the run directory aside or use another --run-dir"
            ) from exc
    if metrics_config is not None and (recorded is None or num_rows):
        # The rows are labelled by the config metrics.h5 recorded: that one decides, even when config.yaml
        # is missing or was edited by hand.
        recorded, source = metrics_config, "metrics.h5"
    return RunDirContents(
        run_dir=run_dir,
        num_metric_rows=num_rows,
        last_step=last_step,
        metrics_error=metrics_error,
        checkpoints=list_checkpoints(run_dir / "checkpoints"),
        set_aside_checkpoints=sorted((run_dir / "checkpoints").glob(f"step_*.h5{UNREADABLE_SUFFIX}")),
        has_model=(run_dir / "model").exists(),
        recorded_config=recorded,
        config_source=source,
    )


def _parse_config_text(text: str) -> dict[str, Any] | None:
    import yaml

    from hpcrl.config import ConfigError, _parse_yaml

    try:
        data = _parse_yaml(text, "metrics.h5's recorded config")
    except (ConfigError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


# ---------------------------------------------------------------------------------------------------
# May this config run here?


def check_can_continue(
    contents: RunDirContents, cfg: Any, *, resume_step: int | None, unreadable: Mapping[str, str]
) -> None:
    """Raise RunDirError unless `cfg` can start or resume in `contents.run_dir` without losing anything.

    `resume_step` is the step of the checkpoint the run will resume from (None: a fresh start);
    `unreadable` maps the checkpoint files that failed to load to the reason.
    """
    where = contents.run_dir
    if resume_step is None:
        if contents.holds_results():
            raise RunDirError(
                f"{where} holds {contents.describe(unreadable)}, but no checkpoint to resume from, so a fresh "
                f"start would overwrite them. To start over on purpose, rerun with --restart (which moves "
                f"them into {where}/{SUPERSEDED_PREFIX}<time>/), or use another --run-dir"
            )
        # Nothing was recorded (a run that failed before its first step): its config labels nothing.
        return
    steps_done = max(resume_step + 1, contents.num_steps_recorded)
    differences = config_differences(contents.recorded_config, cfg) if contents.recorded_config is not None else []
    if differences:
        raise RunDirError(
            f"{where} holds {steps_done} steps of a run with a different config ({contents.config_source} "
            f"recorded it): {'; '.join(differences)}. Resume it with the same config and overrides (num_steps "
            "may change, and so may num_ranks, with train.backend=megatron the TP/PP split, with train.backend=torch "
            "the parallelism and its settings), or start a new run "
            "with another --run-dir (or --restart, which moves the old one aside)"
        )
    if cfg.num_steps < steps_done:
        raise RunDirError(
            f"{where} holds {steps_done} steps but num_steps={cfg.num_steps}; a run never drops recorded "
            f"steps: keep num_steps >= {steps_done} (num_steps={steps_done} leaves it as it is), or use "
            "another --run-dir"
        )


def config_differences(recorded: Mapping[str, Any], cfg: Any) -> list[str]:
    """The keys where `cfg` differs from a recorded config, as "train.lr: 0.0005 -> 0.001".

    Ignores num_steps (extending a run is a normal request), num_ranks, the split of the model over them (for
    train.backend=megatron the TP/PP split, for torch the parallelism, fsdp and activation checkpointing: both
    backends' checkpoints hold the whole model), and the logging section.
    """
    from hpcrl.config import ConfigError, from_dict, to_dict

    try:
        old = to_dict(_comparable(from_dict(type(cfg), recorded)))
    except (ConfigError, TypeError, ValueError):
        # Written by a version of hpcrl with other keys: compare what is there.
        old = dict(recorded)
    new = to_dict(_comparable(cfg))
    flat_old, flat_new = _flatten(old), _flatten(new)
    out = []
    for key in sorted(set(flat_old) | set(flat_new)):
        a, b = flat_old.get(key, "(absent)"), flat_new.get(key, "(absent)")
        if a != b and not (a != a and b != b):  # NaN == NaN here
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def _comparable(cfg: Any) -> Any:
    train = cfg.train
    if train.backend == "megatron":
        train = dataclasses.replace(
            train, num_ranks=1, tensor_parallel_size=1, pipeline_parallel_size=1, expert_parallel_size=1
        )
    else:  # its checkpoints hold whole tensors under either parallelism (FSDP2 gathers them)
        train = dataclasses.replace(
            train, num_ranks=1, parallelism="ddp", fsdp=type(train.fsdp)(), activation_checkpointing="none"
        )
    # The logging sinks copy metrics and change nothing a checkpoint holds: a resumed run may add or drop one.
    return dataclasses.replace(cfg, num_steps=0, train=train, logging=type(cfg.logging)())


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


# ---------------------------------------------------------------------------------------------------
# Starting over on purpose


def set_aside(run_dir: Path) -> Path | None:
    """Move everything in `run_dir` (but the lock and earlier set-aside folders) into a new
    `superseded-<UTC time>/` folder; returns it, or None when there was nothing to move."""
    entries = [
        p
        for p in sorted(run_dir.iterdir())
        if p.name not in _KEEP_IN_PLACE and not p.name.startswith(SUPERSEDED_PREFIX)
    ]
    if not entries:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir / f"{SUPERSEDED_PREFIX}{stamp}"
    suffix = 1
    while target.exists():
        target, suffix = run_dir / f"{SUPERSEDED_PREFIX}{stamp}-{suffix}", suffix + 1
    target.mkdir()
    for entry in entries:
        os.replace(entry, target / entry.name)
    return target


# ---------------------------------------------------------------------------------------------------
# A start that failed before its first step


# What a start writes before its first step and that labels nothing once no step is recorded.
_START_FILES = ("config.yaml", "metrics.h5", "sinks.json")
_START_FOLDERS = ("engines", "checkpoints", "logs", "tensorboard")


def forget_failed_start(run_dir: Path, before: set[str], *, created: bool) -> list[str]:
    """Remove what a start that failed before its first step wrote into `run_dir`, so that the next start
    meets the directory as it was (`before`: its entries then; `created`: the start made the directory).

    Nothing is removed when the directory holds a metric row, a checkpoint or a model: those are results.
    Entries that were there before stay; a log that is not empty stays (it says why the start failed).
    Called with the run-dir lock held. Returns the names removed."""
    try:
        if inspect_run_dir(run_dir).holds_results():
            return []
    except (RunDirError, OSError):
        return []  # an unreadable config or folder: leave everything as it is
    removed = []
    for name in _START_FILES:
        path = run_dir / name
        if name not in before and path.is_file() and not path.is_symlink():
            path.unlink()
            removed.append(name)
    for name in _START_FOLDERS:
        path = run_dir / name
        if name not in before and path.is_dir() and not path.is_symlink():
            for child in path.iterdir():  # an engine's rendezvous file, an empty log
                if not child.is_symlink() and child.is_file() and (name == "engines" or child.stat().st_size == 0):
                    child.unlink()
            try:
                path.rmdir()
                removed.append(name + "/")
            except OSError:
                pass  # a log that says why the start failed
    if created and [p.name for p in run_dir.iterdir()] == [LOCK_NAME]:
        (run_dir / LOCK_NAME).unlink()
        try:
            run_dir.rmdir()
        except OSError:
            pass
    return removed


# ---------------------------------------------------------------------------------------------------
# Where to resume


@dataclass
class ResumePoint:
    """The newest checkpoint that loads (None: none does), and the newer ones that failed, with why."""

    checkpoint: Any = None
    unreadable: dict[str, str] = field(default_factory=dict)


def find_resume_point(ckpt_dir: Path) -> ResumePoint:
    """Load the newest checkpoint of `ckpt_dir` that passes its checksums; changes nothing on disk."""
    from hpcrl.store.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

    point = ResumePoint()
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            point.checkpoint = load_checkpoint(path)
            break
        except CheckpointError as exc:
            point.unreadable[path.name] = str(exc)
    return point


UNREADABLE_SUFFIX = ".unreadable"


def keep_unreadable(ckpt_dir: Path, names: list[str]) -> dict[str, Path]:
    """Rename checkpoints that failed to load to `<name>.unreadable`, so that retention (which deletes old
    and abandoned checkpoints) never deletes them and no resume tries them again; returns name -> new path."""
    kept = {}
    for name in names:
        target = ckpt_dir / (name + UNREADABLE_SUFFIX)
        if (ckpt_dir / name).exists() and not target.exists():
            os.replace(ckpt_dir / name, target)
            kept[name] = target
    return kept


_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def default_run_dir(name: str) -> Path:
    """`runs/<the config's name:>`: where `hpcrl run`, `sbatch` and `submit` put a run without --run-dir."""
    if not _RUN_NAME.fullmatch(name):
        raise RunDirError(
            f"name: {name!r} cannot name a run directory (runs/<name>): use letters, digits, '.', '_' and '-' "
            "(not starting with '.' or '-'), or pass --run-dir DIR"
        )
    return Path("runs") / name


def finished_run(run_dir: Path, cfg: Any) -> int | None:
    """The steps done when `run_dir` already holds the checkpoint of all cfg.num_steps steps, else None.

    Decided before any engine or trainer starts: only the newest checkpoint's header is read, and its tensors
    are verified (loaded) only when that header says the run is done. A different config is refused here as a
    resume would refuse it.
    """
    from hpcrl.store.checkpoint import checkpoint_step, list_checkpoints

    checkpoints = list_checkpoints(run_dir / "checkpoints")
    newest = checkpoint_step(checkpoints[-1]) if checkpoints else None
    if cfg.num_steps <= 0 or newest is None or newest + 1 < cfg.num_steps:
        return None
    point = find_resume_point(run_dir / "checkpoints")
    if point.checkpoint is None or point.checkpoint.step + 1 < cfg.num_steps:
        return None  # the newest is damaged: the run resumes from an older one
    check_can_continue(inspect_run_dir(run_dir), cfg, resume_step=point.checkpoint.step, unreadable={})
    return int(point.checkpoint.step) + 1
