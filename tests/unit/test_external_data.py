"""Data users already have: local parquet / arrow / save_to_disk datasets through Hugging
Face `datasets` with column mapping, reasoning-gym tasks by name with their own scorer, and a math-verify
reward. All offline: the files are written here, the gym tasks are generated from a seed."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from hpcrl.rollout.config import RewardConfig
from hpcrl.rollout.data import PromptSource, build_examples, source_options
from hpcrl.rollout.rewards import load_reward, score
from hpcrl.rollout.scoring import RewardScorer
from hpcrl.run_config import load_run_config
from hpcrl.samples.sample import DataError, Example, Group, Sample

ROWS = {"question": ["1+2=", "3+4=", "10+5="], "solution": [3, "7", "15"], "other": ["x", "y", "z"]}


@pytest.mark.parametrize("kind", ["parquet", "arrow", "save_to_disk", "csv"])
def test_local_datasets_map_their_columns_to_examples(tmp_path: Path, kind: str) -> None:
    table = datasets.Dataset.from_dict({k: [str(v) for v in vs] if k == "solution" else vs for k, vs in ROWS.items()})
    path = {
        "parquet": tmp_path / "train.parquet",
        "arrow": tmp_path / "train.arrow",
        "save_to_disk": tmp_path / "saved",
        "csv": tmp_path / "train.csv",
    }[kind]
    if kind == "parquet":
        table.to_parquet(str(path))
    elif kind == "csv":
        table.to_csv(str(path), index=False)
    elif kind == "save_to_disk":
        table.save_to_disk(str(path))
    else:
        table.save_to_disk(str(tmp_path / "arrow-dir"))
        path = next((tmp_path / "arrow-dir").glob("*.arrow"))
    got = build_examples(str(path), **source_options(str(path), num_examples=0, digits=0, seed=0,
                                                     prompt_key="question", answer_key="solution"))  # fmt: skip
    assert got == [Example("1+2=", "3"), Example("3+4=", "7"), Example("10+5=", "15")]


def test_a_missing_column_names_the_columns_and_the_option(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_dict(ROWS | {"solution": ["3", "7", "15"]}).to_parquet(str(path))
    with pytest.raises(DataError, match=r"no column 'prompt'; columns: question, solution, other; set data.prompt_key"):
        build_examples(str(path), prompt_key="prompt", answer_key="solution")
    with pytest.raises(DataError, match=r"dataset not found: .*nope.parquet"):
        build_examples(str(tmp_path / "nope.parquet"), prompt_key="question", answer_key="solution")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"could not read .*bad.parquet as a .parquet dataset"):
        build_examples(str(tmp_path / "bad.parquet"), prompt_key="question", answer_key="solution")


def test_a_reasoning_gym_task_is_the_same_for_the_same_seed_and_scored_by_its_own_scorer() -> None:
    opts = source_options("reasoning_gym:chain_sum", num_examples=12, digits=2, seed=3, prompt_key="p", answer_key="a")
    assert opts == {"num_examples": 12, "seed": 3}
    examples = build_examples("reasoning_gym:chain_sum", **opts)
    assert len(examples) == 12 and examples == build_examples("reasoning_gym:chain_sum", **opts)
    assert examples != build_examples("reasoning_gym:chain_sum", num_examples=12, seed=4)
    assert "arithmetic problem" in examples[0].prompt and json.loads(examples[0].meta)["index"] == 0
    # The task's own scorer, through the run's scorer (meta reaches the reward): the reference answer
    # scores 1, a wrong one 0, and the text inside <answer> tags is what counts.
    scorer = RewardScorer(RewardConfig(fn="reasoning_gym"), interrupted=lambda: False, on_stop=lambda *_: None)
    e = examples[0]
    texts = [e.answer, str(int(e.answer) + 1), f"I think <answer>{e.answer}</answer>"]
    groups = [Group(example=e, samples=[Sample([1], [2], [0.0], t, "stop", [0]) for t in texts])]
    scorer.score(0, groups)
    assert [s.reward for s in groups[0].samples] == [1.0, 0.0, 1.0]
    # The gym examples batch like any other (their meta is not part of the data order).
    assert len(PromptSource(examples, batch_size=4, seed=0).batch(2)) == 4


def test_reasoning_gym_errors_name_the_fix() -> None:
    with pytest.raises(DataError, match=r"reasoning_gym has no task 'chain_summ'"):
        build_examples("reasoning_gym:chain_summ", num_examples=4, seed=0)
    with pytest.raises(DataError, match=r"names no task; write e.g. reasoning_gym:chain_sum"):
        build_examples("reasoning_gym:", num_examples=4, seed=0)
    # The gym reward on plain data fails the sample with the reason (score() never raises for one sample).
    result = score(load_reward("reasoning_gym"), ["3"], ["3"], metas=[""])
    assert result.errors[0] is not None and "only examples of a reasoning_gym data source" in result.errors[0]


def test_reward_reasoning_gym_without_a_gym_source_is_refused_at_load(tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {path: m}\nreward: {fn: reasoning_gym}\n")
    with pytest.raises(ValueError, match=r"reward.fn=reasoning_gym .* set data.source=reasoning_gym:TASK"):
        load_run_config(cfg)


def test_math_verify_compares_mathematically() -> None:
    fn = load_reward("math_verify")
    result = score(fn, ["The answer is $0.5$", "so it is 1/3", "\\boxed{12}", "no idea"],
                   ["\\frac{1}{2}", "0.5", "12", "12"], timeout_s=30)  # fmt: skip
    assert result.rewards == [1.0, 0.0, 1.0, 0.0] and result.num_failed == 0
