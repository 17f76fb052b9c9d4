"""SGLang 0.5.16's routed-expert answers (tests/golden/sglang-0.5.16/moe/, recorded by tools/gpu/record_sglang_moe.py
on `hpcrl model init-tiny --moe`: 2 layers, 8 experts, top-2, float32) read through hpcrl: the routes decode to
[prompt + output - 1, layers, top_k] expert ids, the start-up check accepts the server with capture, a server without
it gets an answer naming the flag, the trainer routes every recorded token as SGLang did, and with SGLang's routes
replayed the trainer's log-probs of SGLang's tokens are SGLang's."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpcrl.engine.client import EngineClient
from hpcrl.engine.protocol.answers import GenerateResult, parse_generate_response
from hpcrl.engine.sglang import captures_routed_experts, check_routed_experts_capture, check_sglang_loads_head
from hpcrl.model import moe
from hpcrl.model.hf import load_model
from hpcrl.model.qwen3 import CausalLM
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
from hpcrl.rollout.generate import routed_experts
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.logprobs import token_logprobs
from tests.unit.test_sglang_golden import _Replay

MOE_DIR = Path(__file__).resolve().parents[1] / "golden" / "sglang-0.5.16" / "moe"
LAYERS, TOP_K, NUM_EXPERTS, VOCAB = 2, 2, 8, 99
GENERATE_CASES = ["generate_routed_experts_single", "generate_routed_experts_batch"]
HINT = "record it on a GPU: python3 tools/gpu/record_sglang_moe.py --out DIR, then copy DIR/*.json there"
# SGLang ran the float32 checkpoint in float32 (--dtype auto, TF32 off); the trainer runs float32 on the CPU.
LOGPROB_TOL = 1e-3


def _case(name: str) -> dict[str, Any]:
    path = MOE_DIR / f"{name}.json"
    assert path.is_file(), f"{path} is missing; {HINT}"
    case = json.loads(path.read_text())
    assert case["recorded"] is True, f"{path} is a hand-written stand-in, not a recording of SGLang yet; {HINT}"
    assert case["engine"] == "sglang" and str(case["version"]).startswith("0.5.16"), (case["engine"], case["version"])
    assert not case["problems"], f"{path}: the recorder reported {case['problems']}; re-record"
    return case


def _samples(name: str) -> list[tuple[list[int], GenerateResult]]:
    (exchange,) = _case(name)["exchanges"]
    assert exchange["response"]["status"] == 200, exchange["response"]
    body = exchange["request"]["body"]
    prompts = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
    parsed = parse_generate_response(exchange["response"]["body"])
    results = parsed if isinstance(parsed, list) else [parsed]
    assert len(results) == len(prompts)
    return list(zip(prompts, results, strict=True))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """The recorder's model, rebuilt (seeded) as tools/gpu/record_sglang_moe.py builds it."""
    model_dir = init_tiny_model(tmp_path_factory.mktemp("moe") / "model", TinyModelSpec(num_experts=8))
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["vocab_size"], config["num_hidden_layers"], config["num_experts_per_tok"]) == (VOCAB, LAYERS, TOP_K)
    assert config["dtype"] == "float32"  # what SGLang's --dtype auto ran
    return load_model(model_dir, dtype=torch.float32).eval()


def _trainer(model: CausalLM, prompt: list[int], result: GenerateResult) -> tuple[np.ndarray, torch.Tensor]:
    """The trainer's own routes [prompt + output - 1, layers, k] and its log-probs of the sampled tokens with SGLang's
    routes replayed."""
    args = model.args.moe
    assert args is not None
    routes = routed_experts(result, len(prompt), (LAYERS, TOP_K), "golden")
    batch = TrainBatch.from_sequences([prompt], [result.output_ids], routed_experts=[routes])
    with torch.no_grad():
        model.routing.replay, model.routing.force = None, False
        model(batch.input_ids)
        own = moe.routes_of(model.routing, args, 1, batch.input_ids.shape[1])[0, :-1].numpy()
        model.routing.replay, model.routing.force = batch.routed_experts, True
        try:
            logits = model(batch.input_ids)[:, :-1]
        finally:
            model.routing.replay, model.routing.force = None, False
        logprobs, _ = token_logprobs(logits.float(), batch.input_ids[:, 1:])
    return own, logprobs[batch.loss_mask]


@pytest.mark.parametrize("name", GENERATE_CASES)
def test_recorded_routes_decode_to_tokens_layers_top_k(name: str) -> None:
    for prompt, result in _samples(name):
        assert len(result.output_ids) == 8
        routes = routed_experts(result, len(prompt), (LAYERS, TOP_K), "golden")
        assert routes.shape == (len(prompt) + len(result.output_ids) - 1, LAYERS, TOP_K)
        assert routes.dtype == np.int32
        assert int(routes.min()) >= 0 and int(routes.max()) < NUM_EXPERTS, routes
        assert (routes[..., 0] != routes[..., 1]).all()  # a token's top-k experts are distinct
        with pytest.raises(ValueError, match="another shape"):
            routed_experts(result, len(prompt), (LAYERS, 3), "golden")  # top-3 does not divide 2 x 2 ids per token


def test_a_server_with_routed_expert_capture_passes_the_start_up_check() -> None:
    body = _case("server_info")["exchanges"][0]["response"]["body"]
    assert body["enable_return_routed_experts"] is True
    server = _Replay()
    server.load(_case("server_info")["exchanges"])
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        host, port = server.server_address[:2]
        with EngineClient(f"http://{host}:{port}", timeout_s=10.0, max_retries=1) as client:
            assert captures_routed_experts(client.server_info()) is True
            check_routed_experts_capture([client], replay="rollout")
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_without_capture_answers_no_routes_and_hpcrl_names_the_flag() -> None:
    """SGLang 0.5.16 started without the flag answers 200 and simply leaves routed_experts out."""
    response = _case("generate_no_capture")["exchanges"][0]["response"]
    assert response["status"] == 200 and "routed_experts" not in response["body"]["meta_info"]
    result = parse_generate_response(response["body"])
    assert not isinstance(result, list)
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        routed_experts(result, 6, (LAYERS, TOP_K), "golden")
    assert captures_routed_experts(_case("server_info_no_capture")["exchanges"][0]["response"]["body"]) is False


@pytest.mark.parametrize("name", GENERATE_CASES)
def test_the_trainer_routes_every_recorded_token_as_sglang_did(name: str, tiny_moe: CausalLM) -> None:
    """Row i of SGLang's routes is the token at position i (prompt and output, the last sampled token excluded)."""
    for prompt, result in _samples(name):
        own, _ = _trainer(tiny_moe, prompt, result)
        sglang = routed_experts(result, len(prompt), (LAYERS, TOP_K), "golden")
        same = (np.sort(own, axis=-1) == np.sort(sglang, axis=-1)).all(axis=-1)
        assert same.all(), f"token x layer top-k sets that differ: {np.argwhere(~same).tolist()}"


@pytest.mark.parametrize("name", GENERATE_CASES)
def test_replayed_trainer_logprobs_are_sglangs(name: str, tiny_moe: CausalLM) -> None:
    for prompt, result in _samples(name):
        _, trainer = _trainer(tiny_moe, prompt, result)
        sglang = torch.tensor(result.output_token_logprobs, dtype=torch.float32)
        gap = float((trainer - sglang).abs().max())
        if gap > LOGPROB_TOL and float(sglang.std()) < 1e-6 and abs(float(sglang[0]) + math.log(VOCAB)) < 1e-4:
            pytest.fail(
                f"every recorded log-prob is {float(sglang[0]):.6f} = -ln({VOCAB}): SGLang served this recording's "
                "checkpoint with an unloaded lm_head (a tied checkpoint stores none, and SGLang 0.5.16's "
                f"Qwen3MoeForCausalLM never ties it; trainer gap {gap:.3f} nats). The recorder's model now stores "
                f"lm_head.weight; {HINT}"
            )
        assert gap <= LOGPROB_TOL, f"trainer vs SGLang log-probs: max gap {gap:.2e} nats > {LOGPROB_TOL}"


def test_a_tied_qwen3_moe_checkpoint_is_refused_before_sglang_starts(tmp_path: Path) -> None:
    """The recording above shows what SGLang does with one: all-equal log-probs; hpcrl refuses to launch it."""
    model_dir = tmp_path / "tied"
    model_dir.mkdir()
    config = {"architectures": ["Qwen3MoeForCausalLM"], "tie_word_embeddings": True}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tie_word_embeddings: true.*write it untied"):
        check_sglang_loads_head(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    check_sglang_loads_head(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3ForCausalLM"]}))
    check_sglang_loads_head(model_dir)  # SGLang's dense Qwen3 ties its head
