"""Model converters (`train.converters`) and the torch backend's parallelism: what trains, what a push sends,
what an export writes, and DDP over two real gloo ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from hpcrl.model.qwen3 import CausalLM, ModelArgs
from hpcrl.store import load_metrics
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.converters import CONVERTERS
from hpcrl.trainer.converters.base import ModelConverter
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.support import SMALL, free_port, hpcrl

FROZEN = ("model.embed_tokens", "model.layers.0")
FREEZE = {"converters": ("freeze",), "freeze_modules": FROZEN}


def batch(vocab: int, num_samples: int = 8, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts, responses = [ids(2, 6) for _ in range(num_samples)], [ids(2, 7) for _ in range(num_samples)]
    return TrainBatch.from_sequences(
        prompts,
        responses,
        advantages=torch.randn(num_samples, generator=g).tolist(),
        rollout_logprobs=[[-2.0] * len(r) for r in responses],
    )


def base_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def is_frozen(name: str) -> bool:
    return any(name.startswith(m + ".") for m in FROZEN)


# ----- the config -----


@pytest.mark.parametrize(
    "cfg,message",
    [
        ({"converters": ("quant",)}, "unknown model converter .quant.; valid: freeze, lora"),
        ({"freeze_modules": ("lm_head",)}, "set both converters: \\[freeze\\] and freeze_modules"),
        ({"converters": ("freeze",)}, "set both converters: \\[freeze\\] and freeze_modules"),
        ({**FREEZE, "converters": ("freeze", "freeze")}, "lists a converter twice"),
        ({**FREEZE, "backend": "megatron"}, "the megatron backend builds its own.*use backend: torch"),
    ],
)
def test_bad_converter_settings_are_refused_with_the_fix(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**cfg)


def test_a_module_the_model_lacks_is_refused_listing_the_ones_it_has(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"no module 'model.layer.0'; its modules are .*model\.layers\.N\.mlp"):
        TorchTrainer(TrainConfig(converters=("freeze",), freeze_modules=("model.layer.0",)), tiny_model_dir)
    # The tiny model ties its LM head to the embeddings: the message names the module to freeze instead.
    with pytest.raises(ValueError, match="freeze model.embed_tokens, which freezes both"):
        TorchTrainer(TrainConfig(converters=("freeze",), freeze_modules=("lm_head",)), tiny_model_dir)
    with pytest.raises(ValueError, match="freezes every parameter"):
        TorchTrainer(TrainConfig(converters=("freeze",), freeze_modules=("model",)), tiny_model_dir)


# ----- freeze on one rank -----


def test_frozen_modules_leave_the_optimizer_and_the_push_but_not_the_export(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = TorchTrainer(TrainConfig(lr=1e-2, global_batch_size=4, ppo_epochs=2, **FREEZE), tiny_model_dir)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    held = {names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]}
    assert held == {n for n in names.values() if not is_frozen(n)} and held
    metrics = trainer.train_grpo(batch(ModelArgs.from_dir(tiny_model_dir).vocab_size))
    assert metrics["num_optimizer_steps"] == 4 and metrics["nan_skipped"] == 0

    base = base_weights(tiny_model_dir)
    exported = dict(trainer.export_weights())
    assert set(exported) == set(base)
    for name, tensor in exported.items():
        assert torch.equal(tensor, base[name]) == is_frozen(name), name  # frozen: bitwise; trained: moved
    pushed = dict(trainer.push_weights())
    assert set(pushed) == {n for n in base if not is_frozen(n)}
    assert all(torch.equal(pushed[n], exported[n]) for n in pushed)
    # Engines that dropped their weights get every one of them.
    assert {n for n, _ in trainer.push_weights(full=True)} == set(base)

    out = trainer.export(tmp_path / "model")
    written = load_file(str(out / "model.safetensors"))
    assert set(written) == set(base) and all(torch.equal(written[n], exported[n]) for n in base)


def test_a_frozen_run_resumes_and_refuses_a_checkpoint_whose_frozen_weights_moved(tiny_model_dir: Path) -> None:
    vocab = ModelArgs.from_dir(tiny_model_dir).vocab_size
    frozen = TorchTrainer(TrainConfig(lr=1e-2, **FREEZE), tiny_model_dir)
    frozen.train_grpo(batch(vocab))
    tensors, state = frozen.state()
    assert {f"model/{n}" for n in base_weights(tiny_model_dir)} <= set(tensors)  # checkpoints hold the whole model
    resumed = TorchTrainer(TrainConfig(lr=1e-2, **FREEZE), tiny_model_dir)
    resumed.load_state(tensors, state)
    a, b = frozen.train_grpo(batch(vocab, seed=1)), resumed.train_grpo(batch(vocab, seed=1))
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]

    # A run that trained the embeddings cannot resume with them frozen: engines would serve model.path's.
    full = TorchTrainer(TrainConfig(lr=1e-2), tiny_model_dir)
    full.train_grpo(batch(vocab))
    tensors, state = full.state()
    with pytest.raises(ValueError, match=r"checkpoint's model\.embed_tokens\.weight differs from model\.path's"):
        TorchTrainer(TrainConfig(lr=1e-2, **FREEZE), tiny_model_dir).load_state(tensors, state)


# ----- a converter of one's own: one module and one registry line -----


class CountSteps(ModelConverter):
    """Freezes the final norm and counts optimizer steps, as a quantizer re-deriving its scales would."""

    name = "count_steps"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.steps = 0

    def convert(self, model: CausalLM) -> None:
        model.model.norm.requires_grad_(False)

    def post_optimizer_hook(self, model: CausalLM) -> None:
        self.steps += 1

    def push_state(self, model: CausalLM, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in state.items() if k != "model.norm.weight"}


def test_a_registered_converter_is_applied_at_build_and_after_every_optimizer_step(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(CONVERTERS, "count_steps", f"{__name__}:CountSteps")
    cfg = TrainConfig(lr=1e-2, global_batch_size=2, ppo_epochs=2, converters=("count_steps", "freeze"),
                      freeze_modules=("model.embed_tokens",))  # fmt: skip
    trainer = TorchTrainer(cfg, tiny_model_dir)
    counter = trainer.converters[0]
    assert isinstance(counter, CountSteps)
    trainer.train_grpo(batch(ModelArgs.from_dir(tiny_model_dir).vocab_size))
    assert counter.steps == 8
    pushed = {n for n, _ in trainer.push_weights()}
    assert "model.norm.weight" not in pushed and "model.embed_tokens.weight" not in pushed
    assert len(pushed) == len(base_weights(tiny_model_dir)) - 2
    assert not trainer.model.model.norm.weight.requires_grad


# ----- DDP over two gloo ranks -----


def _ddp_rank(rank: int, model_dir: str, out: str, port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = TorchTrainer(TrainConfig(**FREEZE), model_dir, rank=rank, world_size=2)
        metrics = trainer.train_grpo(batch(ModelArgs.from_dir(model_dir).vocab_size))
        weights = dict(trainer.export_weights())
        weights["metrics"] = torch.tensor([metrics["loss"], metrics["grad_norm"]], dtype=torch.float64)
        save_file({k: v.contiguous() for k, v in weights.items()}, f"{out}/rank{rank}.safetensors")
    finally:
        dist.destroy_process_group()


def test_two_ddp_ranks_with_frozen_modules_match_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    torch.multiprocessing.start_processes(
        _ddp_rank, args=(str(tiny_model_dir), str(tmp_path), free_port()), nprocs=2, start_method="spawn"
    )
    one = TorchTrainer(TrainConfig(**FREEZE), tiny_model_dir)
    metrics = one.train_grpo(batch(ModelArgs.from_dir(tiny_model_dir).vocab_size))
    expected = dict(one.export_weights())
    base = base_weights(tiny_model_dir)
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    for got in ranks:
        loss, grad_norm = got.pop("metrics").tolist()
        assert loss == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)
        assert grad_norm == pytest.approx(metrics["grad_norm"], rel=1e-4)
        for name, tensor in got.items():
            if is_frozen(name):
                assert torch.equal(tensor, base[name]), name
            else:  # one Adam step of lr 1e-5: a gradient's float noise moves a weight by at most 2 lr
                torch.testing.assert_close(tensor, expected[name], rtol=0, atol=2e-5)
                assert not torch.equal(tensor, base[name]), name
    assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in ranks[0])  # DDP keeps the replicas identical


# ----- a run -----


def test_a_run_with_a_frozen_layer_pushes_only_what_trains_and_exports_everything(
    workdir: Path, tiny_model_dir: Path
) -> None:
    hpcrl(
        "run", "qs.yaml", *SMALL, "num_steps=3", "train.converters=[freeze]",
        "train.freeze_modules=[model.layers.0]", "--run-dir", "r", cwd=workdir,
    )  # fmt: skip
    m = load_metrics(workdir / "r" / "metrics.h5")
    base = base_weights(tiny_model_dir)
    trained = [n for n in base if not n.startswith("model.layers.0.")]
    assert (m["sync/bytes"] == sum(base[n].numel() * base[n].element_size() for n in trained)).all()
    # The engines serve what the trainer holds after each push: the frozen layer they kept, the rest pushed.
    assert m["train/train_rollout_logprob_abs_diff"].max() < 1e-4
    exported = load_file(str(workdir / "r" / "model" / "model.safetensors"))
    assert set(exported) == set(base)
    assert all(torch.equal(exported[n], base[n]) for n in base if n not in trained)
    assert not torch.equal(exported["model.layers.1.mlp.up_proj.weight"], base["model.layers.1.mlp.up_proj.weight"])
