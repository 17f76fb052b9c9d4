"""train.torch_compile: compiled decoder layers and fused-head chunks train like the eager ones, under the same
parameter names."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_a_grpo_step_compiled_trains_like_the_eager_one(tiny_model_dir: Path) -> None:
    """Same loss, gradient norm and gradients (to rounding: compiled kernels fuse and reorder float ops), the same
    parameter names for pushes and checkpoints, and the layers and both head functions really ran compiled. With
    the fused head and an entropy term, so every branch of the compiled chunk gradient runs."""
    import torch
    import torch._dynamo

    from hpcrl.trainer import logprobs
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.config import TrainConfig
    from hpcrl.trainer.torch_backend import TorchTrainer

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 99, (5,), generator=gen).tolist() for _ in range(4)]
    responses = [torch.randint(3, 99, (3 + i,), generator=gen).tolist() for i in range(4)]
    batch = TrainBatch.from_sequences(prompts, responses, advantages=torch.randn(4, generator=gen).tolist())
    results = {}
    torch._dynamo.reset()
    logprobs._compiled_chunk_fns.clear()
    for compiled in (False, True):
        cfg = TrainConfig(
            lr=1e-3, micro_batch_size=4, entropy_coef=0.01, logprob_chunk_tokens=16, torch_compile=compiled
        )
        trainer = TorchTrainer(cfg, tiny_model_dir)
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        metrics = trainer.train_grpo(batch)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
        grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
        results[compiled] = (metrics, grads, list(trainer.model.state_dict()), graphs)
    (eager, eager_g, eager_names, eager_graphs), (comp, comp_g, comp_names, comp_graphs) = results[False], results[True]
    assert eager_graphs == 0 and comp_graphs >= 3  # a decoder layer, the chunk statistics, the chunk gradient
    assert set(logprobs._compiled_chunk_fns) == {"stats", "grad"}
    assert comp_names == eager_names
    assert comp["loss"] == pytest.approx(eager["loss"], rel=1e-5, abs=1e-7)
    assert comp["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-4) and eager["grad_norm"] > 0
    assert comp_g.keys() == eager_g.keys()
    for name, g in eager_g.items():
        torch.testing.assert_close(comp_g[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_torch_compile_is_refused_where_it_cannot_apply() -> None:
    from hpcrl.trainer.config import TrainConfig

    with pytest.raises(
        ValueError, match="logprobs: invariant needs the trainer's forward to be the engine's batch-invariant"
    ):
        TrainConfig(logprobs="invariant", torch_compile=True)
    # The megatron backend compiles megatron-core's layers (tests/unit/test_megatron.py).
    assert TrainConfig(backend="megatron", torch_compile=True).torch_compile
