"""What hpcrl sends to a real SGLang server, checked against the contract (no sglang here: no GPU, no pins).

The launcher's command line is compared with a golden file; the client's request bodies are captured
by a real HTTP server on loopback and checked field by field against sglang-contract.md.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hpcrl.engine.client import EngineClient
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.protocol.control import InitWeightsUpdateGroup, UpdateWeightsFromDistributed
from hpcrl.engine.protocol.requests import SamplingParams
from hpcrl.engine.sglang import sglang_command

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "sglang_launch.txt"


def test_launch_command_matches_golden() -> None:
    cfg = EngineConfig(
        kind="sglang", dtype="bfloat16", tp_size=2, mem_fraction_static=0.7, enable_memory_saver=True,
        max_running_requests=128, sglang_args=["--attention-backend", "fa3"],
    )  # fmt: skip
    cmd = sglang_command(
        cfg, python="python3", model_dir="/models/Qwen3-0.6B", host="10.0.0.5", port=30001,
        config_file="/run/engines/engine-1.sglang.yaml", seed=7, weight_version="0", base_gpu_id=2,
    )  # fmt: skip
    text = " ".join(cmd) + "\n"
    if os.environ.get("HPCRL_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"launcher command changed; if intended: HPCRL_UPDATE_GOLDEN=1 pytest {__file__}"
    # Flags the contract names for RL runs.
    for flag in (
        "--tp-size",
        "--mem-fraction-static",
        "--enable-memory-saver",
        "--config",
        "--random-seed",
        "--skip-server-warmup",
        "--enable-deterministic-inference",
        "--weight-version",
        "--port",
    ):
        assert flag in cmd, flag


def test_embedded_only_options_are_refused_for_sglang_and_back() -> None:
    with pytest.raises(ValueError, match="kind: sglang only"):
        EngineConfig(kind="embedded", tp_size=2)


class _Recorder(BaseHTTPRequestHandler):
    bodies: list[tuple[str, dict]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.bodies.append((self.path, body))
        reply: object = {"success": True, "message": "ok", "new_version": body.get("new_version")}
        if self.path == "/generate":
            reply = {
                "output_ids": [5],
                "meta_info": {
                    "id": "r",
                    "finish_reason": {"type": "length", "length": 1},
                    "prompt_tokens": 2,
                    "completion_tokens": 1,
                    "output_token_logprobs": [[-0.5, 5, None]],
                },
            }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_request_bodies_follow_the_contract(recorder: str) -> None:
    client = EngineClient(recorder)
    client.generate([1, 2], SamplingParams(max_new_tokens=1, temperature=0.7, top_p=0.9, sampling_seed=3))
    client.pause_generation("retract")
    client.init_weights_update_group(
        InitWeightsUpdateGroup(master_address="h", master_port=1, rank_offset=1, world_size=2, group_name="g")
    )
    client.update_weights_from_distributed(
        UpdateWeightsFromDistributed(names=["a"], dtypes=["bfloat16"], shapes=[[2]], group_name="g", flush_cache=False)
    )
    client.update_weight_version(3)
    client.continue_generation()
    bodies = dict(_Recorder.bodies)
    gen = bodies["/generate"]
    assert gen["input_ids"] == [1, 2] and gen["return_logprob"] is True
    assert gen["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.7, "top_p": 0.9, "sampling_seed": 3}
    assert bodies["/pause_generation"] == {"mode": "retract"}
    init = bodies["/init_weights_update_group"]
    assert {k: init[k] for k in ("master_address", "master_port", "rank_offset", "world_size", "group_name")} == {
        "master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g",
    }  # fmt: skip
    upd = bodies["/update_weights_from_distributed"]
    assert upd["names"] == ["a"] and upd["dtypes"] == ["bfloat16"] and upd["shapes"] == [[2]]
    assert upd["flush_cache"] is False and upd["abort_all_requests"] is False
    # SGLang's default for update_weight_version aborts every request (radixark/miles#2372): always sent false.
    assert bodies["/update_weight_version"] == {"new_version": "3", "abort_all_requests": False}
