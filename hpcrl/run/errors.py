"""The error of a run that cannot go on."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run cannot go on; the message says why and what to do."""
