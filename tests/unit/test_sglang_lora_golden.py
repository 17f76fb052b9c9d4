"""The SGLang LoRA client (tools/gpu/sglang_lora_client.py, used by tools/gpu/lora_gpu.py) against what a real SGLang
0.5.16 answered.

A run keeps merged weights on SGLang (docs/lora.md says why); this client is what the GPU script measures SGLang's own
adapter path with. The recording lives in tests/golden/sglang-0.5.16/lora/ (made by tools/gpu/record_sglang_lora.py
on the GPU machine, in record_sglang.py's format). Each case is replayed through `SGLangAdapters` against a loopback
server that answers exactly what SGLang answered: the client must send what was recorded and read what a user needs
(the adapters loaded, the sampled tokens and their log-probs, SGLang's own words on a refusal). A file that is not a
recording fails, naming how to record it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hpcrl.engine.errors import EngineRequestError
from tests.unit.test_sglang_golden import _Replay, recorded_case, serving

ROOT = Path(__file__).resolve().parents[2]
LORA_DIR = ROOT / "tests" / "golden" / "sglang-0.5.16" / "lora"
CLIENT = ROOT / "tools" / "gpu" / "sglang_lora_client.py"
CASES = ("lora_load_generate", "lora_swap_versions", "lora_error_bad_path", "lora_error_unknown_adapter")
HINT = (
    "record it on the GPU machine: python3 tools/gpu/record_sglang_lora.py --out /tmp/lora-golden && "
    f"cp /tmp/lora-golden/*.json {LORA_DIR.relative_to(ROOT)}/"
)


def _load_client() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sglang_lora_client", CLIENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sglang_lora_client", module)
    spec.loader.exec_module(module)
    return module


SGLangAdapters = _load_client().SGLangAdapters


def load_case(name: str) -> dict[str, Any]:
    return recorded_case("lora", name, HINT)


@pytest.fixture(scope="module")
def replay() -> Iterator[_Replay]:
    with serving() as server:
        yield server


def _adapters(replay: _Replay, case: dict[str, Any]) -> Any:
    replay.load(case["exchanges"])
    return SGLangAdapters(f"http://127.0.0.1:{replay.server_address[1]}", timeout_s=10.0)


def _sent(replay: _Replay, case: dict[str, Any]) -> None:
    """The client sent each recorded request's body (paths in the recorded order); a recorded adapter path is the
    recorder's own directory, so only the body's keys and the other values are compared."""
    sent = [(m, p, b) for m, p, b in replay.received]
    want = [(e["request"]["method"], e["request"]["path"], e["request"].get("body")) for e in case["exchanges"]]
    assert [(m, p) for m, p, _ in sent] == [(m, p) for m, p, _ in want]
    for (_, path, got), (_, _, body) in zip(sent, want, strict=True):
        assert set(got) == set(body), path
        for key in set(body) - {"lora_path"} if path.endswith("_adapter") else body:
            assert got[key] == body[key], (path, key)


def _paths(case: dict[str, Any]) -> list[str]:
    loads = [e["request"] for e in case["exchanges"] if e["request"]["path"] == "/load_lora_adapter"]
    return [request["body"]["lora_path"] for request in loads]


def _generate(adapters: Any, body: dict[str, Any]) -> tuple[list[int], list[float]]:
    params = body["sampling_params"]
    return adapters.generate(
        body["input_ids"], body["lora_path"], max_new_tokens=params["max_new_tokens"], seed=params["sampling_seed"],
        temperature=params["temperature"],
    )  # fmt: skip


def test_an_adapter_is_loaded_by_name_and_named_per_request(replay: _Replay) -> None:
    case = load_case("lora_load_generate")
    adapters = _adapters(replay, case)
    (path,) = _paths(case)
    assert adapters.load("policy-v1", path) == ["policy-v1"]
    bodies = [e["request"]["body"] for e in case["exchanges"] if e["request"]["path"] == "/generate"]
    with_adapter, base = (_generate(adapters, b) for b in bodies)
    answers = [e["response"]["body"] for e in case["exchanges"] if e["request"]["path"] == "/generate"]
    for (ids, logprobs), answer in zip((with_adapter, base), answers, strict=True):
        assert len(ids) == len(logprobs) == 8 and all(lp <= 0.0 for lp in logprobs)
        assert ids == answer["output_ids"] and logprobs == [t[0] for t in answer["meta_info"]["output_token_logprobs"]]
    assert with_adapter[1] != base[1], "the adapter must change what the model answers"
    _sent(replay, case)


def test_a_new_version_under_a_new_name_and_the_unloaded_old_one_comes_back_when_a_request_names_it(
    replay: _Replay,
) -> None:
    case = load_case("lora_swap_versions")
    adapters = _adapters(replay, case)
    (path,) = _paths(case)
    assert adapters.load("policy-v2", path) == ["policy-v1", "policy-v2"]
    assert adapters.unload("policy-v1") == ["policy-v2"]
    bodies = [e["request"]["body"] for e in case["exchanges"] if e["request"]["path"] == "/generate"]
    ids, _ = _generate(adapters, bodies[0])
    assert len(ids) == 8
    # Unloading is not final: a /generate naming an unloaded adapter has SGLang load it again from the directory it
    # was loaded from (0.5.16 keeps every name it ever loaded), so the old version is served, not refused.
    ids, logprobs = _generate(adapters, bodies[1])
    assert len(ids) == len(logprobs) == 8
    _sent(replay, case)
    later = load_case("lora_error_bad_path")["exchanges"][0]["response"]["body"]["loaded_adapters"]
    assert sorted(later) == ["policy-v1", "policy-v2"], "the unloaded policy-v1 is loaded again after that request"


def test_a_missing_adapter_directory_is_refused_in_sglangs_words(replay: _Replay) -> None:
    case = load_case("lora_error_bad_path")
    adapters = _adapters(replay, case)
    (path,) = _paths(case)
    answer = case["exchanges"][0]["response"]
    assert answer["body"]["success"] is False and answer["body"]["error_message"]
    with pytest.raises(EngineRequestError, match="SGLang refused to load 'missing': .+") as err:
        adapters.load("missing", path)
    assert err.value.status_code == 400
    # SGLang takes a directory that does not exist for a Hugging Face repo id; its words reach the user whole.
    assert answer["body"]["error_message"] in str(err.value) and path in str(err.value)
    _sent(replay, case)


def test_an_adapter_never_loaded_is_refused_by_generate_and_unload(replay: _Replay) -> None:
    case = load_case("lora_error_unknown_adapter")
    adapters = _adapters(replay, case)
    bodies = [e["request"]["body"] for e in case["exchanges"] if e["request"]["path"] == "/generate"]
    with pytest.raises(EngineRequestError, match="Got LoRA adapter that has never been loaded: never-loaded") as err:
        _generate(adapters, bodies[0])
    assert err.value.status_code == 400 and "policy-v1" in str(err.value)  # SGLang lists the names it knows
    with pytest.raises(EngineRequestError, match="SGLang refused to unload 'never-loaded': .*never-loaded") as err:
        adapters.unload("never-loaded")
    assert err.value.status_code == 400
    _sent(replay, case)


def test_the_manifest_lists_every_case() -> None:
    manifest = json.loads((LORA_DIR / "manifest.json").read_text())
    assert manifest["version"] == "0.5.16" and not manifest["failed"], manifest
    assert sorted(manifest["cases"]) == sorted(CASES)
