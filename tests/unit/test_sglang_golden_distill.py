"""SGLang 0.5.16's answers to the distillation teacher's scoring requests (tests/golden/sglang-0.5.16/distill/, made
by tools/gpu/record_sglang_distill.py), replayed through hpcrl's client and the teacher's parsers: the teacher's
log-prob of every response token and, with distill.top_k, its top-k (log-prob, id) pairs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpcrl.engine.client import EngineClient
from hpcrl.engine.protocol.answers import GenerateResult, input_token_logprobs, input_top_logprobs
from hpcrl.engine.protocol.requests import GenerateRequest
from tests.unit.test_sglang_golden import _Replay, client, replay  # noqa: F401 - the replay server's fixtures

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "sglang-0.5.16" / "distill"
CASES = ["distill_scoring", "distill_scoring_top_k"]


def _case(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / f"{name}.json").read_text())


@pytest.mark.parametrize("name", CASES)
def test_the_teacher_reads_what_sglang_answered_to_its_scoring_request(
    name: str,
    client: EngineClient,  # noqa: F811 - the fixture imported above
    replay: _Replay,  # noqa: F811
) -> None:
    case = _case(name)
    assert not case["problems"], case["problems"]
    for exchange in case["exchanges"]:
        body = exchange["request"]["body"]
        replay.load([exchange])
        request = GenerateRequest.from_dict(body)
        results = client.generate_request(request)
        assert replay.received[-1][2] == body, "the client no longer sends what was recorded: re-record"
        assert isinstance(results, list) and len(results) == len(body["input_ids"])
        start, k = body["logprob_start_len"], body.get("top_logprobs_num", 0)
        for ids, result in zip(body["input_ids"], results, strict=True):
            assert isinstance(result, GenerateResult) and result.output_ids == []
            lps = input_token_logprobs(result)
            assert len(lps) == len(ids) - start
            assert (lps[0] is None) == (start == 0)
            if not k:
                continue
            top = input_top_logprobs(result)
            assert len(top) == len(lps)
            for lp, pairs in zip(lps, top, strict=True):
                if lp is None:
                    assert pairs is None  # nothing predicts the prompt's first token
                    continue
                assert pairs is not None and len(pairs) == k
                values = [v for v, _ in pairs]
                assert values == sorted(values, reverse=True) and lp <= values[0] + 1e-5
    assert case["recorded"], (
        f"{GOLDEN / (name + '.json')} is not a recording yet (hand-written after SGLang's source): run "
        "`python3 tools/gpu/record_sglang_distill.py --out DIR` on a GPU and copy DIR/*.json there"
    )
