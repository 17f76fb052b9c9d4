"""The error of a failed weight push."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A push failed; the message names the engine and the call. The publisher heals and pushes all again."""
