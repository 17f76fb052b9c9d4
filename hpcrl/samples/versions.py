"""Weight versions inside hpcrl: ints, the number of GRPO optimizer steps behind the weights.

`INITIAL_VERSION` (0) is the weights before any GRPO step: the model as loaded, or the SFT warm start's result.
The push after step s (0-based) is version s + 1, so step s trains the policy of version s. Engines speak
strings (hpcrl/engine/versions.py converts at the engine client).
"""

from __future__ import annotations

INITIAL_VERSION = 0

# What checkpoints written while versions were strings hold beside the digits: the warm start's label, and
# SGLang's name for the weights an engine loaded at start. Both are the weights before any GRPO step.
_OLD_LABELS = {"sft": INITIAL_VERSION, "default": INITIAL_VERSION}


def stored_version(value: object) -> int | None:
    """A weight version as a checkpoint holds it: an int, or (before versions were ints) its string, "sft" and
    "default" being 0. None for None, and for another label (a version outside the run's order: never stale)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value.isascii() and value.isdigit():
            return int(value)
        return _OLD_LABELS.get(value)
    return None
