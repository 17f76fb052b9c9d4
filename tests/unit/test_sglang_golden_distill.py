"""SGLang 0.5.16's answers to the distillation teacher's scoring requests (tests/golden/sglang-0.5.16/distill/, made
by tools/gpu/record_sglang_distill.py), replayed through hpcrl's client, its parsers and the real `Teacher`: the
teacher's log-prob of every response token and, with distill.top_k, its top-k (log-prob, id) pairs.

SGLang answers null for the first `input_token_logprobs` entry whatever `logprob_start_len` is (recorded at 0, at
the prompt's last token and at the response's first token): the teacher starts at the prompt's last token and drops
that entry, so every response token gets a float."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcrl.engine.client import EngineClient
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.fleet import EngineFleet
from hpcrl.engine.protocol.answers import GenerateResult, input_token_logprobs, input_top_logprobs
from hpcrl.engine.protocol.requests import GenerateRequest
from hpcrl.rollout.teacher import Teacher
from hpcrl.samples.sample import Example, Group, Sample
from tests.unit.test_sglang_golden import _Replay, recorded_case, serving
from tests.unit.test_sglang_golden import load_case as load_main_case

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "sglang-0.5.16" / "distill"
CASES = {"distill_scoring": 0, "distill_scoring_top_k": 4}  # case: its top_logprobs_num
RECORD_HINT = (
    "record it on the GPU machine: python3 tools/gpu/record_sglang_distill.py --out /tmp/sglang-distill && "
    "cp /tmp/sglang-distill/*.json tests/golden/sglang-0.5.16/distill/"
)


def load_case(name: str) -> dict[str, Any]:
    return recorded_case("distill", name, RECORD_HINT)


def teacher_exchange(case: dict[str, Any]) -> dict[str, Any]:
    """The request the teacher sends: logprob_start_len at the prompt's last token (the recorder's first one)."""
    return case["exchanges"][0]


@pytest.fixture
def replay() -> Iterator[_Replay]:
    with serving() as server:
        yield server


def _url(replay: _Replay) -> str:
    host, port = replay.server_address[:2]
    return f"http://{host}:{port}"


def test_the_manifest_lists_every_case() -> None:
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    assert manifest["version"] == "0.5.16" and not manifest["failed"], manifest
    assert sorted(manifest["cases"]) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_teacher_scores_every_response_token_from_what_sglang_answered(replay: _Replay, name: str) -> None:
    case = load_case(name)
    exchange = teacher_exchange(case)
    body, answers = exchange["request"]["body"], exchange["response"]["body"]
    # SGLang's recorded /server_info: the client asks it which log-prob wire to speak before the first /generate.
    replay.load([exchange, *load_main_case("server_info")["exchanges"]])
    prompt_len = body["logprob_start_len"] + 1
    samples = [
        Sample(prompt_ids=ids[:prompt_len], output_ids=ids[prompt_len:], logprobs=[-1.0] * (len(ids) - prompt_len),
               text="", finish="stop", weight_versions=[0] * (len(ids) - prompt_len))
        for ids in body["input_ids"]
    ]  # fmt: skip
    # The fleet's monitor would probe /health, which this recording has no answer for: it waits longer than the test.
    fleet = EngineFleet(EngineConfig(health_interval_s=600.0), [EngineClient(_url(replay), timeout_s=10.0)],
                        launcher=None, on_event=lambda kind, detail: None)  # fmt: skip
    teacher = Teacher(fleet, timeout_s=10.0, top_k=CASES[name] or None)
    try:
        scores = teacher.score([Group(Example("prompt", "answer"), samples)])
    finally:
        teacher.close()
    sent = [b for m, p, b in replay.received if p == "/generate"]
    assert sent == [body], "the teacher no longer sends what was recorded: re-record"
    assert len(scores.logprobs) == len(samples)
    for sample, scored, answer in zip(samples, scores.logprobs, answers, strict=True):
        recorded = answer["meta_info"]["input_token_logprobs"]
        assert recorded[0][0] is None and recorded[0][1] == sample.prompt_ids[-1]  # SGLang's null at the start
        assert len(scored) == len(sample.output_ids) and all(isinstance(lp, float) and lp < 0 for lp in scored)
        assert scored == [t[0] for t in recorded[1:]]
        assert [t[1] for t in recorded[1:]] == sample.output_ids
    if not CASES[name]:
        assert scores.top is None
        return
    assert scores.top is not None and len(scores.top) == len(samples)
    for sample, scored, top in zip(samples, scores.logprobs, scores.top, strict=True):
        assert len(top) == len(sample.output_ids)
        for token, lp, pairs in zip(sample.output_ids, scored, top, strict=True):
            assert len(pairs) == CASES[name]
            values = [v for v, _ in pairs]
            assert values == sorted(values, reverse=True) and lp <= values[0] + 1e-5
            assert all(isinstance(i, int) and 0 <= i for _, i in pairs)
            for v, i in pairs:  # a response token among the top-k has the same log-prob in both lists
                if i == token:
                    assert v == pytest.approx(lp, abs=1e-3)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_recorded_answer_starts_with_null_and_parses_to_one_entry_per_token_from_logprob_start_len(
    replay: _Replay, name: str
) -> None:
    """At the prompt's last token, at the response's first and at 0 alike: the first entry is null. Starting at the
    response would lose its first token, the reason the teacher starts one token earlier."""
    case = load_case(name)
    k = CASES[name]
    with EngineClient(_url(replay), timeout_s=10.0, max_retries=0) as client:
        for exchange in case["exchanges"]:
            body = exchange["request"]["body"]
            assert body.get("top_logprobs_num", 0) == k
            replay.load([exchange])
            results = client.generate_request(GenerateRequest.from_dict(body))
            assert replay.received[-1][2] == body, "the client no longer sends what was recorded: re-record"
            assert isinstance(results, list) and len(results) == len(body["input_ids"])
            start = body["logprob_start_len"]
            for ids, result in zip(body["input_ids"], results, strict=True):
                assert isinstance(result, GenerateResult) and result.output_ids == []
                lps = input_token_logprobs(result)
                assert len(lps) == len(ids) - start, exchange["label"]
                assert lps[0] is None and all(isinstance(lp, float) for lp in lps[1:]), exchange["label"]
                if not k:
                    continue
                top = input_top_logprobs(result)
                assert len(top) == len(lps) and top[0] is None, exchange["label"]
                assert all(pairs is not None and len(pairs) == k for pairs in top[1:]), exchange["label"]


def test_the_teachers_scores_are_the_same_numbers_sglang_gives_when_scoring_from_the_prompts_first_token() -> None:
    case = load_case("distill_scoring_top_k")
    from_last, from_zero = (e for e in case["exchanges"])
    start = from_last["request"]["body"]["logprob_start_len"]
    assert from_zero["request"]["body"]["logprob_start_len"] == 0
    for a, b in zip(from_last["response"]["body"], from_zero["response"]["body"], strict=True):
        scored = [t[0] for t in a["meta_info"]["input_token_logprobs"][1:]]
        full = [t[0] for t in b["meta_info"]["input_token_logprobs"][start + 1 :]]
        assert scored == pytest.approx(full, abs=1e-3)
