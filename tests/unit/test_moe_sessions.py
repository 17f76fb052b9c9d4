"""Routed experts travel through a multi-turn session per turn: each sampled token reaches the trainer's batch with
the routes the engine ran when it sampled that token, even after a later turn re-ran the history on other weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from hpcrl.engine.client import EngineClient
from hpcrl.engine.protocol.answers import GenerateResult
from hpcrl.model import moe
from hpcrl.model.hf import load_model
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
from hpcrl.rollout.episodes import group_from_episodes
from hpcrl.samples.sample import Example
from hpcrl.sessions.config import SessionServerConfig
from hpcrl.sessions.environment import EpisodeResult
from hpcrl.sessions.server import SessionServer
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.push import WeightSync
from hpcrl.trainer.advantage import batch_from_groups
from tests.conftest import EngineProcess, start_engine

SHAPE = (2, 2)  # decoder layers, top-k


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                         max_position_embeddings=256)  # fmt: skip
    return init_tiny_model(tmp_path_factory.mktemp("moe") / "model", spec)


@pytest.fixture(scope="module")
def moe_engine(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    eng = start_engine(moe_dir, tmp_path_factory.mktemp("engine"), "--random-seed", "7")
    yield eng
    eng.stop()


class RecordingClient(EngineClient):
    """The engine's client, keeping every answer it got (what the engine returned when it sampled)."""

    answers: list[tuple[list[int], GenerateResult]]

    def generate(self, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        result = super().generate(input_ids, *args, **kwargs)
        self.answers.append((list(input_ids), result))
        return result


def test_each_sampled_token_keeps_the_routes_it_was_sampled_with(
    moe_engine: EngineProcess, moe_dir: Path, tmp_path: Path
) -> None:
    client = RecordingClient(moe_engine.url)
    client.answers = []
    cfg = SessionServerConfig(model_family="tiny", model=str(moe_dir), engine_urls=(moe_engine.url,))
    with SessionServer(cfg, engines=[client], routes_shape=SHAPE) as server:
        sid = httpx.post(f"{server.url}/sessions", json={}, trust_env=False).json()["session_id"]
        chat = f"{server.url}/sessions/{sid}/v1/chat/completions"
        first = [{"role": "user", "content": "12*34?"}]
        r1 = httpx.post(chat, json={"messages": first, "max_tokens": 8, "seed": 1}, trust_env=False)
        assert r1.status_code == 200, r1.text
        # New weights between the turns (an async run's update mid-episode): turn 2's request runs the history again
        # with other routers, so its routes for the history differ from those turn 1 sampled with.
        model = load_model(moe_dir)
        torch.manual_seed(0)
        pushed = [
            (n, torch.randn_like(p) if n.endswith("mlp.gate.weight") else p) for n, p in model.state_dict().items()
        ]
        sync = WeightSync(
            SyncConfig(transport="disk_delta", delta_dir=str(tmp_path / "weights")), [EngineClient(moe_engine.url)],
            device=torch.device("cpu"),
        )  # fmt: skip
        sync.connect()
        try:
            sync.push(pushed, 1)
        finally:
            sync.close()
        history = [*first, r1.json()["choices"][0]["message"], {"role": "user", "content": "And 5*6?"}]
        r2 = httpx.post(chat, json={"messages": history, "max_tokens": 8, "seed": 2}, trust_env=False)
        assert r2.status_code == 200, r2.text
        state = httpx.get(f"{server.url}/sessions/{sid}", trust_env=False).json()
    (seq,) = state["sequences"]
    ids, mask = seq["token_ids"], seq["loss_mask"]
    assert seq["routes_shape"] == [len(ids) - 1, *SHAPE]
    (ids1, a1), (ids2, a2) = client.answers
    engine = [moe.decode_routes(a.meta_info["routed_experts"], *SHAPE) for a in (a1, a2)]
    assert ids2[: len(ids1) + len(a1.output_ids)] == ids1 + a1.output_ids and ids == ids2 + a2.output_ids
    # The re-run differs: a sequence made of turn 2's answer alone would score turn 1's tokens with wrong routes.
    ran_twice = len(ids1) + len(a1.output_ids) - 1
    assert not np.array_equal(engine[0][:ran_twice], engine[1][:ran_twice])
    # The trainer's batch: routes row t-1 is the forward that sampled token t.
    group = group_from_episodes(
        Example(prompt="12*34?", answer="408"),
        [EpisodeResult(reward=1.0, end_reason="answered", num_turns=2, num_tool_calls=0, num_tool_errors=0,
                       sequences=[seq], messages=[{"role": "assistant", "content": "408"}])],
    )  # fmt: skip
    replayed = batch_from_groups([group], normalize_std=False).routed_experts
    assert replayed is not None
    sampled = [t for t, m in enumerate(mask) if m]
    assert len(sampled) == len(a1.output_ids) + len(a2.output_ids)
    for t in sampled:
        turn = 0 if t < len(ids1) + len(a1.output_ids) else 1
        assert np.array_equal(replayed[0, t - 1].numpy(), engine[turn][t - 1]), (t, turn)
    # Every token's own row is from the request that ran it first: turn 1's through its last but one sampled token.
    assert np.array_equal(replayed[0, :ran_twice].numpy(), engine[0][:ran_twice])
    assert np.array_equal(replayed[0, ran_twice : len(ids) - 1].numpy(), engine[1][ran_twice:])


def test_the_embedded_engine_passes_the_start_up_routes_check(moe_engine: EngineProcess) -> None:
    from hpcrl.engine.sglang import captures_routed_experts, check_routed_experts_capture

    client = EngineClient(moe_engine.url)
    assert captures_routed_experts(client.server_info()) is True
    check_routed_experts_capture([client], replay="observe")
