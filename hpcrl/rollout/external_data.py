"""Examples from the data users already have: local Hugging Face `datasets` files and `reasoning_gym` tasks.

Both are optional installs (`pip install 'hpcrl[data]'`) and both are read offline: a path is opened from
disk (parquet, arrow, a `save_to_disk` directory, json/jsonl/csv), and a reasoning-gym task is generated
from its seed, never downloaded. Rows map to Example(prompt, answer) through the configured column names.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from hpcrl.samples.sample import DataError, Example

# Suffixes read through `datasets`; a directory is a `Dataset.save_to_disk` folder.
DATASET_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}
GYM_PREFIX = "reasoning_gym:"


def _import(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise DataError(
            f"reading this data source needs the {module!r} package; install it with pip install 'hpcrl[data]'"
        ) from None


def load_dataset_file(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Example]:
    """Every row of a local dataset file or `save_to_disk` directory, read in its stored order."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset not found: {path} (relative paths start at {Path.cwd()})")
    datasets = _import("datasets")
    try:
        if path.is_dir():
            table = datasets.load_from_disk(str(path), keep_in_memory=True)
            if isinstance(table, datasets.DatasetDict):
                splits = ", ".join(table)
                raise DataError(f"{path} holds several splits ({splits}); point data.source at one split's folder")
        elif path.suffix == ".arrow":
            table = datasets.Dataset.from_file(str(path), in_memory=True)
        else:
            builder = DATASET_SUFFIXES[path.suffix]
            table = datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=True)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow/datasets raise many types for a bad file
        raise DataError(f"could not read {path} as a {path.suffix or 'dataset'} dataset: {exc}") from None
    columns = list(table.column_names)
    for key, option in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key not in columns:
            raise DataError(f"{path}: no column {key!r}; columns: {', '.join(columns)}; set {option} to one of them")
    examples = []
    for i, (prompt, answer) in enumerate(zip(table[prompt_key], table[answer_key], strict=True)):
        if not isinstance(prompt, str):
            raise DataError(f"{path} row {i}: column {prompt_key!r} must hold text, got {type(prompt).__name__}")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise DataError(
                f"{path} row {i}: column {answer_key!r} must hold text or a number, got {type(answer).__name__}"
            )
        examples.append(Example(prompt=prompt, answer=answer))
    if not examples:
        raise DataError(f"dataset {path} has no rows")
    return examples


@lru_cache(maxsize=8)
def gym_dataset(name: str, size: int, seed: int) -> Any:
    """The procedural reasoning-gym dataset `name` (the same entries for the same size and seed)."""
    rg = _import("reasoning_gym")
    try:
        return rg.create_dataset(name, size=size, seed=seed)
    except Exception as exc:  # noqa: BLE001 - an unknown name raises ValueError, a bad config others
        known = ""
        try:
            from reasoning_gym.factory import DATASETS

            close = sorted(n for n in DATASETS if name.split("_")[0] in n)[:8]
            known = f"; similar names: {', '.join(close)}" if close else f"; {len(DATASETS)} tasks exist"
        except ImportError:
            pass
        raise DataError(f"reasoning_gym has no task {name!r} ({exc}){known}") from None


def make_gym_task(name: str, num_examples: int, seed: int) -> list[Example]:
    """`num_examples` entries of reasoning-gym task `name`; each example's meta names its entry, so that the
    `reasoning_gym` reward can score with the task's own scorer."""
    dataset = gym_dataset(name, num_examples, seed)
    return [
        Example(
            prompt=str(entry["question"]),
            answer=str(entry["answer"]),
            meta=json.dumps({"gym": name, "size": num_examples, "seed": seed, "index": i}),
        )
        for i, entry in enumerate(dataset)
    ]


def score_gym(response: str, meta: str) -> float:
    """The task's own score of a response (the text inside <answer>...</answer> when there is one)."""
    try:
        ref = json.loads(meta)
        dataset = gym_dataset(ref["gym"], int(ref["size"]), int(ref["seed"]))
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            "the reasoning_gym reward scores only examples of a reasoning_gym data source "
            "(data.source: reasoning_gym:TASK)"
        ) from None
    from reasoning_gym.utils import extract_answer

    extracted = extract_answer(response)
    return float(
        dataset.score_answer(
            answer=extracted if extracted is not None else response.strip(), entry=dataset[ref["index"]]
        )
    )
