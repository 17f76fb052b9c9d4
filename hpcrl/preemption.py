"""Preemption signals (SIGTERM, SIGUSR2), noted from the very start of a process.

Slurm may signal a job while its processes are still importing torch or loading a model; a signal's
default action would kill them there, and the run would lose the chance to checkpoint and record the
preemption. So the command line installs this note-taking handler first, and the driver acts on the
note at its next safe point.
"""

from __future__ import annotations

import signal
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
_received: list[int] = []


def _note(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)


def watch() -> None:
    for sig in SIGNALS:
        signal.signal(sig, _note)


def received() -> int | None:
    """The first preemption signal received, None if none."""
    return _received[0] if _received else None
