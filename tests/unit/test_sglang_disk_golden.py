"""sync.transport=disk_delta into stock SGLang: the engine-node agent (its own process,
hpcrl/sync/delta_agent_server.py, as the launcher starts it beside the server) patches its copy of the weights and
has SGLang load it with `/update_weights_from_disk`, replayed against what SGLang 0.5.16 answered
(tests/golden/sglang-0.5.16/disk/, recorded by tools/gpu/record_sglang_disk.py). SGLang 0.5.16 answers 400 to
/get_weights_by_name for this Qwen3 model (recorded), so nothing on this path asks it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.engine.client import EngineClient
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.disk_delta import DiskDeltaTransport
from hpcrl.sync.errors import WeightSyncError
from hpcrl.sync.transport import TransportContext
from hpcrl.weightwire.buckets import buckets
from tests.unit.test_disk_delta import Trainer
from tests.unit.test_sglang_golden import RECORDED_DIR, _Replay, recorded_case, serving

DISK_DIR = RECORDED_DIR / "disk"
RECORD_HINT = (
    "record it on the GPU machine: python3 tools/gpu/record_sglang_disk.py --out /tmp/sglang-disk && "
    "cp /tmp/sglang-disk/*.json tests/golden/sglang-0.5.16/disk/"
)


def load_case(name: str) -> dict[str, Any]:
    return recorded_case("disk", name, RECORD_HINT)


def exchange(case: dict[str, Any], label: str) -> dict[str, Any]:
    return next(e for e in case["exchanges"] if e["label"] == label)


def logprobs(case: dict[str, Any], label: str) -> torch.Tensor:
    """The greedy tokens' log-probs of a recorded /generate (a 1% weight change moves them, rarely the tokens)."""
    meta = exchange(case, label)["response"]["body"]["meta_info"]
    return torch.tensor([float(t[0]) for t in meta["output_token_logprobs"]])


@pytest.fixture(scope="module")
def replay() -> Iterator[_Replay]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def agent_run_dir(replay: _Replay, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A run directory where the replayed server's disk-delta agent (a real process, as the launcher starts it)
    announced itself."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "engines").mkdir()
    (run_dir / "engine.key").write_text("")  # the replayed server takes no key
    host, port = replay.server_address[:2]
    record = run_dir / "engines" / "engine-0.agent.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.sync.delta_agent_server", "--engine-url", f"http://{host}:{port}",
         "--key-file", str(run_dir / "engine.key"), "--model-dir", str(tiny_model_dir), "--record", str(record),
         "--dtype", "bfloat16", "--local-dir", str(run_dir / "agent")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not record.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the disk-delta agent did not start:\n{proc.communicate()[0]}")
            time.sleep(0.1)
        yield run_dir
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def sglang_transport(replay: _Replay, run_dir: Path, weights: Path) -> DiskDeltaTransport:
    host, port = replay.server_address[:2]
    engine = EngineClient(f"http://{host}:{port}", timeout_s=10.0, max_retries=0)

    def each(fn: Any, what: str) -> list[Any]:
        try:
            return [fn(engine)]
        except Exception as exc:
            raise WeightSyncError(f"{what} failed on engine {engine.url}: {exc}") from exc

    ctx = TransportContext(
        cfg=SyncConfig(transport="disk_delta", delta_dir=str(weights)), engines=[engine],
        device=torch.device("cpu"), pool=ThreadPoolExecutor(1), each=each, engine_kind="sglang", engine_tp_size=1,
        run_dir=run_dir,
    )  # fmt: skip
    transport = DiskDeltaTransport(ctx)
    transport.connect()
    return transport


def push(transport: DiskDeltaTransport, named: list[tuple[str, torch.Tensor]], version: int) -> None:
    transport.begin(version)
    for bucket in buckets(named, 2**20):
        transport.send(bucket)
    transport.finish(version)


def test_the_agent_has_sglang_load_its_patched_copy_and_sglang_serves_it(
    replay: _Replay, agent_run_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    case = load_case("update_weights_from_disk_weight_version")
    replay.load(case["exchanges"])
    transport = sglang_transport(replay, agent_run_dir, tmp_path / "weights")
    trainer = Trainer(tiny_model_dir, lr=1e-4)
    try:
        push(transport, trainer.pushed(), 6)  # a snapshot
        trainer.step()
        push(transport, trainer.pushed(), 7)  # a delta, patched into the agent's copy
        assert transport.metrics()["sync/delta_bytes"] > 0
        sent = [body for method, path, body in replay.received if path == "/update_weights_from_disk"]
        recorded = exchange(case, "load A with a version")["request"]["body"]
        assert len(sent) == 2 and set(sent[-1]) == set(recorded)
        assert {k: v for k, v in sent[-1].items() if k != "model_path"} == {
            k: v for k, v in recorded.items() if k != "model_path"
        }
        # What SGLang was told to load is the trainer's version 7, bit for bit, with the model's other files.
        loaded = Path(sent[-1]["model_path"])
        assert (loaded / "config.json").is_file()
        tensors = load_file(str(loaded / "model.safetensors"))
        for name, tensor in trainer.pushed():
            assert torch.equal(tensors[name].view(torch.int16), tensor.view(torch.int16)), name
        host, port = replay.server_address[:2]
        assert EngineClient(f"http://{host}:{port}").weight_version() == 7  # SGLang's model_info after the load
    finally:
        transport.close()
    # What SGLang did with the loads it was given: B's weights served after loading B, A's after loading A again.
    first = load_case("update_weights_from_disk")
    assert exchange(first, "load B")["response"]["status"] == 200
    on_a = logprobs(first, "generate on A")
    assert not torch.allclose(logprobs(first, "generate on B"), on_a, atol=1e-4)
    assert torch.allclose(logprobs(case, "generate on A again"), on_a, atol=1e-4)
    # The version the agent sent is the one SGLang stamps on what it samples after the load.
    assert exchange(case, "generate on A again")["response"]["body"]["meta_info"]["weight_version"] == "7"
    # SGLang 0.5.16 refuses /get_weights_by_name for this Qwen3 model: what the agent loaded is checked by the
    # log-probs above, and the disk path never asks for it.
    for answer in (exchange(first, "get_weights_by_name"), exchange(case, "get_weights_by_name")):
        assert answer["response"]["status"] == 400
        assert answer["response"]["body"] == {"error": {"message": "Get parameter by name failed"}}
    assert "/get_weights_by_name" not in {path for _, path, _ in replay.received}


def test_a_path_sglang_cannot_load_fails_the_push_with_sglangs_message_and_it_keeps_serving(
    replay: _Replay, agent_run_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    case = load_case("update_weights_from_disk_missing_path")
    replay.load(case["exchanges"])
    answer = exchange(case, "load a missing path")["response"]
    assert answer["status"] != 200 and answer["body"]["success"] is False
    transport = sglang_transport(replay, agent_run_dir, tmp_path / "weights")
    try:
        with pytest.raises(WeightSyncError, match=r"did not take the weights .*update_weights_from_disk") as err:
            push(transport, Trainer(tiny_model_dir).pushed(), 1)
        assert answer["body"]["message"][:40] in str(err.value)
        assert exchange(case, "load a missing path")["request"]["body"]["model_path"].endswith("no-such-model")
        # The server the push failed on still answers, on the weights it had ("default": the ones it started with).
        host, port = replay.server_address[:2]
        with EngineClient(f"http://{host}:{port}", timeout_s=10.0, max_retries=0) as client:
            assert client.health() and client.weight_version() == 0
        assert "/get_weights_by_name" not in {path for _, path, _ in replay.received}
    finally:
        transport.close()
    first = load_case("update_weights_from_disk")
    assert torch.allclose(logprobs(case, "generate (still B)"), logprobs(first, "generate on B"), atol=1e-4)
    assert exchange(case, "health")["response"]["status"] == 200
