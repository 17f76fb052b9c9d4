"""The embedded engine's apply strategies, through its real HTTP server on loopback: a weight update either replaces
the named tensors (the default, SGLang's behaviour) or adds a delta to them."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
import torch

from hpcrl.engine.embedded.apply import STRATEGIES
from hpcrl.engine.protocol.control import UpdateWeightsFromDistributed, UpdateWeightsFromTensor
from hpcrl.model.hf import load_model
from hpcrl.weightwire.group import broadcast_many, destroy_weight_group
from hpcrl.weightwire.handover import create_handover
from tests.support import host_weight_group

PROMPT = [1, 20, 21, 14, 22, 32]
BODY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "sampling_seed": 3}, "return_logprob": True}


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def served(url: str) -> tuple[list[int], list]:
    out = post(url, "/generate", BODY).json()
    return out["output_ids"], out["meta_info"]["output_token_logprobs"]


def by_handover(url: str, named: list[tuple[str, torch.Tensor]], **extra: str) -> httpx.Response:
    with create_handover(named) as payload:
        return post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload], **extra})


def by_broadcast(url: str, named: list[tuple[str, torch.Tensor]], **extra: str) -> httpx.Response:
    """Trainer rank 0's side of a paused push: without a delta, each tensor would land straight in its parameter."""
    pg, group = host_weight_group(url)
    body = {
        "names": [n for n, _ in named],
        "dtypes": ["float32"] * len(named),
        "shapes": [list(t.shape) for _, t in named],
        "group_name": group,
        **extra,
    }
    assert post(url, "/pause_generation", {"mode": "abort"}).json()["status"] == "ok"
    box: dict[str, httpx.Response] = {}
    call = threading.Thread(target=lambda: box.update(r=post(url, "/update_weights_from_distributed", body)))
    call.start()
    broadcast_many(pg, [t.contiguous() for _, t in named])
    call.join(60)
    assert post(url, "/continue_generation", {}).json()["status"] == "ok"
    assert post(url, "/destroy_weights_update_group", {"group_name": group}).json()["success"]
    destroy_weight_group(pg)
    return box["r"]


@pytest.mark.parametrize("send", [by_handover, by_broadcast], ids=["tensor", "distributed_paused"])
def test_a_delta_update_serves_exactly_what_the_summed_weights_do(engine_factory, tiny_model_dir: Path, send) -> None:
    eng = engine_factory()
    base = list(load_model(tiny_model_dir).state_dict().items())  # what the engine serves now
    gen = torch.Generator().manual_seed(0)
    delta = [(name, 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype)) for name, t in base]
    before = served(eng.url)

    r = send(eng.url, delta, apply_strategy="delta")
    assert r.json()["success"], r.text
    patched = served(eng.url)
    assert patched[0] != before[0]

    # The same engine given the sums in full (the default strategy) serves the same tokens and bits.
    r = send(eng.url, [(name, t + d) for (name, t), (_, d) in zip(base, delta, strict=True)])
    assert r.json()["success"], r.text
    assert served(eng.url) == patched


def weight(url: str, name: str) -> list[float]:
    return post(url, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20}).json()


def test_an_unknown_strategy_or_a_delta_that_overflows_is_refused_and_nothing_changes(
    engine_factory, tiny_model_dir: Path
) -> None:
    eng = engine_factory()
    named = list(load_model(tiny_model_dir).state_dict().items())
    before = served(eng.url)
    norm = "model.norm.weight"
    other, other_t = next((n, t) for n, t in named if n != norm)
    big = [(norm, torch.full_like(dict(named)[norm], 3e38))]

    r = by_handover(eng.url, big, apply_strategy="merge_adapter")
    assert r.status_code == 400
    assert f"apply_strategy 'merge_adapter' is not one of {sorted(STRATEGIES)}" in r.json()["message"]
    assert served(eng.url) == before

    # 3e38 once is finite; a bucket that adds it again overflows there and is refused whole: the other
    # tensor in it, whose sum is finite, is not written either.
    assert by_handover(eng.url, big, apply_strategy="delta").json()["success"]
    kept = weight(eng.url, other)
    r = by_handover(eng.url, [(other, torch.ones_like(other_t)), *big], apply_strategy="delta")
    assert r.status_code == 400 and f"{norm!r} plus its delta holds non-finite values" in r.json()["message"]
    assert weight(eng.url, other) == kept

    # The full weights put it back as it was.
    assert by_handover(eng.url, named).json()["success"]
    assert served(eng.url) == before


def test_the_strategy_travels_only_when_it_is_not_the_default() -> None:
    """Stock SGLang refuses keys it does not know: a plain update's body is SGLang's own."""
    plain = UpdateWeightsFromTensor(serialized_named_tensors=("x",))
    assert "apply_strategy" not in plain.to_dict()
    delta = UpdateWeightsFromDistributed(names=("w",), dtypes=("float32",), shapes=((2,),), apply_strategy="delta")
    assert delta.to_dict()["apply_strategy"] == "delta"
    assert UpdateWeightsFromDistributed.from_dict(delta.to_dict()) == delta
    assert UpdateWeightsFromTensor.from_dict(plain.to_dict()).apply_strategy == "replace"
