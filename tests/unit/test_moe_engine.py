"""The embedded engine serves a Qwen3-MoE model: its log-probs are the trainer's, and each token's routed experts come
back in SGLang's layout, kept through a retraction."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.embedded.generate_routes import _extra_meta
from hpcrl.engine.embedded.requests import SeqRequest
from hpcrl.engine.embedded.scheduler import Scheduler, SchedulerConfig
from hpcrl.engine.embedded.scheduler_config import resolve_decode_mode
from hpcrl.model import moe
from hpcrl.model.hf import load_model
from hpcrl.model.qwen3 import CausalLM
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    spec = TinyModelSpec(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                         max_position_embeddings=128)  # fmt: skip
    return load_model(init_tiny_model(tmp_path_factory.mktemp("moe") / "model", spec)).eval()


def _requests(n: int) -> list[SeqRequest]:
    rng = random.Random(0)
    return [
        SeqRequest(
            rid=f"r{i}",
            prompt_ids=[rng.randrange(3, 99) for _ in range(rng.randrange(2, 10))],
            max_new_tokens=8 - i % 3,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            seed=100 + i,
            stop_token_ids=frozenset(),
            ignore_eos=True,
            return_logprob=True,
            return_sampling_mask=False,
            on_done=lambda r: None,
            return_routed_experts=i != 1,
        )
        for i in range(n)
    ]


def test_engine_serves_moe_with_trainer_logprobs_and_routes(model: CausalLM) -> None:
    args = model.args.moe
    assert args is not None
    assert resolve_decode_mode("graph", model, torch.device("cpu"), torch.float32) == "eager"
    reqs = _requests(4)
    sched = Scheduler(
        model,
        SchedulerConfig(engine=EngineConfig(max_running_requests=3, deterministic=False), context_length=64),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    sched.submit(reqs)
    steps = 0
    with torch.inference_mode():
        while sched.waiting or sched.running:
            sched._step()
            steps += 1
            if steps == 3:  # a retraction: the rows are re-prefilled with their outputs so far
                sched.pause("retract")
                sched.resume_generation()
        sched._drain()
    assert all(r.finish_reason is not None and r.output_ids for r in reqs)
    agree = total = 0
    for r in reqs:
        ids = torch.tensor(r.all_ids)
        with torch.no_grad():
            lp = torch.log_softmax(model(ids[None])[0].float(), -1)
        trainer = lp[len(r.prompt_ids) - 1 : -1].gather(-1, ids[len(r.prompt_ids) :, None])[:, 0]
        assert torch.allclose(trainer, torch.tensor(r.logprobs.tolist(), dtype=torch.float32), atol=1e-4)
        meta = _extra_meta(r)
        if not r.return_routed_experts:
            assert meta is None or "routed_experts" not in meta
            continue
        assert meta is not None
        routes = moe.decode_routes(meta["routed_experts"], 2, 2)
        # SGLang's layout: one row per token a forward ran (every token but the last), per layer, top-k.
        assert routes.shape == (r.num_tokens - 1, 2, 2)
        own = moe.routes_of(model.routing, args, 1, r.num_tokens)[0, :-1].numpy()
        same = (np.sort(own, -1) == np.sort(routes, -1)).all(-1)
        agree, total = agree + int(same.sum()), total + same.size
    # The engine's and the trainer's forwards differ in batch shape only: near-ties aside, the same experts.
    assert agree / total > 0.97, agree / total


def test_routes_keep_the_first_forward_of_each_token() -> None:
    r = _requests(1)[0]
    r.add_routes(np.zeros((5, 2, 2), np.int32), 0)
    r.add_routes(np.ones((7, 2, 2), np.int32), 0)  # a re-prefill after a retraction: tokens 0-4 keep their routes
    r.add_routes(np.full((1, 2, 2), 2, np.int32), 7)
    got = np.concatenate(r.routes)
    assert got.shape == (8, 2, 2) and got[:5].max() == 0 and got[5:7].min() == 1 and got[7].min() == 2


def test_rollout_sample_keeps_checked_routes() -> None:
    from hpcrl.engine.protocol.answers import GenerateResult
    from hpcrl.rollout.generate import routed_experts

    routes = np.arange(6 * 2 * 2, dtype=np.int32).reshape(6, 2, 2) % 8
    answer = {"output_ids": [5, 6, 7], "meta_info": {"id": "r", "routed_experts": moe.encode_routes(routes)}}
    result = GenerateResult.from_response(answer)
    assert np.array_equal(routed_experts(result, 4, (2, 2), "http://e"), routes)
    with pytest.raises(ValueError, match=r"shape \(6, 2, 2\), but a sequence of 8 tokens on this model needs \(7, 2"):
        routed_experts(result, 5, (2, 2), "http://e")
    with pytest.raises(ValueError, match="not a whole number of tokens x 5 layers"):
        routed_experts(result, 4, (5, 2), "http://e")
    bare = GenerateResult.from_response({"output_ids": [5], "meta_info": {"id": "r"}})
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        routed_experts(bare, 4, (2, 2), "http://e")
