"""Prompt data: JSONL loading errors, the addition task, deterministic batches and checkpoint state."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from hpcrl.rollout.data import PromptSource, build_examples, load_jsonl, make_addition_task
from hpcrl.samples.sample import DataError, Example


def write_jsonl(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def numbered(n: int) -> list[Example]:
    return [Example(prompt=f"p{i}", answer=str(i)) for i in range(n)]


# --- load_jsonl ------------------------------------------------------------------------------------


def test_load_jsonl_reads_rows_skips_blank_lines_and_stringifies_numeric_answers(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path,
        [
            '{"prompt": "1+1=", "answer": "2"}',
            "",
            "   ",
            '{"prompt": "2+2=", "answer": 4, "extra": null}',
            '{"prompt": "x", "answer": 2.5}',
        ],
    )
    assert load_jsonl(path) == [
        Example(prompt="1+1=", answer="2"),
        Example(prompt="2+2=", answer="4"),
        Example(prompt="x", answer="2.5"),
    ]


def test_load_jsonl_custom_keys_and_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes('\ufeff{"question": "q", "solution": "s"}\n'.encode())
    assert load_jsonl(path, prompt_key="question", answer_key="solution") == [Example(prompt="q", answer="s")]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=rf"dataset file not found: {tmp_path}/nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="dataset path is a directory"):
        load_jsonl(tmp_path)


@pytest.mark.parametrize("lines", [[], ["", "  "]])
def test_empty_dataset(tmp_path: Path, lines: list[str]) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(DataError, match=rf"dataset {path} has no examples; expected one JSON object per line"):
        load_jsonl(path)


def test_invalid_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, ['{"prompt": "a", "answer": "b"}', "", '{"prompt": "a", answer: "b"}'])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    assert str(info.value) == f"{path}:3: invalid JSON at column 17: Expecting property name enclosed in double quotes"


def test_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "b"}\n{"prompt": "caf\xe9", "answer": "b"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not UTF-8 text"):
        load_jsonl(path)


def test_row_that_is_not_an_object(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, ['["a", "b"]'])
    with pytest.raises(DataError, match=rf"{path}:1: expected a JSON object per line, got list"):
        load_jsonl(path)


def test_missing_field_names_it_and_lists_present_keys(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, ['{"prompt": "a", "answer": "b"}', '{"question": "a", "answer": "b"}'])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    assert str(info.value) == (
        f"{path}:2: no field 'prompt'; keys present: 'question', 'answer'; set prompt_key to the right name"
    )


def test_missing_answer_field_and_empty_object(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, ["{}"])
    with pytest.raises(DataError, match=r":1: no field 'prompt'; keys present: \(none\)"):
        load_jsonl(path)
    path = write_jsonl(tmp_path, ['{"prompt": "a"}'], name="b.jsonl")
    with pytest.raises(DataError, match=r":1: no field 'answer'; keys present: 'prompt'; set answer_key"):
        load_jsonl(path)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"prompt": 1, "answer": "b"}', "field 'prompt' must be a string, got int 1"),
        ('{"prompt": "a", "answer": null}', "field 'answer' must be a string or a number, got NoneType None"),
        ('{"prompt": "a", "answer": true}', "field 'answer' must be a string or a number, got bool True"),
        ('{"prompt": "a", "answer": [1]}', r"field 'answer' must be a string or a number, got list \[1\]"),
    ],
)
def test_wrong_field_types(tmp_path: Path, row: str, message: str) -> None:
    path = write_jsonl(tmp_path, [row])
    with pytest.raises(DataError, match=rf"{path}:1: {message}"):
        load_jsonl(path)


# --- make_addition_task ----------------------------------------------------------------------------


def test_addition_task_is_correct_and_deterministic() -> None:
    examples = make_addition_task(num_examples=200, digits=3, seed=7)
    assert examples == make_addition_task(num_examples=200, digits=3, seed=7)
    assert examples != make_addition_task(num_examples=200, digits=3, seed=8)
    for example in examples:
        left, right = example.prompt.removesuffix("=").split("+")
        assert example.prompt.endswith("=")
        assert int(left) + int(right) == int(example.answer)
        assert 1 <= len(left) <= 3 and 1 <= len(right) <= 3
        assert str(int(left)) == left  # no leading zeros
    lengths = Counter(len(e.prompt.split("+")[0]) for e in examples)
    assert set(lengths) == {1, 2, 3}


def test_addition_task_pinned_values() -> None:
    # Pins the generator: a change here silently changes every experiment that uses the task.
    assert make_addition_task(num_examples=3, digits=3, seed=0) == [
        Example(prompt="63+4=", answer="67"),
        Example(prompt="597+48=", answer="645"),
        Example(prompt="55+323=", answer="378"),
    ]


@pytest.mark.parametrize(
    ("num_examples", "digits", "message"),
    [(0, 2, "num_examples must be at least 1, got 0"), (5, 0, "digits must be at least 1, got 0")],
)
def test_addition_task_validates(num_examples: int, digits: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_addition_task(num_examples=num_examples, digits=digits, seed=0)


# --- build_examples --------------------------------------------------------------------------------


def test_build_examples_from_jsonl_and_addition(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, ['{"q": "a", "a": "b"}'])
    assert build_examples(str(path), prompt_key="q", answer_key="a") == [Example(prompt="a", answer="b")]
    assert build_examples("addition", num_examples=4, digits=2, seed=1) == make_addition_task(4, 2, 1)


def test_build_examples_unknown_source() -> None:
    expected = r"unknown data source 'data.txt'; expected one of: addition, product, a .jsonl file"
    with pytest.raises(DataError, match=expected):
        build_examples("data.txt")


def test_build_examples_unknown_option() -> None:
    with pytest.raises(DataError, match=r"got unknown options digit; valid: num_examples, digits, seed"):
        build_examples("addition", num_examples=4, digit=2, seed=1)
    with pytest.raises(DataError, match=r"got unknown options key; valid: prompt_key, answer_key"):
        build_examples("x.jsonl", key="p")


# --- PromptSource ----------------------------------------------------------------------------------


def test_batches_cover_each_epoch_once_and_wrap_across_epochs() -> None:
    source = PromptSource(numbered(10), batch_size=4, seed=3)
    stream = [e for step in range(5) for e in source.batch(step)]  # 20 positions = two epochs exactly
    first, second = stream[:10], stream[10:]
    assert sorted(first, key=lambda e: int(e.answer)) == numbered(10)
    assert sorted(second, key=lambda e: int(e.answer)) == numbered(10)
    assert first != second  # each epoch has its own permutation
    # step 2 takes positions 8..11: the last two of epoch 0 and the first two of epoch 1
    assert source.batch(2) == first[8:] + second[:2]


def test_batch_is_a_function_of_seed_and_step_only() -> None:
    source = PromptSource(numbered(7), batch_size=3, seed=11)
    forward = [source.batch(step) for step in range(8)]
    fresh = PromptSource(numbered(7), batch_size=3, seed=11)
    # A resumed run asks for a late step first; the answer must not depend on what was asked before.
    assert [fresh.batch(step) for step in reversed(range(8))] == list(reversed(forward))
    other_seed = PromptSource(numbered(7), batch_size=3, seed=12)
    assert [other_seed.batch(step) for step in range(8)] != forward


def test_batch_larger_than_dataset_spans_several_epochs() -> None:
    source = PromptSource(numbered(3), batch_size=7, seed=0)
    batch = source.batch(1)  # positions 7..13: the end of epoch 2, all of epoch 3, the start of epoch 4
    assert len(batch) == 7
    assert sorted(batch[2:5], key=lambda e: int(e.answer)) == numbered(3)


def test_no_shuffle_keeps_dataset_order() -> None:
    source = PromptSource(numbered(5), batch_size=2, seed=0, shuffle=False)
    assert [e.answer for step in range(4) for e in source.batch(step)] == list("01234012")


@pytest.mark.parametrize(
    ("examples", "batch_size", "seed", "message"),
    [
        ([], 1, 0, "needs at least one example"),
        (numbered(2), 0, 0, "batch_size must be at least 1, got 0"),
        (numbered(2), 1, -1, "seed must be non-negative"),
    ],
)
def test_prompt_source_validates(examples: list[Example], batch_size: int, seed: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PromptSource(examples, batch_size=batch_size, seed=seed)


def test_negative_step() -> None:
    with pytest.raises(ValueError, match="step must be non-negative, got -1"):
        PromptSource(numbered(2), batch_size=1, seed=0).batch(-1)


def test_state_is_json_and_round_trips() -> None:
    source = PromptSource(numbered(6), batch_size=2, seed=5)
    state = json.loads(json.dumps(source.state()))
    assert state["num_examples"] == 6 and state["seed"] == 5 and state["batch_size"] == 2
    resumed = PromptSource(numbered(6), batch_size=2, seed=5)
    resumed.load_state(state)
    assert resumed.batch(9) == source.batch(9)


def test_load_state_refuses_changed_config() -> None:
    state = PromptSource(numbered(6), batch_size=2, seed=5).state()
    other = PromptSource(numbered(6), batch_size=3, seed=6)
    with pytest.raises(DataError) as info:
        other.load_state(state)
    message = str(info.value)
    assert message.startswith("the prompt data changed since the checkpoint, so resuming would not replay")
    assert "seed 5 (checkpoint) vs 6 (now); batch_size 2 (checkpoint) vs 3 (now)" in message
    assert message.endswith("Restore the original dataset and data config, or start a new run.")


def test_load_state_refuses_changed_dataset() -> None:
    state = PromptSource(numbered(6), batch_size=2, seed=5).state()
    with pytest.raises(DataError, match=r"num_examples 6 \(checkpoint\) vs 5 \(now\); the examples' content differs"):
        PromptSource(numbered(5), batch_size=2, seed=5).load_state(state)
    edited = numbered(6)
    edited[3] = Example(prompt="p3", answer="changed")
    with pytest.raises(
        DataError, match=r"changed since the checkpoint.*: the examples' content differs \(fingerprint\)"
    ):
        PromptSource(edited, batch_size=2, seed=5).load_state(state)


def test_load_state_refuses_foreign_or_newer_state() -> None:
    source = PromptSource(numbered(2), batch_size=1, seed=0)
    with pytest.raises(
        DataError, match="data checkpoint state lacks version, seed, .*; it is not a PromptSource state"
    ):
        source.load_state({"step": 3})
    with pytest.raises(DataError, match="data checkpoint state has version 2, this code reads 1"):
        source.load_state({**source.state(), "version": 2})


def test_fingerprint_separates_field_boundaries() -> None:
    a = PromptSource([Example(prompt="a", answer="bc")], batch_size=1, seed=0)
    b = PromptSource([Example(prompt="ab", answer="c")], batch_size=1, seed=0)
    assert a.fingerprint() != b.fingerprint()
