"""The bounded group buffer of an asynchronous run, and the verdicts that drop a group.

Finished groups wait here until the trainer collects them. `put` blocks while the buffer is full
(backpressure: the producer then submits nothing new, and no group is ever dropped for want of space).
Verdicts: on arrival, a group with an aborted sample or one whose reward failed (`aborted`), and one the
filter rejects (`filtered`), one whose rewards are all equal under rollout.dynamic_sampling (`equal_rewards`); on
collection, one whose staleness exceeds `buffer.max_staleness` (`stale`).

Versions are ints, the number of optimizer steps behind the weights (hpcrl/samples/versions.py: 0 is the weights
before any GRPO step, the warm start's too). Staleness of a group consumed by step s (which trains the policy of
version s) is s minus the oldest version of any of its tokens.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np

from hpcrl.loader import LoadError, load_object
from hpcrl.samples.sample import Group

GroupFilter = Callable[[Group], bool]


class FilterError(ValueError):
    """The user's group filter (buffer.filter) raised, or returned something other than a bool."""


class CheckedFilter:
    """A user's filter that names its config key and path when it fails: it runs on the producer thread, far from
    the config line that chose it, and a non-bool verdict (None, a tensor, a string) must not pass as "keep"."""

    def __init__(self, fn: GroupFilter, spec: str) -> None:
        self.fn, self.spec = fn, spec

    def __call__(self, group: Group) -> bool:
        try:
            verdict = self.fn(group)
        except Exception as exc:  # noqa: BLE001 - re-raised with the key that names the function
            raise FilterError(
                f"buffer.filter={self.spec} raised {type(exc).__name__}: {exc} (on the group of prompt "
                f"{group.example.prompt[:80]!r}); fix the function, or set buffer.filter=null"
            ) from exc
        if not isinstance(verdict, bool | np.bool_):
            raise FilterError(
                f"buffer.filter={self.spec} returned {type(verdict).__name__} {_short(verdict)}, not a bool; "
                "return True to keep the group, False to drop it"
            )
        return bool(verdict)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class BufferedGroup:
    position: int  # in the data order
    attempt: int  # 0 first; a retried prompt is regenerated with fresh seeds
    group: Group
    oldest_version: int | None  # the oldest version of any of its tokens

    def staleness(self, trainer_version: int) -> int | None:
        return None if self.oldest_version is None else trainer_version - self.oldest_version


def zero_std(group: Group) -> bool:
    """Keep a group only if its rewards differ (equal rewards give GRPO no advantage to learn from)."""
    return len({s.reward for s in group.samples}) > 1


def load_filter(spec: str | None) -> GroupFilter | None:
    """`zero_std`, or a function of a Group named by a path (hpcrl/loader.py)."""
    if spec is None:
        return None
    if spec == "zero_std":
        return zero_std
    fn = load_object(spec, key="buffer.filter", builtins="zero_std")
    if not callable(fn):
        raise LoadError("buffer.filter", spec, f"it is a {type(fn).__name__}, not a function of a Group")
    return CheckedFilter(cast(GroupFilter, fn), spec)


def arrival_verdict(group: Group, keep: GroupFilter | None, *, dynamic: bool = False) -> str | None:
    """The reason to drop a group as it arrives, None to keep it; `dynamic`: rollout.dynamic_sampling."""
    if any(s.finish == "abort" for s in group.samples):
        return "aborted"
    if any(s.reward_error is not None for s in group.samples):
        return "reward_failed"  # counted with the aborted: a sample without a true reward
    if dynamic and not zero_std(group):
        return "equal_rewards"
    if keep is not None and not keep(group):
        return "filtered"
    return None


class GroupBuffer:
    """A FIFO of at most `capacity` groups. Its condition's lock is the owner's state lock (`lock`), so a
    group leaves the owner's in-flight set and enters the buffer in one step that a snapshot cannot split."""

    def __init__(self, capacity: int, lock: threading.RLock) -> None:
        self.capacity = capacity
        self.cond = threading.Condition(lock)
        self._items: deque[BufferedGroup] = deque()
        self.blocked_s = 0.0  # time put() waited for room, since the last reset

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[BufferedGroup]:
        return iter(list(self._items))

    def put(self, item: BufferedGroup, stop: threading.Event, on_added: Callable[[], None]) -> bool:
        """Wait for room and append (calling `on_added` under the lock); False if `stop` was set first."""
        with self.cond:
            t0 = time.perf_counter()
            while len(self._items) >= self.capacity and not stop.is_set():
                self.cond.wait(0.05)
            self.blocked_s += time.perf_counter() - t0
            if stop.is_set():
                return False
            self._items.append(item)
            on_added()
            self.cond.notify_all()
            return True

    def pop(self) -> BufferedGroup | None:
        """The oldest group, None when empty (the caller holds `cond` and waits on it)."""
        if not self._items:
            return None
        item = self._items.popleft()
        self.cond.notify_all()  # room for a blocked put
        return item

    def restore(self, items: list[BufferedGroup]) -> None:
        """Groups of a checkpoint, in order, ahead of anything new (may exceed capacity until collected)."""
        with self.cond:
            self._items.extendleft(reversed(items))
