"""The embedded engine, tested as a user of SGLang's contract would: real server processes on loopback."""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from hpcrl.engine.client import EngineClient
from hpcrl.engine.protocol.answers import GenerateResult, input_token_logprobs, input_top_logprobs
from hpcrl.engine.protocol.requests import GenerateRequest, SamplingParams
from hpcrl.model.hf import load_model
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
from hpcrl.weightwire.group import broadcast, destroy_weight_group
from hpcrl.weightwire.handover import create_handover
from tests.conftest import EngineProcess
from tests.support import host_weight_group

PROMPT = [1, 20, 21, 14, 22, 32]  # "<|im_start|>12+3="


def gen(url: str, body: dict, timeout_s: float = 60.0, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=timeout_s, headers=headers)


def post(url: str, path: str, body: dict | None = None, timeout_s: float = 60.0) -> httpx.Response:
    return httpx.post(url + path, json=body if body is not None else {}, timeout=timeout_s)


def info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]


def wait_running(url: str, n: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if info(url)["num_reqs"] >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{n} requests never ran")


def test_generate_shapes_single_and_batch(shared_engine: EngineProcess) -> None:
    r = gen(shared_engine.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}, "return_logprob": True})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 6 and isinstance(out["text"], str)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 6
    assert meta["weight_version"] == "default" and isinstance(meta["id"], str)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])

    r = gen(
        shared_engine.url,
        {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": {"max_new_tokens": 3, "n": 2}, "rid": ["a", "b"]},
    )
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 4
    assert [o["meta_info"]["id"] for o in outs] == ["a-0", "a-1", "b-0", "b-1"]
    assert "output_token_logprobs" not in outs[0]["meta_info"]


def test_stop_token_and_eos(shared_engine: EngineProcess) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 20, "temperature": 0}}
    first = gen(shared_engine.url, body).json()["output_ids"][0]
    body["sampling_params"]["stop_token_ids"] = [first]
    out = gen(shared_engine.url, body).json()
    assert out["output_ids"] == [first]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_sampling_seed_reproducible_whatever_the_batch(shared_engine: EngineProcess) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "sampling_seed": 11}, "return_logprob": True}
    a, b = gen(shared_engine.url, body).json(), gen(shared_engine.url, body).json()
    assert a["output_ids"] == b["output_ids"]
    other = gen(shared_engine.url, {**body, "sampling_params": {"max_new_tokens": 12, "sampling_seed": 12}}).json()
    assert other["output_ids"] != a["output_ids"]
    # The same request inside a batch of strangers samples the same tokens.
    batch = gen(
        shared_engine.url,
        {
            "input_ids": [[5, 6, 7], PROMPT, [40] * 9],
            "sampling_params": [
                {"max_new_tokens": 5, "sampling_seed": 1},
                {"max_new_tokens": 12, "sampling_seed": 11},
                {"max_new_tokens": 30, "sampling_seed": 2},
            ],
            "return_logprob": True,
        },
    ).json()
    assert batch[1]["output_ids"] == a["output_ids"]
    lp_alone = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
    lp_batch = [x[0] for x in batch[1]["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(lp_alone, lp_batch, strict=True)) < 1e-5


def test_logprobs_equal_teacher_forced_forward(shared_engine: EngineProcess, tiny_model_dir: Path) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}, "return_logprob": True}
    out = gen(shared_engine.url, body).json()
    engine_lp = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    ids = torch.tensor(PROMPT + out["output_ids"])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(ids[None]).logits[0, len(PROMPT) - 1 : -1]
    ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[len(PROMPT) :, None])[:, 0]
    diff = (engine_lp - ref).abs().max().item()
    print(f"max |engine logprob - transformers teacher-forced logprob| = {diff:.3e} over {len(ref)} tokens")
    assert diff < 1e-4


def test_temperature_scaled_logprobs_and_support(shared_engine: EngineProcess) -> None:
    base = {"input_ids": PROMPT, "return_logprob": True}
    params = {"max_new_tokens": 8, "sampling_seed": 5, "temperature": 0.7, "top_k": 5, "top_p": 0.9}
    t1 = gen(shared_engine.url, {**base, "sampling_params": params, "return_sampling_mask": True}).json()
    scaled = gen(shared_engine.url, {**base, "sampling_params": params, "return_scaled_logprob": True}).json()
    assert t1["output_ids"] == scaled["output_ids"]
    meta = t1["meta_info"]
    assert all(1 <= len(s) <= 5 for s in meta["output_token_sampling_mask"])
    assert all(tok in s for tok, s in zip(t1["output_ids"], meta["output_token_sampling_mask"], strict=True))
    # Renormalising over a smaller support raises every token's log-prob.
    lp1 = [x[0] for x in meta["output_token_logprobs"]]
    lps = [x[0] for x in scaled["meta_info"]["output_token_logprobs"]]
    assert all(s >= a - 1e-6 for s, a in zip(meta["output_token_sampling_logprobs"], lps, strict=True))
    assert lp1 != lps


def _packed_column(meta: dict[str, Any]) -> array:
    column = array("d", base64.b64decode(meta["output_token_logprobs_packed"]))
    if sys.byteorder != "little":
        column.byteswap()  # the wire is little-endian
    return column


@pytest.mark.parametrize("overlap", ["off", "on"])  # on: each row's column is packed while the row decodes
def test_packed_logprobs_are_the_triples_bit_for_bit(
    shared_engine: EngineProcess, engine_factory: Any, overlap: str
) -> None:
    url = shared_engine.url if overlap == "off" else engine_factory("--decode-overlap", "on").url
    body: dict[str, Any] = {
        "input_ids": [PROMPT, PROMPT[:4]],
        "sampling_params": [
            # Past two text chunks (CHUNK_TOKENS = 32), so that with overlap the packing advances during decode.
            {"max_new_tokens": 24 if overlap == "off" else 100, "sampling_seed": 3, "ignore_eos": True},
            {"max_new_tokens": 9 if overlap == "off" else 71, "sampling_seed": 4, "temperature": 0.8, "top_k": 7},
        ],
        "return_logprob": True,
    }
    for extra in ({}, {"return_scaled_logprob": True}):  # the scaled column is packed the same way
        triples = gen(url, {**body, **extra}).json()
        packed = gen(url, {**body, **extra, "return_logprob_packed": True}).json()
        assert len(triples) == len(packed) == 2
        for t, p in zip(triples, packed, strict=True):
            assert p["output_ids"] == t["output_ids"], "the same seeds sample the same tokens"
            assert "output_token_logprobs" not in p["meta_info"], "packed replaces the triples, not adds to them"
            want = array("d", [lp for lp, _, _ in t["meta_info"]["output_token_logprobs"]])
            assert _packed_column(p["meta_info"]).tobytes() == want.tobytes()
            parsed = GenerateResult.from_response(p)
            assert parsed.output_token_logprobs == want.tolist() and parsed.output_ids == t["output_ids"]


def test_packed_logprobs_refuse_text_in_logprobs_and_need_return_logprob(shared_engine: EngineProcess) -> None:
    base = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "return_logprob_packed": True}
    r = gen(shared_engine.url, {**base, "return_logprob": True, "return_text_in_logprobs": True})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "return_logprob_packed and return_text_in_logprobs cannot be combined" in message
    assert "drop return_text_in_logprobs" in message
    # Without return_logprob there is nothing to pack: the flag is ignored, as it would be for the triples.
    r = gen(shared_engine.url, base)
    assert r.status_code == 200, r.text
    assert not {"output_token_logprobs", "output_token_logprobs_packed"} & set(r.json()["meta_info"])


def test_the_engine_client_asks_the_embedded_engine_for_packed_logprobs(shared_engine: EngineProcess) -> None:
    assert httpx.get(shared_engine.url + "/server_info", timeout=10).json()["logprob_wire"] == ["triples", "packed"]
    params = SamplingParams(max_new_tokens=10, sampling_seed=21, ignore_eos=True)
    with EngineClient(shared_engine.url) as client:
        result = client.generate(PROMPT, params)
        assert client.speaks_packed_logprobs()
    assert isinstance(result, GenerateResult)
    assert "output_token_logprobs_packed" in result.meta_info and "output_token_logprobs" not in result.meta_info
    triples = gen(shared_engine.url, {"input_ids": PROMPT, "sampling_params": params.to_dict(), "return_logprob": True})
    meta = triples.json()["meta_info"]
    assert result.output_ids == [t for _, t, _ in meta["output_token_logprobs"]]
    assert result.output_token_logprobs == [lp for lp, _, _ in meta["output_token_logprobs"]]


def test_bad_requests_get_400_and_server_keeps_serving(shared_engine: EngineProcess) -> None:
    url = shared_engine.url
    bad = {
        "text and input_ids": {"text": "a", "input_ids": [1]},
        "top_p": {"input_ids": PROMPT, "sampling_params": {"top_p": 0}},
        "top_p > 1": {"input_ids": PROMPT, "sampling_params": {"top_p": 1.5}},
        "max_new_tokens": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": "ten"}},
        "context length": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5000}},
        "vocabulary": {"input_ids": [1, 2, 100000]},
        "input_ids": {"input_ids": "hello"},
        "unknown sampling key": {"input_ids": PROMPT, "sampling_params": {"temprature": 1}},
    }
    for what, body in bad.items():
        r = gen(url, body)
        assert r.status_code == 400, (what, r.text)
        assert r.json()["error"]["message"], what
    r = httpx.post(url + "/generate", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert "context length" in gen(url, bad["context length"]).json()["error"]["message"]
    # A bare NaN (not JSON, but Python's json writes it): read, then refused by the checks, by name.
    nan = json.dumps({"input_ids": PROMPT, "sampling_params": {"temperature": float("nan")}})
    r = httpx.post(url + "/generate", content=nan, timeout=10)
    assert r.status_code == 400 and "temperature must be finite" in r.json()["error"]["message"], r.text
    assert gen(url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_two_hundred_concurrent_requests_are_batched(shared_engine: EngineProcess) -> None:
    url = shared_engine.url
    steps_before = info(url)["num_decode_steps"]

    def one(i: int) -> dict:
        body = {"input_ids": PROMPT + [20 + i % 10], "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
        return gen(url, body, timeout_s=120).json()

    with ThreadPoolExecutor(max_workers=64) as pool:
        outs = list(pool.map(one, range(200)))
    assert all(len(o["output_ids"]) == 16 for o in outs)
    steps = info(url)["num_decode_steps"] - steps_before
    # One sequence at a time would need 200 * 15 decode steps.
    assert steps < 200 * 15 / 4, steps


def test_a_batch_larger_than_one_prefill_chunk_decodes_in_max_new_tokens_steps(engine_factory) -> None:
    # 24 prompts of 8 tokens, 3 prompts a prefill chunk: all 8 chunks run before the first decode step, so the
    # batch decodes together and takes max_new_tokens - 1 steps (the first token comes from the prefill), not 7
    # more with the first chunk's rows running ahead of the last's.
    url = engine_factory("--max-prefill-tokens", "24").url
    prompts = [PROMPT + [20 + i % 10, 30 + i // 10] for i in range(24)]
    before = info(url)["num_decode_steps"]
    out = gen(url, {"input_ids": prompts, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}).json()
    assert [len(o["output_ids"]) for o in out] == [16] * 24
    assert info(url)["num_decode_steps"] - before == 15


def test_with_overlap_no_step_is_launched_past_the_last_token(engine_factory) -> None:
    # With overlap the scheduler launches a step before reading the one ahead of it. When that one brings every
    # row to max_new_tokens, a further step would be computed only to be dropped: 16 tokens still take 15 steps,
    # the same tokens as without overlap (one seed, greedy and sampled rows alike).
    overlapped = engine_factory("--decode-overlap", "on").url
    serial = engine_factory("--decode-overlap", "off").url
    body = {
        "input_ids": [PROMPT + [20 + i] for i in range(6)],
        "sampling_params": [{"max_new_tokens": 16, "ignore_eos": True, "temperature": t, "sampling_seed": 7}
                            for t in (0.0, 1.0, 0.0, 1.0, 0.7, 0.7)],
    }  # fmt: skip
    before = info(overlapped)["num_decode_steps"]
    out = gen(overlapped, body).json()
    assert [len(o["output_ids"]) for o in out] == [16] * 6
    assert info(overlapped)["num_decode_steps"] - before == 15
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in gen(serial, body).json()]
    # Rows of different lengths: the short ones finish first, the rest still end without a step past theirs.
    body["sampling_params"] = [{"max_new_tokens": 4 + 3 * i, "ignore_eos": True} for i in range(6)]
    before = info(overlapped)["num_decode_steps"]
    out = gen(overlapped, body).json()
    assert [len(o["output_ids"]) for o in out] == [4 + 3 * i for i in range(6)]
    # A finish before the last reads the step in flight, whose tokens the other rows keep: the longest row's
    # 19 tokens take 18 steps. (Tokens are not compared here: after a finish the serial engine's next step has
    # one row fewer, and the CPU's matmuls round differently at another batch size.)
    assert info(overlapped)["num_decode_steps"] - before == 18


def test_a_groups_samples_share_one_prefill_and_count_once_against_the_chunk(engine_factory) -> None:
    # 3 prompts x 4 samples (n), a chunk of one prompt's 8 tokens: one forward per prompt, its 3 other samples
    # copied from it (a chunk counting every sample's tokens took 12 forwards, one per sample).
    url = engine_factory("--max-prefill-tokens", "8").url
    prompts = [PROMPT + [20 + i, 30] for i in range(3)]
    before = info(url)
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "n": 4}}
    out = gen(url, body).json()
    assert len(out) == 12 and all(len(o["output_ids"]) == 4 for o in out)
    assert info(url)["num_prefill_forwards"] - before["num_prefill_forwards"] == 3


def test_pause_abort_returns_partial_outputs(engine_factory) -> None:
    eng = engine_factory()
    box: dict = {}
    # As long as the tiny model's context allows, and paused as soon as it runs: the request must not finish first.
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
        "return_logprob": True,
    }
    t = threading.Thread(target=lambda: box.update(out=gen(eng.url, body).json()))
    t.start()
    wait_running(eng.url, 1)
    assert post(eng.url, "/pause_generation", {"mode": "abort"}).json()["status"] == "ok"
    t.join(30)
    meta = box["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 1000
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    post(eng.url, "/continue_generation")


def test_pause_retract_requeues_and_in_place_keeps_cache(engine_factory) -> None:
    eng = engine_factory()
    outputs: dict[str, list[int]] = {}
    for mode in ("retract", "in_place"):
        box: dict = {}
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "sampling_seed": 3},
        }
        t = threading.Thread(target=lambda b=body, x=box: x.update(out=gen(eng.url, b).json()))
        t.start()
        wait_running(eng.url, 1)
        post(eng.url, "/pause_generation", {"mode": mode})
        state = info(eng.url)
        if mode == "retract":
            assert (state["num_reqs"], state["num_waiting_reqs"]) == (0, 1)
            assert post(eng.url, "/flush_cache").status_code == 400  # a request still waits
        else:
            assert (state["num_reqs"], state["num_waiting_reqs"]) == (1, 0)
            assert post(eng.url, "/flush_cache").status_code == 400
        time.sleep(0.3)
        assert info(eng.url)["num_generated_tokens"] == state["num_generated_tokens"]  # nothing runs while paused
        post(eng.url, "/continue_generation")
        t.join(60)
        out = box["out"]
        assert len(out["output_ids"]) == 1000 and out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
        outputs[mode] = out["output_ids"]
    # Same weights, same seed: retracting and recomputing the cache changes nothing.
    assert outputs["retract"] == outputs["in_place"]


def test_weight_version_spans_across_an_update(engine_factory) -> None:
    eng = engine_factory()
    box: dict = {}
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
    t = threading.Thread(target=lambda: box.update(out=gen(eng.url, body).json()))
    t.start()
    wait_running(eng.url, 1)
    post(eng.url, "/pause_generation", {"mode": "in_place"})
    r = post(eng.url, "/update_weight_version", {"new_version": "7", "abort_all_requests": False}).json()
    assert r["success"] and r["new_version"] == "7"
    post(eng.url, "/continue_generation")
    t.join(60)
    spans = box["out"]["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "7"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 600
    assert box["out"]["meta_info"]["weight_version"] == "7"
    assert httpx.get(eng.url + "/model_info").json()["weight_version"] == "7"


def _push_distributed(url: str, model_dir: Path, flattened: bool, paused: bool = False) -> None:
    """Act as trainer rank 0: host the group, broadcast every parameter in list order."""
    new = load_model(model_dir)
    named = list(new.state_dict().items())
    pg, group = host_weight_group(url)
    box: dict = {}
    body = {
        "names": [n for n, _ in named],
        "dtypes": ["float32"] * len(named),
        "shapes": [list(t.shape) for _, t in named],
        "group_name": group,
        "weight_version": "v1",
        "load_format": "flattened_bucket" if flattened else None,
    }
    if paused:  # the way hpcrl's push does it: tensors then land straight in the parameters
        assert post(url, "/pause_generation", {"mode": "abort"}).json()["status"] == "ok"
    send = threading.Thread(target=lambda: box.update(u=post(url, "/update_weights_from_distributed", body)))
    send.start()
    if flattened:
        # SGLang 0.5.16's layout (weight_sync/tensor_bucket.py): every tensor's bytes back to back, as uint8.
        broadcast(pg, torch.cat([t.flatten().view(torch.uint8) for _, t in named]))
    else:
        for _, t in named:
            broadcast(pg, t.contiguous())
    send.join(30)
    assert box["u"].json()["success"], box["u"].text
    if paused:
        assert post(url, "/continue_generation", {}).json()["status"] == "ok"
    assert post(url, "/destroy_weights_update_group", {"group_name": group}).json()["success"]
    destroy_weight_group(pg)


@pytest.mark.parametrize("how", ["distributed", "distributed_paused", "flattened_bucket", "tensor"])
def test_weight_update_matches_a_server_started_on_the_new_weights(engine_factory, tmp_path: Path, how: str) -> None:
    new_dir = init_tiny_model(tmp_path / "other", TinyModelSpec(seed=123))
    eng = engine_factory()
    reference = engine_factory(model_dir=new_dir)
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, "sampling_seed": 9}, "return_logprob": True}
    before = gen(eng.url, body).json()
    if how == "tensor":
        named = list(load_model(new_dir).state_dict().items())
        with create_handover(named) as payload:
            r = post(
                eng.url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "weight_version": "v1"}
            )
        assert r.json()["success"], r.text
    else:
        _push_distributed(eng.url, new_dir, flattened=how == "flattened_bucket", paused=how == "distributed_paused")
    after, expected = gen(eng.url, body).json(), gen(reference.url, body).json()
    assert after["output_ids"] != before["output_ids"]
    assert after["output_ids"] == expected["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == expected["meta_info"]["output_token_logprobs"]  # bitwise
    assert after["meta_info"]["weight_version"] == "v1"


def test_weight_update_rejects_unknown_names(shared_engine: EngineProcess) -> None:
    r = post(shared_engine.url, "/update_weights_from_tensor", {"serialized_named_tensors": ["bm90IGpzb24="]})
    assert r.status_code == 400 and "handover" in r.json()["message"]
    with create_handover([("model.nope.weight", torch.zeros(2))]) as payload:
        r = post(shared_engine.url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    assert r.status_code == 400 and "model.nope.weight" in r.json()["message"]


def test_release_and_resume_memory(engine_factory, tiny_model_dir: Path) -> None:
    eng = engine_factory()
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10, "sampling_seed": 1}, "return_logprob": True}
    before = gen(eng.url, body).json()
    # Refused while a request runs.
    box: dict = {}
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 800, "ignore_eos": True}}
    t = threading.Thread(target=lambda: box.update(out=gen(eng.url, long)))
    t.start()
    wait_running(eng.url, 1)
    r = post(eng.url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 400 and "idle" in r.json()["message"]
    t.join(60)

    r = post(eng.url, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}).json()
    assert r["freed_bytes"]["kv_cache"] > 0 and r["freed_bytes"]["weights"] > 0
    state = info(eng.url)
    assert state["weights_released"] and state["kv_cache_released"]
    r = gen(eng.url, body)
    assert r.status_code == 400 and "resume_memory_occupation" in r.json()["error"]["message"]
    assert post(eng.url, "/resume_memory_occupation", {"tags": ["weights"]}).json()["success"]
    named = list(load_model(tiny_model_dir).state_dict().items())
    with create_handover(named) as payload:
        assert post(eng.url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]}).json()["success"]
    assert post(eng.url, "/resume_memory_occupation", {"tags": ["kv_cache"]}).json()["success"]
    after = gen(eng.url, body).json()
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


def test_api_key_guards_every_endpoint(engine_factory) -> None:
    eng = engine_factory("--api-key", "s3cret")
    assert httpx.get(eng.url + "/model_info").status_code == 401
    assert gen(eng.url, {"input_ids": PROMPT}).status_code == 401
    assert post(eng.url, "/pause_generation", {"mode": "abort"}).status_code == 401
    ok = gen(
        eng.url,
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
        headers={"Authorization": "Bearer s3cret"},
    )
    assert ok.status_code == 200
    wrong = gen(eng.url, {"input_ids": PROMPT}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_deterministic_mode_and_recomputed_logprobs(engine_factory, tiny_model_dir: Path) -> None:
    eng = engine_factory("--deterministic", "--logprobs", "recompute")
    body = {
        "input_ids": [PROMPT, PROMPT[:4], [7, 8, 9, 10, 11]],
        "sampling_params": {"max_new_tokens": 20, "ignore_eos": True},
        "rid": ["x", "y", "z"],
        "return_logprob": True,
    }
    body["sampling_params"]["sampling_seed"] = 4
    a, b = gen(eng.url, body).json(), gen(eng.url, body).json()
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert [o["meta_info"]["output_token_logprobs"] for o in a] == [o["meta_info"]["output_token_logprobs"] for o in b]
    # Recompute mode reports the standard forward's re-score of the finished sequence...
    from hpcrl.model.qwen3 import token_logprobs_of_sequence

    model = load_model(tiny_model_dir)
    for prompt, out in zip(body["input_ids"], a, strict=True):
        ids = torch.tensor(prompt + out["output_ids"])
        with torch.no_grad():
            trainer_lp = token_logprobs_of_sequence(model, ids, len(prompt)).tolist()
        assert [x[0] for x in out["meta_info"]["output_token_logprobs"]] == trainer_lp
    # ...and sends what it sampled with: an engine without the re-score reports exactly those.
    plain = gen(engine_factory("--deterministic").url, body).json()
    for rescored, sampled in zip(a, plain, strict=True):
        assert rescored["output_ids"] == sampled["output_ids"]
        assert rescored["meta_info"]["hpcrl_sampled_logprobs"] == [
            x[0] for x in sampled["meta_info"]["output_token_logprobs"]
        ]
        assert "hpcrl_sampled_logprobs" not in sampled["meta_info"]


def test_health_generate_and_info(shared_engine: EngineProcess) -> None:
    assert httpx.get(shared_engine.url + "/health_generate", timeout=30).status_code == 200
    server = httpx.get(shared_engine.url + "/server_info").json()
    assert server["engine"] == "hpcrl-embedded" and "api_key" not in server
    assert httpx.get(shared_engine.url + "/model_info").json()["is_generation"] is True


def random_small_model(*, num_layers: int, qk_norm: bool, attention_bias: bool) -> tuple[Any, Any]:
    """A random fp32 Qwen3-family model (QK-norm and/or QKV bias) with norm weights away from zero."""
    from hpcrl.model.qwen3 import CausalLM, ModelArgs

    args = ModelArgs(
        vocab_size=300, hidden_size=96, intermediate_size=160, num_layers=num_layers, num_heads=4, num_kv_heads=2,
        head_dim=32, qk_norm=qk_norm, attention_bias=attention_bias,
    )  # fmt: skip
    torch.manual_seed(0)
    model = CausalLM(args).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.1)
    return args, model


@pytest.mark.parametrize("llama", [False, True])
def test_cpu_decode_step_matches_forward_cached(llama: bool) -> None:
    """The runner's fused-op CPU decode step computes forward_cached's logits and cache writes."""
    from hpcrl.engine.embedded.runner import DecodeRunner
    from hpcrl.engine.embedded.step_output import RowState
    from hpcrl.model.qwen3 import KVCache

    args, model = random_small_model(num_layers=2, qk_norm=not llama, attention_bias=llama)
    cpu = torch.device("cpu")
    lengths = [5, 17, 1, 33, 9]
    n = len(lengths)
    caches = [KVCache.allocate(args, 6, 40, torch.float32, cpu) for _ in range(2)]
    ids = torch.randint(3, 300, (n, max(lengths)))
    zeros = torch.zeros(n, dtype=torch.long)
    nxt = torch.randint(3, 300, (n,))
    with torch.no_grad():
        for cache in caches:
            model.forward_cached(ids, cache, 0, zeros, torch.tensor(lengths) - 1, from_start=True)
        ref = model.forward_cached(nxt[:, None], caches[0], 0, torch.tensor(lengths), zeros)
        runner = DecodeRunner(model, caches[1], max_batch=6, device=cpu, mode="eager")
        runner.write_rows(
            [RowState(int(t), p, 0, 0, 1.0, -1, 1.0, 0.0) for t, p in zip(nxt.tolist(), lengths, strict=True)]
        )
        got = runner.torch_forward(n)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()
    for b, length in enumerate(lengths):
        for i in range(args.num_layers):
            assert torch.allclose(caches[1].k[i][b, :, : length + 1], caches[0].k[i][b, :, : length + 1], atol=1e-6)
            assert torch.allclose(caches[1].v[i][b, :, : length + 1], caches[0].v[i][b, :, : length + 1], atol=1e-6)


@pytest.mark.parametrize("llama", [False, True])
def test_cpu_prefill_matches_forward_cached(llama: bool) -> None:
    """The runner's CPU prefill (fused weights, last layer for the last tokens only) computes
    forward_cached's logits and writes the same K/V into the same slots."""
    from hpcrl.engine.embedded.runner import DecodeRunner
    from hpcrl.model.qwen3 import KVCache

    args, model = random_small_model(num_layers=3, qk_norm=not llama, attention_bias=llama)
    cpu = torch.device("cpu")
    lengths = [5, 17, 1, 33, 9]
    ids = torch.randint(3, 300, (len(lengths), max(lengths)))
    last = torch.tensor(lengths) - 1
    caches = [KVCache.allocate(args, 8, 40, torch.float32, cpu) for _ in range(2)]
    with torch.inference_mode():
        start = torch.zeros(len(lengths), dtype=torch.long)
        ref = model.forward_cached(ids, caches[0], 2, start, last, from_start=True)
        got = DecodeRunner(model, caches[1], max_batch=8, device=cpu, mode="eager").prefill(ids, 2, last)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()
    want, have = caches[0].buffer, caches[1].buffer
    assert want is not None and have is not None
    assert torch.allclose(have, want, atol=1e-5), (have - want).abs().max()


def test_counter_uniform_numpy_path_has_the_torch_bits() -> None:
    from hpcrl.engine.embedded import sampling as S

    seeds = torch.tensor([0, 1, 2**40 + 7, 12345678901, 2**62 - 1])
    steps = torch.tensor([0, 5, 1000, 3, 2**33 + 5])
    s = S._mix32(S._mix32((seeds & S._MASK32) ^ 0x9E3779B9) ^ ((seeds >> 32) & S._MASK32))
    s = S._mix32(s ^ (steps & S._MASK32))
    x = S._mix32(S._mix32(s[:, None] ^ torch.arange(3000)[None, :]) ^ 0x85EBCA6B)
    ref = ((x >> 9).to(torch.float32) + 0.5) / float(1 << 23)
    assert torch.equal(S.counter_uniform(seeds, steps, 3000), ref)


def test_counter_uniform_numpy_path_has_the_torch_bits_for_the_chunk_uniform() -> None:
    from hpcrl.engine.embedded import sampling as S

    seeds = torch.tensor([0, 1, 2**40 + 7, 12345678901, 2**62 - 1])
    steps = torch.tensor([0, 5, 1000, 3, 2**33 + 5])
    torch_bits = S.uniform_at(S.row_keys(seeds, steps), torch.tensor([S.CHUNK_COUNTER]))[:, 0]
    assert torch.equal(S.chunk_uniform(seeds, steps), torch_bits)
    # Not any vocabulary id's uniform: the chunk draw and the noise inside the chunk are independent.
    assert not torch.equal(torch_bits, S.counter_uniform(seeds, steps, 1)[:, 0])


def test_two_level_sampling_draws_each_id_with_its_softmax_probability() -> None:
    """Ids spread over three chunks of the vocabulary, drawn 4,000 times (one seed each): every id's frequency,
    and the rest's, lie within 4.5 standard errors of softmax(logits / T)."""
    from hpcrl.engine.embedded.sampling import SAMPLE_CHUNK_IDS, RowParams, sample

    rows, vocab = 4000, 2 * SAMPLE_CHUNK_IDS + 100
    ids = torch.tensor([5, 4000, 4096, 6000, 8191, 8200])  # chunks 0, 0, 1, 1, 1, 2
    row = torch.full((vocab,), -4.0)
    row[ids] = torch.tensor([2.0, 1.0, 2.5, 0.0, 1.5, 2.2])
    for temperature in (1.0, 0.7):
        probs = torch.softmax(row.double() / temperature, -1)
        params = RowParams(
            temperature=torch.full((rows,), temperature),
            top_k=torch.full((rows,), -1),
            top_p=torch.ones(rows),
            min_p=torch.zeros(rows),
            seeds=torch.arange(rows, dtype=torch.int64) * 7 + 1,
            steps=torch.zeros(rows, dtype=torch.int64),
        )
        tokens = sample(row.expand(rows, vocab), params, want_support=False).token_ids
        counts = torch.stack([(tokens == i).sum() for i in ids] + [(~torch.isin(tokens, ids)).sum()]).double()
        expected = torch.cat([probs[ids], 1 - probs[ids].sum(0, keepdim=True)])
        stderr = (expected * (1 - expected) / rows).sqrt()
        assert ((counts / rows - expected).abs() <= 4.5 * stderr).all(), (temperature, counts / rows, expected)


def test_the_chunk_draw_never_lands_on_a_chunk_without_mass_even_at_the_uniforms_ends() -> None:
    # u * total can round up to the total (u just below 1), and leading chunks can hold no mass at all.
    from hpcrl.engine.embedded.sampling import SAMPLE_CHUNK_IDS, choose_tokens

    vocab = 4 * SAMPLE_CHUNK_IDS
    scaled = torch.full((1, vocab), float("-inf"))
    scaled[0, SAMPLE_CHUNK_IDS + 7] = 0.0  # chunk 1
    scaled[0, 2 * SAMPLE_CHUNK_IDS + 9] = 0.0  # chunk 2; chunks 0 and 3 hold nothing
    noise = torch.zeros(1, vocab)
    assert int(choose_tokens(scaled, noise, torch.tensor([0.0]))[0]) == SAMPLE_CHUNK_IDS + 7
    assert int(choose_tokens(scaled, noise, torch.tensor([0.4999]))[0]) == SAMPLE_CHUNK_IDS + 7
    assert int(choose_tokens(scaled, noise, torch.tensor([0.5001]))[0]) == 2 * SAMPLE_CHUNK_IDS + 9
    assert int(choose_tokens(scaled, noise, torch.tensor([1.0]))[0]) == 2 * SAMPLE_CHUNK_IDS + 9


def test_a_scan_that_rounds_up_across_a_chunk_of_no_mass_still_never_draws_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # A parallel scan (CUDA's cumsum, the kernel's tl.cumsum) may give a chunk of no mass a sum one ulp above its
    # predecessor's; with u * total between the two, counting the sums <= u * total picked that empty chunk.
    from hpcrl.engine.embedded.sampling import SAMPLE_CHUNK_IDS, choose_tokens

    scaled = torch.full((1, 3 * SAMPLE_CHUNK_IDS), float("-inf"))
    scaled[0, 5] = 0.0  # chunk 0: mass 1; chunk 1: none
    scaled[0, 2 * SAMPLE_CHUNK_IDS + 3] = 0.0  # chunk 2: mass 1
    exact = torch.Tensor.cumsum

    def scan_rounding_up(self: torch.Tensor, dim: int) -> torch.Tensor:
        out = exact(self, dim)
        return torch.where(self == 0, torch.nextafter(out, torch.tensor(float("inf"))), out)

    monkeypatch.setattr(torch.Tensor, "cumsum", scan_rounding_up)
    # u * total = 0.5 * 2 = 1.0: chunk 0's sum, just below the empty chunk's rounded one.
    assert int(choose_tokens(scaled, torch.zeros_like(scaled), torch.tensor([0.5]))[0]) == 2 * SAMPLE_CHUNK_IDS + 3


def test_bfloat16_logits_draw_the_tokens_of_their_float32_values() -> None:
    # The compiled decode step hands a bf16 model's logits over as they are: the chunk masses must still be summed
    # in float32 (summed in bf16, 4,096 terms a chunk, they drew chunks with a visible bias).
    from hpcrl.engine.embedded.sampling import SAMPLE_CHUNK_IDS, choose_tokens, chunk_uniform, gumbel_noise

    rows, vocab = 2000, 12 * SAMPLE_CHUNK_IDS
    torch.manual_seed(3)
    logits = (torch.randn(rows, vocab) * 2).to(torch.bfloat16)
    seeds, steps = torch.arange(rows, dtype=torch.int64) * 7 + 1, torch.zeros(rows, dtype=torch.int64)
    noise, u = gumbel_noise(seeds, steps, vocab), chunk_uniform(seeds, steps)
    assert torch.equal(choose_tokens(logits, noise, u), choose_tokens(logits.float(), noise, u))


def test_uniforms_never_reach_0_or_1() -> None:
    import numpy as np

    from hpcrl.engine.embedded.sampling import uniform_from_bits_np

    extremes = np.array([0, 1, 0x1FF, 0xFFFFFE00, 0xFFFFFFFF], dtype=np.uint32)
    u = uniform_from_bits_np(extremes)
    assert (u > 0).all() and (u < 1).all(), u
    assert np.isfinite(-np.log(-np.log(u))).all()


@pytest.mark.skipif(not any(__import__("shutil").which(c) for c in ("g++", "c++", "clang++")), reason="no C++ compiler")
def test_compiled_cpu_decode_matches_eager() -> None:
    """HPCRL_ENGINE_DECODE=compile: the compiled step samples the eager step's tokens (same seeds) with
    its log-probs and cache writes to float rounding, across batch sizes (batch 1 runs eager), attention
    lengths up to the cache's end, and rows that need the torch sampler (temperature != 1)."""
    from hpcrl.engine.embedded.runner import DecodeRunner
    from hpcrl.engine.embedded.scheduler_config import resolve_decode_mode
    from hpcrl.engine.embedded.step_output import RowState
    from hpcrl.model.qwen3 import KVCache

    args, model = random_small_model(num_layers=2, qk_norm=True, attention_bias=True)
    cpu = torch.device("cpu")
    assert resolve_decode_mode("compile", model, cpu, torch.float32) == "compile"
    max_len = 40
    ids = torch.randint(3, 300, (8, 9))
    last = torch.tensor([8, 3, 5, 0, 7, 2, 6, 4])

    def run(mode: str) -> tuple[list, list, torch.Tensor, str]:
        cache = KVCache.allocate(args, 8, max_len, torch.float32, cpu)
        runner = DecodeRunner(model, cache, max_batch=8, device=cpu, mode=mode)
        tokens, logprobs = [], []
        with torch.inference_mode():
            first = runner.prefill(ids, 0, last).argmax(-1)
            rows = [
                RowState(int(t), int(p) + 1, 100 + b, 1, 1.0, -1, 1.0, 0.0)
                for b, (t, p) in enumerate(zip(first, last, strict=True))
            ]
            # batch 8, then 5 rows, then 1 row (eager), then 5 rows with one at temperature 0.7
            for step in range(max_len - 10):
                n = 8 if step < 10 else 5 if step < 20 else 1 if step < 22 else 5
                if step in (0, 10, 20, 22):
                    if step == 22:
                        rows[2] = RowState(
                            rows[2].token, rows[2].position, rows[2].seed, rows[2].step, 0.7, -1, 1.0, 0.0
                        )
                    runner.write_rows(rows[:n])
                out = runner.decode(n, torch_sampler=False, want_support=False).result()
                tokens.append(out.tokens)
                logprobs.append(out.logprobs + out.scaled_logprobs)
                rows[:n] = [
                    RowState(t, r.position + 1, r.seed, r.step + 1, r.temperature, -1, 1.0, 0.0)
                    for t, r in zip(out.tokens, rows, strict=False)
                ]
        assert cache.buffer is not None
        return tokens, logprobs, cache.buffer, runner.mode

    want, got = run("eager"), run("compile")
    assert got[3] == "compile"  # no fallback to eager
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5), (a, b)
    assert torch.allclose(got[2], want[2], atol=1e-5), (got[2] - want[2]).abs().max()


def test_answer_text_is_what_the_tokenizer_decodes() -> None:
    from hpcrl.engine.embedded.detokenize import decode_ids
    from hpcrl.model.tiny import build_tokenizer

    tok = build_tokenizer()
    special = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [tok.convert_tokens_to_ids(c) for c in "Hello, world! 1 + 2 = 3"] + [special, 5, 7, 150_000]
    assert decode_ids(tok, ids) == tok.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in decode_ids(tok, ids) and decode_ids(tok, ids).startswith("Hello, world!")

    class Overriding(type(tok)):  # type: ignore[misc]  # a tokenizer class with a decode of its own
        def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
            return "own decode"

    tok.__class__ = Overriding
    assert decode_ids(tok, ids) == "own decode"

    class NoPrivateDecode:  # duck-typed: only the public method
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            return f"{len(token_ids)} ids, skip={skip_special_tokens}"

    assert decode_ids(NoPrivateDecode(), ids) == f"{len(ids)} ids, skip=True"


def test_fused_sampler_that_cannot_write_host_memory_keeps_running_on_device_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA the fused sampler writes each step's outputs into pinned host memory. Where a platform's kernels
    refuse the host pointer, the step is sampled again into the device buffers (copied as before), and later steps
    go there directly; the fused sampler itself stays on."""
    from hpcrl.engine.embedded.kernels import sampler
    from hpcrl.engine.embedded.runner import DecodeRunner
    from hpcrl.model.qwen3 import KVCache

    args, model = random_small_model(num_layers=1, qk_norm=True, attention_bias=False)
    cpu = torch.device("cpu")
    cache = KVCache.allocate(args, 4, 16, torch.float32, cpu)
    runner = DecodeRunner(model, cache, max_batch=4, device=cpu, mode="eager")
    # The CUDA path's state: the sampler below never launches anything.
    runner.is_cuda = runner.fast_sampler = True
    host_slots = {t.data_ptr() for t in runner.host.tok}
    calls: list[bool] = []

    def sample_rows(logits: torch.Tensor, temp: Any, seeds: Any, steps: Any, out_tok: torch.Tensor, *a: Any,
                    **k: Any) -> None:  # fmt: skip
        to_host = out_tok.data_ptr() in host_slots
        calls.append(to_host)
        if to_host:
            raise RuntimeError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        out_tok.fill_(7)

    monkeypatch.setattr(sampler, "sample_rows", sample_rows)
    logits = torch.zeros(3, args.vocab_size)
    assert runner._fast_sample(logits, 3) and runner._fast_sample(logits, 3)
    assert calls == [True, False, False]  # one refused write to the host slot, then device buffers only
    assert runner.fast_sampler and not runner._direct_out
    assert runner.slots.out_tok[:3].tolist() == [7, 7, 7]


SEQUENCE = [1, 20, 21, 14, 22, 32, 23, 24, 2]  # "<|im_start|>12+3=45<|im_end|>": a prompt and a response


def test_a_scoring_request_returns_the_prompt_logprobs_of_the_teacher_forced_forward(
    shared_engine: EngineProcess, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([SEQUENCE])).logits[0, :-1]
    ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(SEQUENCE[1:])[:, None])[:, 0].tolist()

    client = EngineClient(shared_engine.url, timeout_s=60)
    start = 6  # the response's first token
    request = GenerateRequest(
        input_ids=[SEQUENCE, SEQUENCE[:7]],
        sampling_params=SamplingParams(max_new_tokens=0, temperature=0.0),
        return_logprob=True,
        logprob_start_len=start,
    )
    results = client.generate_request(request)
    assert isinstance(results, list)
    full, short = results
    assert isinstance(full, GenerateResult) and full.output_ids == [] and full.prompt_tokens == len(SEQUENCE)
    teacher = input_token_logprobs(full)
    assert [t for _, t, _ in full.meta_info["input_token_logprobs"]] == SEQUENCE[start:]
    # SGLang's layout: null at logprob_start_len (its logits start there), then the tokens after it.
    assert teacher[0] is None
    assert max(abs(a - b) for a, b in zip(teacher[1:], ref[start:], strict=True)) < 1e-4  # type: ignore[operator]
    assert input_token_logprobs(short) == [None]

    # top_logprobs_num: the k best (log-prob, id) of each scored position, the topk of the forward's log_softmax.
    topk = client.generate_request(
        GenerateRequest(
            input_ids=SEQUENCE,
            sampling_params=SamplingParams(max_new_tokens=0),
            return_logprob=True,
            logprob_start_len=start,
            top_logprobs_num=3,
        )  # fmt: skip
    )
    assert isinstance(topk, GenerateResult)
    best = torch.log_softmax(logits.float(), -1)[start:].topk(3, -1)
    top = input_top_logprobs(topk)
    assert top[0] is None
    assert [[t for _, t in pairs] for pairs in top[1:]] == best.indices.tolist()  # type: ignore[union-attr]
    got = torch.tensor([[lp for lp, _ in pairs] for pairs in top[1:]])  # type: ignore[union-attr]
    assert torch.allclose(got, best.values, atol=1e-4)

    # From 0 the first entry is null: nothing predicts the first token (SGLang's layout).
    whole = client.generate([SEQUENCE], SamplingParams(max_new_tokens=0), logprob_start_len=0)
    assert isinstance(whole, list)
    lps = input_token_logprobs(whole[0])
    assert lps[0] is None and len(lps) == len(SEQUENCE)
    assert max(abs(a - b) for a, b in zip(lps[1:], ref, strict=True)) < 1e-4  # type: ignore[operator]

    # Without logprob_start_len the answer carries no prompt log-probs, as before.
    plain = client.generate(SEQUENCE, SamplingParams(max_new_tokens=1))
    assert isinstance(plain, GenerateResult) and "input_token_logprobs" not in plain.meta_info

    bad = httpx.post(
        shared_engine.url + "/generate",
        json={"input_ids": SEQUENCE, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
              "logprob_start_len": len(SEQUENCE)},
        timeout=30,
    )  # fmt: skip
    assert bad.status_code == 400 and "logprob_start_len=9 is not inside prompt 0 of 9 tokens" in bad.text
