"""A run that replays routes refuses, at start-up, an SGLang server started without routed-expert capture: checked
against what SGLang 0.5.16 answered on /server_info (tests/golden/sglang-0.5.16/server_info.json, a server started
without --enable-return-routed-experts), served on loopback."""

from __future__ import annotations

import threading

import pytest

from hpcrl.engine.client import EngineClient
from hpcrl.engine.sglang import RoutesNotCapturedError, captures_routed_experts, check_routed_experts_capture
from tests.unit.test_sglang_golden import _Replay, load_case


def test_a_server_without_routed_expert_capture_is_refused_with_the_flag_to_add() -> None:
    case = load_case("server_info")
    server = _Replay()
    server.load(case["exchanges"])
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        host, port = server.server_address[:2]
        with EngineClient(f"http://{host}:{port}", timeout_s=10.0, max_retries=1) as client:
            assert captures_routed_experts(client.server_info()) is False
            with pytest.raises(RoutesNotCapturedError) as err:
                check_routed_experts_capture([client], replay="rollout")
    finally:
        server.shutdown()
        server.server_close()
    message = str(err.value)
    assert f"http://{host}:{port}" in message and "train.routing_replay: rollout" in message
    assert "--enable-return-routed-experts to engine.sglang_args" in message and "routing_replay: off" in message
