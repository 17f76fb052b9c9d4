"""True on-policy for mixture-of-experts models: with the batch-invariant forward on both sides (engine.batch_invariant,
train.logprobs: invariant) the engine's routes and log-probs are the trainer's bit for bit, without routing replay."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.embedded.generate_routes import _extra_meta
from hpcrl.engine.embedded.scheduler import Scheduler, SchedulerConfig, SeqRequest
from hpcrl.model import invariant, moe
from hpcrl.model.hf import load_model
from hpcrl.model.qwen3 import CausalLM
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.torch_backend import TorchTrainer

SHAPE = (2, 4)  # decoder layers, top-k


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=8, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=16,
                         max_position_embeddings=128)  # fmt: skip
    return init_tiny_model(tmp_path_factory.mktemp("moe") / "model", spec)


def generate(model: CausalLM) -> list[SeqRequest]:
    """Rows of different lengths through the batch-invariant engine (batches grow and shrink), one retraction."""
    rng = random.Random(0)
    reqs = [
        SeqRequest(
            rid=f"r{i}", prompt_ids=[rng.randrange(3, 99) for _ in range(rng.randrange(2, 12))],
            max_new_tokens=8 - i % 3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=100 + i,
            stop_token_ids=frozenset(), ignore_eos=True, return_logprob=True, return_sampling_mask=False,
            on_done=lambda r: None, return_routed_experts=True,
        )
        for i in range(9)
    ]  # fmt: skip
    param = next(model.parameters())
    engine = EngineConfig(
        max_running_requests=4, batch_invariant=True, deterministic=False, device=param.device.type,  # type: ignore[arg-type]
        dtype=str(param.dtype).removeprefix("torch."),  # type: ignore[arg-type]
    )  # fmt: skip
    sched = Scheduler(model, SchedulerConfig(engine=engine, context_length=64), device=param.device, dtype=param.dtype)
    sched.submit(reqs)
    steps = 0
    with torch.inference_mode():
        while sched.waiting or sched.running:
            sched._step()
            steps += 1
            if steps == 4:
                sched.pause("retract")
                sched.resume_generation()
        sched._drain()
    assert all(r.finish_reason is not None for r in reqs) and any(r.num_retractions for r in reqs)
    return reqs


def trainer_agreement(model: CausalLM, reqs: list[SeqRequest], engine_routes: list[np.ndarray]) -> tuple[float, float]:
    """The trainer's invariant forward (routing_replay off: its own router) in padded micro-batches of 4: the share
    of token x layer expert sets equal to the engine's, and the largest log-prob gap."""
    assert model.args.moe is not None
    agree = total = 0
    gap = 0.0
    for start in range(0, len(reqs), 4):
        mb_reqs = reqs[start : start + 4]
        mb = TrainBatch.from_sequences([r.prompt_ids for r in mb_reqs], [r.output_ids for r in mb_reqs])
        ids = mb.input_ids.to(next(model.parameters()).device)
        with torch.no_grad():
            lp = invariant.token_logprobs(model, ids).cpu()
        own = moe.routes_of(model.routing, model.args.moe, *ids.shape).cpu().numpy()
        for i, (r, routes) in enumerate(zip(mb_reqs, engine_routes[start : start + 4], strict=True)):
            same = (own[i, : len(routes)] == routes).all(axis=(1, 2))
            agree, total = agree + int(same.sum()), total + same.size
            p = len(r.prompt_ids)
            sampled = torch.tensor(r.logprobs.tolist(), dtype=torch.float32)
            gap = max(gap, float((lp[i, p - 1 : p - 1 + len(r.output_ids)] - sampled).abs().max()))
    return agree / total, gap


def test_engine_routes_and_logprobs_equal_the_trainers_without_replay(moe_dir: Path) -> None:
    model = load_model(moe_dir).eval()
    # init-tiny sets norm_topk_prob: the renormalisation over the chosen experts runs the invariant path too.
    assert model.args.moe is not None and model.args.moe.norm_topk_prob
    assert invariant.unsupported_model(model.args) is None
    reqs = generate(model)
    engine_routes = [moe.decode_routes((_extra_meta(r) or {})["routed_experts"], *SHAPE) for r in reqs]
    prompts, responses = [r.prompt_ids for r in reqs], [r.output_ids for r in reqs]
    assert trainer_agreement(model, reqs, engine_routes) == (1.0, 0.0)
    # The torch trainer, train.logprobs: invariant, replay off: its log-probs are the ones the engine sampled with.
    trainer = TorchTrainer(
        TrainConfig(lr=1e-3, micro_batch_size=4, logprobs="invariant", routing_replay="off"), moe_dir
    )
    batch = TrainBatch.from_sequences(
        prompts, responses, advantages=[1.0, -1.0] * 4 + [0.5], rollout_logprobs=[r.logprobs.tolist() for r in reqs]
    )
    metrics = trainer.train_grpo(batch)
    assert metrics["train_rollout_logprob_max_abs_diff"] == 0.0
    assert "moe/route_agreement" not in metrics
    # observe: the same forward, the agreement measured by the trainer as a run reports it.
    observe = TorchTrainer(
        TrainConfig(lr=1e-3, micro_batch_size=4, logprobs="invariant", routing_replay="observe"), moe_dir
    )
    batch = TrainBatch.from_sequences(
        prompts, responses, advantages=[1.0, -1.0] * 4 + [0.5], rollout_logprobs=[r.logprobs.tolist() for r in reqs],
        routed_experts=[np.array(r) for r in engine_routes],
    )  # fmt: skip
    metrics = observe.train_grpo(batch)
    assert metrics["moe/route_agreement"] == 1.0 and metrics["train_rollout_logprob_max_abs_diff"] == 0.0


def test_invariant_replay_forces_the_given_experts_and_keeps_the_router_gradient(moe_dir: Path) -> None:
    model = load_model(moe_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    with torch.no_grad():
        invariant.token_logprobs(model, ids)
    own = moe.routes_of(model.routing, model.args.moe, 2, 5)
    model.routing.replay = (own + 1) % 8  # other experts everywhere
    lp = invariant.token_logprobs(model, ids)
    forced = moe.routes_of(model.routing, model.args.moe, 2, 5)
    assert torch.equal(forced, (own + 1) % 8)
    lp.sum().backward()
    gate = model.model.decoder_layers[0].mlp.gate.weight
    assert gate.grad is not None and bool(gate.grad.abs().sum() > 0)
