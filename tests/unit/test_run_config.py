"""The run config says only what the code does: data.shuffle orders the prompts, train.parallel is gone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.config import ConfigError
from hpcrl.rollout.data import PromptSource
from hpcrl.run_config import load_run_config
from hpcrl.samples.sample import Example
from tests.support import REPO, hpcrl

QUICKSTART = REPO / "experiments" / "quickstart.yaml"


def test_an_old_config_naming_train_parallel_is_told_to_delete_it(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text(QUICKSTART.read_text().replace("train:\n", "train:\n  parallel: ddp\n"))
    with pytest.raises(ConfigError) as error:
        load_run_config(old)
    message = str(error.value)
    assert message.startswith("unknown key 'train.parallel': it was removed (it had one value (ddp)")
    assert "delete it" in message and "Valid keys of train: backend, " in message
    with pytest.raises(ConfigError, match="override 'train.parallel=ddp': unknown key 'train.parallel': it was"):
        load_run_config(QUICKSTART, ["train.parallel=ddp"])


def test_train_onpolicy_is_refused_naming_train_logprobs_and_logprobs_invariant_parses(tmp_path: Path) -> None:
    renamed = "train.onpolicy was renamed: use train.logprobs: invariant (or plain)"
    with pytest.raises(ConfigError) as error:
        load_run_config(QUICKSTART, ["engine.batch_invariant=true", "train.onpolicy=true"])
    assert str(error.value) == f"override 'train.onpolicy=true': {renamed}"
    old = tmp_path / "old.yaml"
    old.write_text(QUICKSTART.read_text().replace("train:\n", "train:\n  onpolicy: true\n"))
    with pytest.raises(ConfigError) as error:
        load_run_config(old)
    assert str(error.value) == renamed
    cfg = load_run_config(QUICKSTART, ["engine.batch_invariant=true", "train.logprobs=invariant"])
    assert cfg.train.logprobs == "invariant"
    assert load_run_config(QUICKSTART).train.logprobs == "plain"
    with pytest.raises(ConfigError, match="train.logprobs: .*'plain', 'invariant'"):
        load_run_config(QUICKSTART, ["train.logprobs=true"])


RECORDER = """
import os


def record(response: str, answer: str) -> float:
    with open(os.path.join(os.getcwd(), "answers.txt"), "a") as f:
        f.write(answer + "\\n")
    return 0.0
"""


def _answers_of_a_step(workdir: Path, *overrides: str) -> list[str]:
    """The answers of the prompts that one GRPO step scored, in the order the reward saw them."""
    answers = workdir / "answers.txt"
    answers.unlink(missing_ok=True)
    run_dir = f"r{len(list(workdir.glob('r*')))}"
    # Overrides after --run-dir: the order the README documents.
    hpcrl("run", "qs.yaml", "--run-dir", run_dir, *BASE, *overrides, cwd=workdir)
    return answers.read_text().split()


BASE = [
    "num_steps=1",
    "sft.num_steps=0",
    "data.source=data.jsonl",
    "data.prompts_per_step=4",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_new_tokens=2",
    "reward.fn=recorder:record",
]


def test_data_shuffle_decides_the_order_of_the_prompts(workdir: Path) -> None:
    examples = [Example(prompt=f"{i}+0=", answer=str(i)) for i in range(10)]
    rows = [json.dumps({"prompt": e.prompt, "answer": e.answer}) for e in examples]
    (workdir / "data.jsonl").write_text("\n".join(rows) + "\n")
    (workdir / "recorder.py").write_text(RECORDER)

    in_order = _answers_of_a_step(workdir, "data.shuffle=false")
    assert sorted(in_order) == ["0", "0", "1", "1", "2", "2", "3", "3"]

    shuffled = _answers_of_a_step(workdir)  # the default: data.shuffle=true
    expected = [e.answer for e in PromptSource(examples, batch_size=4, seed=0).batch(0)]
    assert sorted(shuffled) == sorted(expected * 2)
    assert sorted(set(shuffled)) != ["0", "1", "2", "3"]
