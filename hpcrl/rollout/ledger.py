"""The prompt ledger of an asynchronous run: what became of every position of the data order drawn so far.

A position is `pending` (drawn: generating, or waiting to be re-issued), `buffered` (a finished group in the
buffer, or taken by the step being trained), `trained` (at step s) or `dropped` (with a reason). Dropped
attempts that were retried keep their reasons in `drops`. The ledger is part of the checkpoint
(hpcrl/rollout/producer.py), so after any number of preemptions it says, for each position below the
highest drawn, that it was trained exactly once or dropped with a recorded reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINAL = ("trained", "dropped")


@dataclass
class Entry:
    status: str = "pending"  # pending | buffered | trained | dropped
    step: int | None = None  # the step that trained it
    reason: str | None = None  # why it was dropped (final)
    drops: list[str] = field(default_factory=list)  # reasons of attempts retried
    attempts: int = 1


class PromptLedger:
    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}

    def drawn(self, position: int) -> None:
        assert position not in self.entries, f"position {position} drawn twice"
        self.entries[position] = Entry()

    def set(self, position: int, status: str) -> None:
        entry = self.entries[position]
        assert entry.status not in FINAL, f"position {position} is already {entry.status}"
        entry.status = status

    def trained(self, position: int, step: int) -> None:
        self.set(position, "trained")
        self.entries[position].step = step

    def dropped(self, position: int, reason: str) -> None:
        self.set(position, "dropped")
        self.entries[position].reason = reason

    def retried(self, position: int, reason: str) -> None:
        entry = self.entries[position]
        self.set(position, "pending")
        entry.drops.append(reason)
        entry.attempts += 1

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(("pending", "buffered", "trained", "dropped"), 0)
        for entry in self.entries.values():
            out[entry.status] += 1
        return out

    # ----- JSON (in the checkpoint and in run_dir/prompt_ledger.json) -----
    def to_json(self) -> dict[str, Any]:
        positions = sorted(self.entries)
        rows = [self.entries[p] for p in positions]
        return {
            "position": positions,
            "status": [e.status for e in rows],
            "step": [e.step for e in rows],
            "reason": [e.reason for e in rows],
            "drops": [e.drops for e in rows],
            "attempts": [e.attempts for e in rows],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PromptLedger:
        ledger = cls()
        for p, status, step, reason, drops, attempts in zip(
            data["position"], data["status"], data["step"], data["reason"], data["drops"], data["attempts"], strict=True
        ):
            ledger.entries[int(p)] = Entry(status, step, reason, list(drops), int(attempts))
        return ledger


def ledger_problems(data: dict[str, Any], *, num_drawn: int, prompts_per_step: int | None = None) -> list[str]:
    """What breaks the invariant in a ledger's JSON: a position below `num_drawn` missing or not final, a
    dropped one without a reason, a step that trained other than `prompts_per_step` prompts."""
    ledger = PromptLedger.from_json(data)
    problems = []
    for p in range(num_drawn):
        entry = ledger.entries.get(p)
        if entry is None:
            problems.append(f"position {p} was drawn but is not in the ledger")
        elif entry.status not in FINAL:
            problems.append(f"position {p} is {entry.status}, neither trained nor dropped")
        elif entry.status == "dropped" and not entry.reason:
            problems.append(f"position {p} was dropped without a reason")
    extra = sorted(set(ledger.entries) - set(range(num_drawn)))
    if extra:
        problems.append(f"positions {extra[:5]} are beyond the {num_drawn} drawn")
    if prompts_per_step is not None:
        per_step: dict[int, int] = {}
        for entry in ledger.entries.values():
            if entry.status == "trained":
                assert entry.step is not None
                per_step[entry.step] = per_step.get(entry.step, 0) + 1
        for s, n in sorted(per_step.items()):
            if n != prompts_per_step:
                problems.append(f"step {s} trained {n} prompts, not {prompts_per_step}")
    return problems
