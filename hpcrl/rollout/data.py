"""Prompt data: examples from JSONL files or a generated task, served in a deterministic, resumable order.

The batch of a step is a pure function of (seed, step): epoch e is a permutation of the examples seeded
by (seed, e), the epochs are laid end to end, and step s takes positions [s * batch_size, (s+1) *
batch_size) of that stream, wrapping from one epoch into the next. A resumed run therefore needs only the
step to continue where it stopped; the checkpointed `state()` exists to refuse a resume onto a dataset or
data config that has changed since.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from hpcrl.samples.sample import DataError, Example

__all__ = [
    "PromptSource",
    "build_examples",
    "load_jsonl",
    "make_addition_task",
    "make_product_task",
]


def load_jsonl(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Example]:
    """Read one example per line (blank lines are skipped); a numeric answer becomes its string."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"dataset file not found: {path} (relative paths start at {Path.cwd()})") from None
    except IsADirectoryError:
        raise DataError(f"dataset path is a directory, expected a .jsonl file: {path}") from None
    try:
        # utf-8-sig: files saved by some editors start with a byte-order mark that json.loads rejects.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line_number = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line_number}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None
    examples = [
        _parse_row(line, path, line_number, prompt_key, answer_key)
        for line_number, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
    if not examples:
        raise DataError(f"dataset {path} has no examples; expected one JSON object per line")
    return examples


def _parse_row(line: str, path: Path, line_number: int, prompt_key: str, answer_key: str) -> Example:
    where = f"{path}:{line_number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: invalid JSON at column {exc.colno}: {exc.msg}") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
    for key, option in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if key not in row:
            present = ", ".join(repr(k) for k in row) or "(none)"
            raise DataError(f"{where}: no field {key!r}; keys present: {present}; set {option} to the right name")
    prompt, answer = row[prompt_key], row[answer_key]
    if not isinstance(prompt, str):
        raise DataError(f"{where}: field {prompt_key!r} must be a string, got {type(prompt).__name__} {prompt!r}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise DataError(
            f"{where}: field {answer_key!r} must be a string or a number, got {type(answer).__name__} {answer!r}"
        )
    return Example(prompt=prompt, answer=answer)


def make_addition_task(num_examples: int, digits: int, seed: int) -> list[Example]:
    """Generated problems "a+b=" with answer str(a + b); each operand has 1 to `digits` digits.

    The same seed gives the same list on every platform and Python version (random.Random is stable).
    """
    if num_examples < 1:
        raise ValueError(f"num_examples must be at least 1, got {num_examples}")
    if digits < 1:
        raise ValueError(f"digits must be at least 1, got {digits}")
    rng = random.Random(seed)

    def operand() -> int:
        # Draw the length first so that short numbers are as common as long ones.
        num_digits = rng.randint(1, digits)
        return rng.randint(0 if num_digits == 1 else 10 ** (num_digits - 1), 10**num_digits - 1)

    examples = []
    for _ in range(num_examples):
        a, b = operand(), operand()
        examples.append(Example(prompt=f"{a}+{b}=", answer=str(a + b)))
    return examples


def make_product_task(num_examples: int, seed: int) -> list[Example]:
    """Generated problems "a*b=" with a 3-digit a, a 2-digit b and answer str(a * b): arithmetic a tiny model cannot
    do in its head, the multi-turn quickstart's task (it learns to call the calculator)."""
    if num_examples < 1:
        raise ValueError(f"num_examples must be at least 1, got {num_examples}")
    rng = random.Random(seed)
    examples = []
    for _ in range(num_examples):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        examples.append(Example(prompt=f"{a}*{b}=", answer=str(a * b)))
    return examples


_BUILDERS: dict[str, Callable[..., list[Example]]] = {"addition": make_addition_task, "product": make_product_task}


def source_options(
    source: str, *, num_examples: int, digits: int, seed: int, prompt_key: str, answer_key: str
) -> dict[str, Any]:
    """The options of data.* that the source `source` reads (the others do not apply to it)."""
    if source == "addition":
        return {"num_examples": num_examples, "digits": digits, "seed": seed}
    if source == "product" or source.startswith("reasoning_gym:"):
        return {"num_examples": num_examples, "seed": seed}
    return {"prompt_key": prompt_key, "answer_key": answer_key}


def build_examples(source: str, **kwargs: Any) -> list[Example]:
    """Examples from `source`: 'addition' (kwargs of `make_addition_task`), a .jsonl path (`load_jsonl`), a
    local dataset file (.parquet, .arrow, .json, .csv) or `save_to_disk` directory read through Hugging Face
    `datasets`, or 'reasoning_gym:TASK' (a procedural reasoning-gym task)."""
    from hpcrl.rollout import external_data

    fixed: tuple[Any, ...] = ()
    if source in _BUILDERS:
        builder = _BUILDERS[source]
    elif source.startswith(external_data.GYM_PREFIX):
        name = source[len(external_data.GYM_PREFIX) :]
        if not name:
            raise DataError("data.source 'reasoning_gym:' names no task; write e.g. reasoning_gym:chain_sum")
        builder, fixed = external_data.make_gym_task, (name,)
    elif source.endswith(".jsonl"):
        builder, fixed = load_jsonl, (source,)
    elif Path(source).suffix in external_data.DATASET_SUFFIXES or Path(source).is_dir():
        builder, fixed = external_data.load_dataset_file, (source,)
    else:
        raise DataError(
            f"unknown data source {source!r}; expected one of: {', '.join(_BUILDERS)}, a .jsonl file, a dataset "
            f"file ({', '.join(external_data.DATASET_SUFFIXES)}) or save_to_disk directory, or reasoning_gym:TASK"
        )
    accepted = list(inspect.signature(builder).parameters)[len(fixed) :]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise DataError(
            f"data source {source!r} got unknown options {', '.join(unknown)}; valid: {', '.join(accepted)}"
        )
    return builder(*fixed, **kwargs)


class PromptSource:
    """Batches of examples in an order that depends only on (seed, step).

    With `shuffle=False` every epoch is the dataset order, still wrapping across epochs.
    """

    _STATE_VERSION = 1

    def __init__(self, examples: Sequence[Example], *, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not examples:
            raise ValueError("PromptSource needs at least one example")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative (it seeds numpy's SeedSequence), got {seed}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, npt.NDArray[np.int64]] = {}
        self._fingerprint: str | None = None

    @property
    def num_examples(self) -> int:
        return len(self.examples)

    def batch(self, step: int) -> list[Example]:
        """The `batch_size` examples of `step` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        start = step * self.batch_size
        return [self.at(position) for position in range(start, start + self.batch_size)]

    def at(self, position: int) -> Example:
        """The example at global `position` of the data order (step s's batch holds s * batch_size onwards)."""
        epoch, index = divmod(position, self.num_examples)
        return self.examples[int(self._order(epoch)[index])]

    def _order(self, epoch: int) -> npt.NDArray[np.int64]:
        if epoch not in self._orders:
            # A batch touches at most a few consecutive epochs, so keeping the latest two avoids recomputing
            # the permutation per batch without growing with the run length.
            while len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            if self.shuffle:
                self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            else:
                self._orders[epoch] = np.arange(self.num_examples)
        return self._orders[epoch]

    def fingerprint(self) -> str:
        """sha256 of the examples' text and order: it changes whenever the dataset does."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for example in self.examples:
                # JSON-encoding each pair keeps the boundaries unambiguous ("a"+"bc" vs "ab"+"c").
                digest.update(json.dumps([example.prompt, example.answer]).encode())
                digest.update(b"\n")
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def state(self) -> dict[str, Any]:
        """JSON-able state for a checkpoint; `load_state` checks a resumed run against it."""
        return {
            "version": self._STATE_VERSION,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "num_examples": self.num_examples,
            "fingerprint": self.fingerprint(),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Check that a checkpoint's data state matches this source; batch(step) needs nothing more to resume."""
        expected = self.state()
        missing = [key for key in expected if key not in state]
        if missing:
            raise DataError(f"data checkpoint state lacks {', '.join(missing)}; it is not a PromptSource state")
        if state["version"] != self._STATE_VERSION:
            raise DataError(
                f"data checkpoint state has version {state['version']}, this code reads {self._STATE_VERSION}"
            )
        differences = [
            f"{key} {state[key]!r} (checkpoint) vs {expected[key]!r} (now)"
            for key in expected
            if key not in ("version", "fingerprint") and state[key] != expected[key]
        ]
        if state["fingerprint"] != expected["fingerprint"]:
            differences.append("the examples' content differs (fingerprint)")
        if differences:
            raise DataError(
                "the prompt data changed since the checkpoint, so resuming would not replay the same batches: "
                f"{'; '.join(differences)}. Restore the original dataset and data config, or start a new run."
            )
