"""A mixture-of-experts model (Qwen3-MoE) on the Megatron backend, on CPU: the same log-probs, loss, routing metrics
and step as the torch backend with and without routing replay; expert parallelism over two gloo ranks equal to one
expert-parallel rank; the HF <-> Megatron conversion of the experts; the refusals of splits that do not fit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.model.qwen3 import ModelArgs
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.megatron.layout import Shard, check_parallel_sizes, hf_names, to_hf, to_megatron
from tests.unit.fsdp_moe_ranks import replayed_batch
from tests.unit.megatron_ranks import NO_KL
from tests.unit.test_fsdp import FP32, STEPS, assert_close, launch, wait
from tests.unit.test_megatron import random_hf_state

pytest.importorskip("megatron.core")

# Two sparse layers of 8 experts, top-2, renormalised top-k (Qwen3-30B-A3B's norm_topk_prob).
SPEC = TinyModelSpec(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                     max_position_embeddings=128)  # fmt: skip


# Weights after one AdamW step at lr 1e-2 (each weight moves by about 1e-2) of two different codes: Adam divides by the
# root of the squared gradient, which magnifies the rounding of gradients near 0 (to ~2.5e-5 here).
ACROSS_BACKENDS = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("megatron_moe") / "moe", SPEC)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank Megatron trainer in this process: its process group and Megatron's groups are torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    yield
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def trainers(model_dir: Path, replay: str) -> tuple:
    from hpcrl.trainer.megatron.backend import MegatronTrainer
    from hpcrl.trainer.torch_backend import TorchTrainer

    train = dict(NO_KL, routing_replay=replay)
    return (MegatronTrainer(TrainConfig(backend="megatron", **train), model_dir),  # type: ignore[arg-type]
            TorchTrainer(TrainConfig(**train), model_dir))  # type: ignore[arg-type]  # fmt: skip


def test_one_expert_parallel_rank_trains_as_the_torch_backend_with_and_without_replay(
    moe_dir: Path, one_rank: None
) -> None:
    """Megatron's MoE layer (router, top-k, norm_topk_prob, SequentialMLP experts) with Qwen3-MoE's load-balancing
    loss: the log-probs, the step's loss and routing metrics and the weights after one step equal the torch
    backend's on the same weights and batch (fp32). Replay forces the rollout's routes: the log-probs change, and
    the two backends still agree."""
    args = ModelArgs.from_dir(moe_dir)
    assert args.moe is not None
    batch = replayed_batch(args.num_layers, args.moe.num_experts, args.moe.top_k, args.vocab_size)
    scored = {}
    for replay in ("rollout", "off"):
        megatron, reference = trainers(moe_dir, replay)
        got, want = megatron.pipeline.score(batch, reference=False), reference.score(batch, reference=False)
        torch.testing.assert_close(got, want, **FP32)
        scored[replay] = got
        m, t = megatron.train_grpo(batch), reference.train_grpo(batch)
        keys = ["loss", "pg_loss", "entropy", "grad_norm", "moe/aux_loss", "moe/expert_load_cv"]
        keys += ["moe/route_agreement"] if replay == "rollout" else []
        for key in keys:
            assert m[key] == pytest.approx(t[key], rel=1e-5, abs=1e-7), (replay, key)
        assert m["moe/aux_loss"] > 0
        assert_close(
            dict(megatron.export_weights()), dict(reference.export_weights()), f"replay {replay}", ACROSS_BACKENDS
        )
    # The forced routes are not the router's own (agreement < 0.5 above): they change the log-probs.
    assert float((scored["rollout"] - scored["off"]).abs().max()) > 1e-4


def test_export_gives_back_the_hf_tensors(moe_dir: Path, one_rank: None, tmp_path: Path) -> None:
    """Load the HF directory into Megatron's layout, export it: every tensor comes back bitwise, router and experts
    included."""
    from hpcrl.trainer.megatron.backend import MegatronTrainer

    trainer = MegatronTrainer(TrainConfig(backend="megatron", **NO_KL), moe_dir)  # type: ignore[arg-type]
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight" in dict(trainer.model.named_parameters())
    exported = load_file(trainer.export(tmp_path / "export") / "model.safetensors")
    original = load_file(moe_dir / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_conversion_splits_the_experts_over_ep_ranks_and_joins_them_bitwise(moe_dir: Path, ep: int) -> None:
    args = ModelArgs.from_dir(moe_dir)
    assert args.moe is not None
    hf = random_hf_state(args)
    shards = [to_megatron(hf.__getitem__, args, Shard(ep_rank=r, ep_size=ep, num_layers=args.num_layers))
              for r in range(ep)]  # fmt: skip
    per = args.moe.num_experts // ep
    assert sum(".local_experts." in k and k.startswith("decoder.layers.0.") for k in shards[0]) == 2 * per
    # EP rank 1's first local expert is global expert `per`: [gate; up] fused.
    fc1 = shards[min(1, ep - 1)]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    first = per if ep > 1 else 0
    assert torch.equal(
        fc1, torch.cat([hf[f"model.layers.0.mlp.experts.{first}.{x}_proj.weight"] for x in ("gate", "up")])
    )
    back = dict(to_hf(lambda n: [shards[0][n]], args, Shard(ep_size=ep, num_layers=args.num_layers),
                      ep_shards=lambda n: [s[n] for s in shards]))  # fmt: skip
    assert list(back) == hf_names(args)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_two_expert_parallel_ranks_train_as_one(moe_dir: Path, tmp_path: Path) -> None:
    """Two gloo ranks (two data-parallel replicas of differently shaped micro-batches), routing replay on: with
    expert_parallel_size 2 each rank holds 4 of the 8 experts and tokens travel to them and back; the log-probs,
    the step's metrics and the exported weights after one step equal expert_parallel_size 1's (fp32)."""
    out = tmp_path / "ranks"
    wait(launch(moe_dir, out, 2, script="megatron_moe_ranks.py"))
    one, two = (json.loads((out / f"ep{ep}.json").read_text()) for ep in (1, 2))
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "moe/aux_loss", "moe/expert_load_cv", "moe/route_agreement"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    lp1, lp2 = (load_file(out / f"ep{ep}.safetensors")["logprobs"] for ep in (1, 2))
    torch.testing.assert_close(lp2, lp1, **FP32)
    after1, after2 = (load_file(out / f"ep{ep}_export" / "model.safetensors") for ep in (1, 2))
    assert_close(after2, after1, "EP=2 export after one step", STEPS)
    before = load_file(moe_dir / "model.safetensors")
    assert sum(not torch.equal(after1[n], before[n]) for n in before) > len(before) // 2  # the step moved them


def test_expert_parallel_sizes_that_do_not_fit_are_refused_with_the_rule(moe_dir: Path) -> None:
    with pytest.raises(ValueError, match="expert_parallel_size must be >= 1"):
        TrainConfig(backend="megatron", expert_parallel_size=0)
    with pytest.raises(ValueError, match="expert_parallel_size: 2 is not implemented by backend: torch"):
        TrainConfig(expert_parallel_size=2, num_ranks=2)
    with pytest.raises(ValueError, match=r"expert_parallel_size \(4\) must divide the data-parallel size, num_ranks "
                       r"/ \(tensor_parallel_size x pipeline_parallel_size\) \(2\)"):  # fmt: skip
        TrainConfig(backend="megatron", expert_parallel_size=4, num_ranks=2)
    moe = ModelArgs.from_dir(moe_dir)
    with pytest.raises(ValueError, match=r"expert_parallel_size \(3\) must divide the model's num_experts \(8\)"):
        check_parallel_sizes(moe, 1, 1, 3)
    with pytest.raises(ValueError, match="with tensor_parallel_size 1 and pipeline_parallel_size 1"):
        check_parallel_sizes(moe, 2, 1, 1)
    dense = ModelArgs(vocab_size=99, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8)  # fmt: skip
    with pytest.raises(ValueError, match="expert_parallel_size: 2 needs a mixture-of-experts model, but this one is "
                       "dense"):  # fmt: skip
        check_parallel_sizes(dense, 1, 1, 2)
