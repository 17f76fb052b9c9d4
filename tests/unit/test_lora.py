"""LoRA (`converters: [lora]`, `train.lora`): the config refuses bad input with the fix, the base stays frozen and
out of the optimizer, the KL reference is the model with its adapters off, and the trainer's batch-invariant
log-probs are those of the merged weights the engine serves."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from hpcrl.config import ConfigError, from_dict
from hpcrl.model import invariant
from hpcrl.model.hf import load_model
from hpcrl.model.lora import merged_weight
from hpcrl.model.qwen3 import ModelArgs
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import LoRAConfig, TrainConfig
from hpcrl.trainer.memory_plan import plan_memory
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.support import free_port

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_cfg(**lora: object) -> dict:
    return {"converters": ("lora",), "lora": LoRAConfig(**{"rank": 4, "alpha": 8.0, **lora})}  # type: ignore[arg-type]


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


# ----- the config -----


@pytest.mark.parametrize(
    "cfg,message",
    [
        ({"lora": LoRAConfig()}, r"set both converters: \[lora\] and lora"),
        ({"converters": ("lora",)}, r"set both converters: \[lora\] and lora"),
        ({**lora_cfg(), "backend": "megatron"}, "lora is not implemented by backend: megatron.*use backend: torch"),
        ({**lora_cfg(dropout=0.1), "logprobs": "invariant"}, "set lora.dropout: 0, or logprobs: plain"),
    ],
)
def test_bad_lora_settings_are_refused_with_the_fix(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**cfg)


def test_the_lora_section_is_checked_on_load() -> None:
    cfg = from_dict(
        TrainConfig, {"converters": ["lora"], "lora": {"rank": 16, "alpha": 32, "target_modules": "all-linear"}}
    )
    assert cfg.lora == LoRAConfig(rank=16, alpha=32.0, target_modules=("all-linear",)) and cfg.lora.scaling == 2.0
    listed = from_dict(LoRAConfig, {"target_modules": ["q_proj", "v_proj"]})
    assert listed.targets == ("q_proj", "v_proj")
    with pytest.raises(ConfigError, match="rank.*alpha.*dropout.*target_modules"):
        from_dict(LoRAConfig, {"rnak": 8})
    for bad, message in [
        ({"rank": 0}, "lora.rank must be >= 1"),
        ({"rank": -4}, "lora.rank must be >= 1"),
        ({"alpha": 0}, "lora.alpha must be > 0"),
        ({"dropout": 1.0}, r"lora.dropout must be in \[0, 1\)"),
        ({"target_modules": []}, "must name linear layers"),
        ({"target_modules": ["all-linear", "q_proj"]}, "give it alone"),
    ]:
        with pytest.raises((ValueError, ConfigError), match=message):
            from_dict(LoRAConfig, bad)


def test_a_target_the_model_lacks_is_refused_listing_the_ones_it_has(tiny_model_dir: Path) -> None:
    with pytest.raises(
        ValueError,
        match="no linear layer 'qkv_proj'; each of its decoder layers has q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj",
    ):
        TorchTrainer(TrainConfig(**lora_cfg(target_modules=("q_proj", "qkv_proj"))), tiny_model_dir)


# ----- one rank -----


def test_only_the_adapters_train_and_the_reference_is_the_model_with_them_off(tiny_model_dir: Path) -> None:
    vocab = ModelArgs.from_dir(tiny_model_dir).vocab_size
    trainer = TorchTrainer(
        TrainConfig(lr=1e-2, global_batch_size=4, kl_coef=0.1, **lora_cfg(target_modules=ATTN)), tiny_model_dir
    )
    assert trainer.ref_model is None  # no second copy of the model
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {names[id(p)].rsplit(".", 2)[-2] for p in held} == {"lora_A", "lora_B"}
    num_layers = trainer.model.args.num_layers
    assert len(held) == 2 * len(ATTN) * num_layers
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    scored = batch(vocab)
    ref_before = trainer.score(scored, reference=True)

    metrics = trainer.train_grpo(batch(vocab))
    assert metrics["num_optimizer_steps"] == 2 and metrics["nan_skipped"] == 0 and metrics["kl"] >= 0
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]) != ("lora_" in name), name  # the base bitwise as loaded; adapters moved
    # Adam's two moments for the adapters alone: 2 x 4 bytes per adapter parameter, nothing for the base.
    adapter_numel = sum(p.numel() for p in held)
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in trainer.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    assert state_bytes == 2 * 4 * adapter_numel and adapter_numel < 0.2 * sum(t.numel() for t in base.values())
    # The start-up memory plan (and its fit check) counts gradients and AdamW state for the adapters alone.
    plan = plan_memory(trainer.cfg, ModelArgs.from_dir(tiny_model_dir))
    assert plan.gradient_bytes == 4 * adapter_numel and plan.optimizer_bytes == state_bytes

    # The reference is the model as loaded, with the adapters off; the policy has moved away from it.
    plain = TorchTrainer(TrainConfig(), tiny_model_dir)
    assert torch.equal(trainer.score(scored, reference=True), ref_before)
    assert torch.equal(ref_before, plain.score(scored, reference=False))
    assert not torch.equal(trainer.score(scored, reference=False), ref_before)


def test_the_invariant_trainer_scores_with_the_merged_weights_the_engine_serves(tiny_model_dir: Path) -> None:
    vocab = ModelArgs.from_dir(tiny_model_dir).vocab_size
    trainer = TorchTrainer(TrainConfig(lr=1e-2, logprobs="invariant", **lora_cfg()), tiny_model_dir)
    trainer.train_grpo(batch(vocab))
    pushed = dict(trainer.push_weights())
    assert all(n.endswith((".lora_A", ".lora_B")) for n in pushed)

    # What the engine serves: the base it loaded, each adapted weight merged once from the pushed adapter.
    served = load_model(tiny_model_dir)
    params = dict(served.named_parameters())
    with torch.no_grad():
        for name, a in pushed.items():
            if name.endswith(".lora_A"):
                weight = name.removesuffix(".lora_A")
                params[weight].copy_(merged_weight(params[weight], a, pushed[weight + ".lora_B"]))
    exported = dict(trainer.export_weights())
    assert all(torch.equal(exported[n], p) for n, p in served.state_dict().items())
    scored = batch(vocab, seed=3)
    with torch.no_grad():
        assert torch.equal(invariant.token_logprobs(served, scored.input_ids), trainer.score(scored, reference=False))


# ----- DDP over two gloo ranks -----


def _ddp_rank(rank: int, model_dir: str, out: str, port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = TorchTrainer(TrainConfig(lr=1e-2, **lora_cfg()), model_dir, rank=rank, world_size=2)
        metrics = trainer.train_grpo(batch(ModelArgs.from_dir(model_dir).vocab_size))
        pushed = {k: v.contiguous() for k, v in trainer.push_weights()}
        pushed["metrics"] = torch.tensor([metrics["loss"], metrics["grad_norm"]], dtype=torch.float64)
        save_file(pushed, f"{out}/rank{rank}.safetensors")
    finally:
        dist.destroy_process_group()


def test_two_ddp_ranks_train_the_adapters_as_one_rank_does(tiny_model_dir: Path, tmp_path: Path) -> None:
    torch.multiprocessing.start_processes(
        _ddp_rank, args=(str(tiny_model_dir), str(tmp_path), free_port()), nprocs=2, start_method="spawn"
    )
    one = TorchTrainer(TrainConfig(lr=1e-2, **lora_cfg()), tiny_model_dir)
    metrics = one.train_grpo(batch(ModelArgs.from_dir(tiny_model_dir).vocab_size))
    expected = dict(one.push_weights())
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    for got in ranks:
        loss, grad_norm = got.pop("metrics").tolist()
        assert loss == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)
        assert grad_norm == pytest.approx(metrics["grad_norm"], rel=1e-4)
        assert set(got) == set(expected)
        for name, tensor in got.items():  # one Adam step of lr 1e-2: float noise moves a value by at most ~2 lr
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=3e-2)
    assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in ranks[0])  # the replicas stay identical


# ----- checkpoints and the export -----


def test_a_checkpoint_holds_the_adapters_and_refuses_another_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    vocab = ModelArgs.from_dir(tiny_model_dir).vocab_size
    cfg = TrainConfig(lr=1e-2, **lora_cfg(target_modules=ATTN))
    run = TorchTrainer(cfg, tiny_model_dir)
    run.train_grpo(batch(vocab))
    tensors, state = run.state()
    model_keys = {k for k in tensors if k.startswith("model/")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert sum(t.numel() for k, t in tensors.items() if k in model_keys) == sum(
        p.numel() for p in run.model.parameters() if p.requires_grad
    )
    assert len(state["converters"]["lora"]["base_sha256"]) == 64
    resumed = TorchTrainer(cfg, tiny_model_dir)
    resumed.load_state(tensors, state)
    a, b = run.train_grpo(batch(vocab, seed=1)), resumed.train_grpo(batch(vocab, seed=1))
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]

    # The same architecture with one weight changed is another base: its adapters would not mean the same.
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="trained on another base model.*Resume with the model.path"):
        TorchTrainer(cfg, other).load_state(tensors, state)
    with pytest.raises(ValueError, match="rank 4 and alpha 8.0, this run asks for rank 8"):
        TorchTrainer(TrainConfig(**lora_cfg(rank=8, target_modules=ATTN)), tiny_model_dir).load_state(tensors, state)
    with pytest.raises(ValueError, match=r"written with the model converters \['lora'\]"):
        TorchTrainer(TrainConfig(), tiny_model_dir).load_state(tensors, state)
    full_tensors, full_state = TorchTrainer(TrainConfig(), tiny_model_dir).state()
    with pytest.raises(ValueError, match="written by a run without LoRA"):
        TorchTrainer(cfg, tiny_model_dir).load_state(full_tensors, full_state)


def test_the_export_is_a_peft_adapter_that_gives_the_trainers_logprobs(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    vocab = ModelArgs.from_dir(tiny_model_dir).vocab_size
    trainer = TorchTrainer(
        TrainConfig(lr=5e-2, **lora_cfg(target_modules=("q_proj", "o_proj", "up_proj"))), tiny_model_dir
    )
    for seed in range(2):
        trainer.train_grpo(batch(vocab, seed=seed))
    out = trainer.export(tmp_path / "model")
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "o_proj", "up_proj"] and config["r"] == 4
    assert config["base_model_name_or_path"] == str(tiny_model_dir)

    scored = batch(vocab, seed=5)
    mine = trainer.score(scored, reference=False)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for model in (peft_model, merged):
        with torch.no_grad():
            logits = model(input_ids=scored.input_ids).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, scored.input_ids[:, 1:, None])[..., 0]
        mask = scored.loss_mask
        assert torch.allclose(lp[mask], mine[mask], atol=2e-5, rtol=0), (lp - mine).abs()[mask].max()
    # The adapters moved the policy: the base alone does not give these log-probs.
    with torch.no_grad():
        plain = peft_model.get_base_model()
        with peft_model.disable_adapter():
            logits = plain(input_ids=scored.input_ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, scored.input_ids[:, 1:, None])[..., 0]
    assert (lp - mine).abs().max() > 1e-3


# ----- FSDP2 over two gloo ranks -----


def _fsdp2_rank(rank: int, model_dir: str, out: str, port: int) -> None:
    from hpcrl.trainer.sharded_state import gather_full

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        vocab = ModelArgs.from_dir(model_dir).vocab_size
        cfg = TrainConfig(lr=1e-2, parallelism="fsdp2", num_ranks=2, **lora_cfg())
        trainer = TorchTrainer(cfg, model_dir, rank=rank, world_size=2)
        metrics = trainer.train_grpo(batch(vocab))
        grads = {f"grad/{n}": gather_full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
        pushed = {k: v.contiguous() for k, v in trainer.push_weights()}
        merged = {f"merged/{k}": v.contiguous() for k, v in trainer.push_weights(full=True)}  # what SGLang gets
        trainer.export(Path(out) / "export") if rank == 0 else trainer.export_weights()  # rank 0 writes
        tensors, state = trainer.state()
        # The checkpoint resumes on two fresh FSDP2 ranks: the next step is the same, bit for bit.
        resumed = TorchTrainer(cfg, model_dir, rank=rank, world_size=2)
        shared = [tensors, state]  # whole tensors on rank 0 alone: each rank cuts its shard from them
        dist.broadcast_object_list(shared, src=0)
        resumed.load_state(*shared)
        after = [t.train_grpo(batch(vocab, seed=1)) for t in (trainer, resumed)]
        if rank == 0:
            save_file(pushed | grads | merged, f"{out}/pushed.safetensors")
            save_file({k: v.contiguous() for k, v in tensors.items()}, f"{out}/ckpt.safetensors")
            (Path(out) / "metrics.json").write_text(json.dumps({"step": metrics, "after": after, "state": state}))
    finally:
        dist.destroy_process_group()


def test_two_fsdp2_ranks_train_the_adapters_as_ddp_does(tiny_model_dir: Path, tmp_path: Path) -> None:
    torch.multiprocessing.start_processes(
        _fsdp2_rank, args=(str(tiny_model_dir), str(tmp_path), free_port()), nprocs=2, start_method="spawn"
    )
    one = TorchTrainer(TrainConfig(lr=1e-2, **lora_cfg()), tiny_model_dir)
    metrics = one.train_grpo(batch(ModelArgs.from_dir(tiny_model_dir).vocab_size))
    grads = {f"grad/{n}": p.grad for n, p in one.model.named_parameters() if p.grad is not None}
    expected = dict(one.push_weights())
    got = load_file(str(tmp_path / "pushed.safetensors"))
    merged = {k.removeprefix("merged/"): got.pop(k) for k in list(got) if k.startswith("merged/")}
    assert set(merged) == {k for k, _ in one.push_weights(full=True)}  # the whole model, merged
    for name, tensor in one.push_weights(full=True):
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-3)
    one_dir = one.export(tmp_path / "one_export")
    exported = load_file(str(tmp_path / "export" / "adapter" / "adapter_model.safetensors"))
    for name, tensor in load_file(str(one_dir / "adapter" / "adapter_model.safetensors")).items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=3e-2)
    sharded = json.loads((tmp_path / "metrics.json").read_text())
    assert sharded["step"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)
    assert sharded["step"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    # Only the adapters train (their gradients are DDP's) and only they are pushed.
    assert set(got) == set(expected) | set(grads)
    assert all(".lora_A" in k or ".lora_B" in k for k in got)
    for name in grads:
        torch.testing.assert_close(got[name], grads[name], rtol=1e-4, atol=1e-6)
    for name in expected:  # one Adam step of lr 1e-2: float noise in a gradient near 0 moves its value by ~2 lr
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=3e-2)
    # The checkpoint: the adapters (whole, as DDP's) and their AdamW state, the base by its hash.
    ckpt = load_file(str(tmp_path / "ckpt.safetensors"))
    model_keys = {k for k in ckpt if k.startswith("model/")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert all(k.startswith(("model/", "optimizer/")) for k in ckpt)
    assert sharded["state"]["converters"]["lora"]["base_sha256"] == one.state()[1]["converters"]["lora"]["base_sha256"]
    after, resumed = sharded["after"]
    assert (after["loss"], after["grad_norm"]) == (resumed["loss"], resumed["grad_norm"])
