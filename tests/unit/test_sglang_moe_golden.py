"""SGLang 0.5.16's routed-expert answers (tests/golden/sglang-0.5.16/moe/, tools/gpu/record_sglang_moe.py: a tiny
Qwen3-MoE model, 2 layers, 8 experts, top-2) read through hpcrl's client: the routes decode to [prompt + output - 1,
layers, top_k] expert ids below num_experts, and the start-up check accepts the server started with
--enable-return-routed-experts (the one started without is refused in test_sglang_routes_check.py). A stand-in
that is not a recording fails, naming the recorder."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpcrl.engine.client import EngineClient
from hpcrl.engine.protocol.answers import parse_generate_response
from hpcrl.engine.sglang import captures_routed_experts, check_routed_experts_capture
from hpcrl.rollout.generate import routed_experts
from tests.unit.test_sglang_golden import _Replay

MOE_DIR = Path(__file__).resolve().parents[1] / "golden" / "sglang-0.5.16" / "moe"
LAYERS, TOP_K, NUM_EXPERTS = 2, 2, 8
HINT = "record it on a GPU: python3 tools/gpu/record_sglang_moe.py --out DIR, then copy DIR/*.json there"


def _case(name: str) -> dict[str, Any]:
    path = MOE_DIR / f"{name}.json"
    assert path.is_file(), f"{path} is missing; {HINT}"
    case = json.loads(path.read_text())
    assert case["recorded"] is True, f"{path} is a hand-written stand-in, not a recording of SGLang yet; {HINT}"
    assert case["engine"] == "sglang" and str(case["version"]).startswith("0.5.16"), (case["engine"], case["version"])
    assert not case["problems"], f"{path}: the recorder reported {case['problems']}; re-record"
    return case


@pytest.mark.parametrize("name", ["generate_routed_experts_single", "generate_routed_experts_batch"])
def test_recorded_routes_decode_to_tokens_layers_top_k(name: str) -> None:
    case = _case(name)
    (exchange,) = case["exchanges"]
    assert exchange["response"]["status"] == 200, exchange["response"]
    body = exchange["request"]["body"]
    prompts = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
    parsed = parse_generate_response(exchange["response"]["body"])
    results = parsed if isinstance(parsed, list) else [parsed]
    assert len(results) == len(prompts)
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.output_ids) == body["sampling_params"]["max_new_tokens"]
        routes = routed_experts(result, len(prompt), (LAYERS, TOP_K), "golden")
        assert routes.shape == (len(prompt) + len(result.output_ids) - 1, LAYERS, TOP_K)
        assert routes.dtype == np.int32
        assert int(routes.min()) >= 0 and int(routes.max()) < NUM_EXPERTS, routes
        # A token's top-k experts are distinct.
        assert (routes[..., 0] != routes[..., 1]).all()


def test_a_server_with_routed_expert_capture_passes_the_start_up_check() -> None:
    case = _case("server_info")
    body = case["exchanges"][0]["response"]["body"]
    assert body["enable_return_routed_experts"] is True
    server = _Replay()
    server.load(case["exchanges"])
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        host, port = server.server_address[:2]
        with EngineClient(f"http://{host}:{port}", timeout_s=10.0, max_retries=1) as client:
            assert captures_routed_experts(client.server_info()) is True
            check_routed_experts_capture([client], replay="rollout")
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_without_capture_answers_no_routes_that_hpcrl_could_replay() -> None:
    """What 0.5.16 answers to return_routed_experts when started without the flag (recorded with the second server):
    no routes, and hpcrl's reading names the flag to add."""
    path = MOE_DIR / "generate_no_capture.json"
    if not path.is_file():
        pytest.fail(f"{path} is missing (the recorder's second server, without the flag); {HINT}")
    case = _case("generate_no_capture")
    response = case["exchanges"][0]["response"]
    if response["status"] != 200:
        return  # refused outright: nothing reaches the routes' reader
    result = parse_generate_response(response["body"])
    assert not isinstance(result, list)
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        routed_experts(result, 6, (LAYERS, TOP_K), "golden")
    assert captures_routed_experts(_case("server_info_no_capture")["exchanges"][0]["response"]["body"]) is False
