"""The embedded engine on CUDA (graph-captured fused decode step), as an SGLang client sees it.

Skipped without CUDA. On the GPU machine: `PYTHONPATH=. python3 -m pytest tests/gpu -q`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from hpcrl.model.hf import load_model
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
from hpcrl.weightwire.handover import create_handover
from tests.conftest import EngineProcess, start_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPT = [1, 20, 21, 14, 22, 32]


def gen(url: str, body: dict, timeout_s: float = 120.0) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=timeout_s)
    assert r.status_code == 200, r.text
    return r.json()


def post(url: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body if body is not None else {}, timeout=120)


def info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]


@pytest.fixture(scope="module")
def cuda_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    eng = start_engine(
        tiny_model_dir, tmp_path_factory.mktemp("cuda"), "--device", "cuda", "--dtype", "float32", timeout_s=180
    )
    yield eng
    eng.stop()


def test_graph_path_and_logprobs_match_teacher_forcing(cuda_engine: EngineProcess, tiny_model_dir: Path) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}, "return_logprob": True}
    out = gen(cuda_engine.url, body)
    assert info(cuda_engine.url)["decode_path"] == "cuda_graph"
    engine_lp = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    ids = torch.tensor(PROMPT + out["output_ids"])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(ids[None]).logits[0, len(PROMPT) - 1 : -1]
    ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[len(PROMPT) :, None])[:, 0]
    assert (engine_lp - ref).abs().max().item() < 1e-3


def test_an_fp8_kv_cache_decodes_what_the_model_scores(tiny_model_dir: Path, tmp_path: Path) -> None:
    """bf16 engines with a bf16 and an 8-bit K/V cache: both sets of sampled log-probs against the model's own
    full-sequence bf16 forward over the same tokens; the 8-bit cache may cost accuracy, not correctness."""
    from hpcrl.model.qwen3 import token_logprobs_of_sequence

    model = load_model(tiny_model_dir, dtype=torch.bfloat16, device=torch.device("cuda"))
    prompts = [PROMPT[: 2 + i % 5] + [7 + i] for i in range(16)]
    gaps = {}
    for cache in ("auto", "fp8_e4m3"):
        (tmp_path / cache).mkdir()
        eng = start_engine(tiny_model_dir, tmp_path / cache, "--device", "cuda", "--dtype", "bfloat16",
                           "--kv-cache-dtype", cache, timeout_s=180)  # fmt: skip
        try:
            outs = gen(eng.url, {"input_ids": prompts, "sampling_params": {"max_new_tokens": 48, "ignore_eos": True},
                                 "return_logprob": True})  # fmt: skip
            assert info(eng.url)["decode_path"] == "cuda_graph"
            assert httpx.get(eng.url + "/server_info", timeout=10).json()["kv_cache_dtype"] == cache
        finally:
            eng.stop()
        diffs = []
        for p, o in zip(prompts, outs, strict=True):
            engine_lp = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]])
            with torch.inference_mode():
                ref = token_logprobs_of_sequence(model, torch.tensor(p + o["output_ids"], device="cuda"), len(p))
            diffs.append((engine_lp - ref.float().cpu()).abs())
        gaps[cache] = torch.cat(diffs)
    print({k: (v.mean().item(), v.max().item()) for k, v in gaps.items()})
    assert torch.isfinite(gaps["fp8_e4m3"]).all()
    # Reading 8-bit bytes as anything else would put log-probs off by whole units, not hundredths.
    assert gaps["fp8_e4m3"].mean().item() < 0.05 and gaps["fp8_e4m3"].max().item() < 0.5


def test_seeded_requests_repeat_and_batches_run(cuda_engine: EngineProcess) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30, "sampling_seed": 3}, "return_logprob": True}
    a, b = gen(cuda_engine.url, body), gen(cuda_engine.url, body)
    assert a["output_ids"] == b["output_ids"]
    batch = gen(
        cuda_engine.url,
        {
            "input_ids": [PROMPT[: 1 + i % 6] for i in range(37)],
            "sampling_params": [{"max_new_tokens": 5 + 3 * i, "ignore_eos": True} for i in range(37)],
        },
    )
    assert [o["meta_info"]["completion_tokens"] for o in batch] == [5 + 3 * i for i in range(37)]


def test_filtered_sampling_and_greedy(cuda_engine: EngineProcess) -> None:
    params = {"max_new_tokens": 8, "sampling_seed": 5, "temperature": 0.7, "top_k": 5, "top_p": 0.9}
    out = gen(cuda_engine.url, {"input_ids": PROMPT, "sampling_params": params, "return_sampling_mask": True})
    masks = out["meta_info"]["output_token_sampling_mask"]
    assert all(1 <= len(s) <= 5 for s in masks)
    assert all(t in s for t, s in zip(out["output_ids"], masks, strict=True))
    greedy = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    assert gen(cuda_engine.url, greedy)["output_ids"] == gen(cuda_engine.url, greedy)["output_ids"]


def test_pause_retract_and_abort_on_cuda(cuda_engine: EngineProcess) -> None:
    url = cuda_engine.url
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    # A CUDA-graph decode can finish 900 tokens before the pause lands; try again rather than skip,
    # and fail if the pause never catches a running request.
    for _ in range(5):
        box: dict = {}
        t = threading.Thread(target=lambda b=box: b.update(out=gen(url, body)))
        t.start()
        deadline = time.monotonic() + 30
        while info(url)["num_reqs"] < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        post(url, "/pause_generation", {"mode": "retract"})
        if "out" not in box:
            break
        post(url, "/continue_generation")
        t.join(120)
    else:
        raise AssertionError("in 5 tries every 900-token request finished before the pause arrived")
    assert info(url)["num_waiting_reqs"] == 1
    post(url, "/continue_generation")
    t.join(120)
    assert len(box["out"]["output_ids"]) == 900
    assert box["out"]["meta_info"]["num_retractions"] == 1


def test_cuda_ipc_update_and_memory_release(tiny_model_dir: Path, tmp_path: Path) -> None:
    new_dir = init_tiny_model(tmp_path / "other", TinyModelSpec(seed=123))
    args = ("--device", "cuda", "--dtype", "bfloat16")
    eng = start_engine(tiny_model_dir, tmp_path, *args, timeout_s=180)
    ref = start_engine(new_dir, tmp_path, *args, timeout_s=180)
    try:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, "sampling_seed": 9}}
        before = gen(eng.url, body)
        named = [(n, t.cuda()) for n, t in load_model(new_dir, dtype=torch.bfloat16).state_dict().items()]
        with create_handover(named) as payload:
            r = post(eng.url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
        assert r.json()["success"], r.text
        after, expected = gen(eng.url, body), gen(ref.url, body)
        assert after["output_ids"] == expected["output_ids"] != before["output_ids"]

        r = post(eng.url, "/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]}).json()
        assert r["device_allocated_after"] < r["device_allocated_before"]
        assert r["device_reserved_after"] < r["device_reserved_before"]
        assert post(eng.url, "/resume_memory_occupation", {"tags": ["weights"]}).json()["success"]
        with create_handover(named) as payload:
            assert post(eng.url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]}).json()[
                "success"
            ]
        assert post(eng.url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}).json()["success"]
        assert gen(eng.url, body)["output_ids"] == after["output_ids"]
    finally:
        eng.stop()
        ref.stop()
