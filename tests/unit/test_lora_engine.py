"""A LoRA push through the embedded engine's real HTTP server: only the adapters travel, the engine merges each
version once into the base it kept, and with the batch-invariant forward it samples the trainer's log-probs."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from hpcrl.model.qwen3 import ModelArgs
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import LoRAConfig, TrainConfig
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.unit.test_lora import batch
from tests.unit.test_weight_apply import by_broadcast, by_handover, post, weight

PROMPT = [5, 17, 23, 40, 41]
PARAMS = {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 11}


def engine_logprobs(url: str) -> tuple[list[int], torch.Tensor]:
    out = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": PARAMS, "return_logprob": True}).json()
    return out["output_ids"], torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])


def trainer_logprobs(trainer: TorchTrainer, output_ids: list[int]) -> torch.Tensor:
    mb = TrainBatch.from_sequences([PROMPT], [output_ids], advantages=[0.0], rollout_logprobs=[[0.0] * len(output_ids)])
    return trainer.score(mb.to(trainer.device), reference=False)[0, len(PROMPT) - 1 :]


def test_pushed_adapters_are_merged_once_per_version_and_sampled_on_policy(
    engine_factory, tiny_model_dir: Path
) -> None:
    eng = engine_factory("--batch-invariant")
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    cfg = TrainConfig(lr=5e-2, logprobs="invariant", converters=("lora",), lora=lora)
    trainer = TorchTrainer(cfg, tiny_model_dir)
    vocab = ModelArgs.from_dir(tiny_model_dir).vocab_size
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    loaded = engine_logprobs(eng.url)
    q = "model.layers.0.self_attn.q_proj.weight"

    for version, send in enumerate((by_handover, by_broadcast), start=1):
        trainer.train_grpo(batch(vocab, seed=version))
        pushed = trainer.push_weights()
        assert {n.rsplit(".", 1)[-1] for n, _ in pushed} == {"lora_A", "lora_B"}
        full_bytes = sum(t.numel() * t.element_size() for t in base.values())
        assert sum(t.numel() * t.element_size() for _, t in pushed) < 0.1 * full_bytes
        # Split between two updates: a weight's A and B may arrive in different buckets of one push.
        for part in (pushed[:3], pushed[3:]):
            r = send(eng.url, part, apply_strategy="lora")
            assert r.json()["success"], r.text
        for name, layer in trainer.converters[0].layers.items():  # type: ignore[attr-defined]
            w = f"{name}.weight"
            expected = base[w] + (layer.lora_B.weight.detach() * lora.scaling) @ layer.lora_A.weight.detach()
            assert weight(eng.url, w) == expected.flatten().tolist(), (version, w)  # from the kept base, bit for bit
        assert (
            weight(eng.url, "model.layers.0.self_attn.k_proj.weight")
            == base["model.layers.0.self_attn.k_proj.weight"].flatten().tolist()
        )
        output_ids, engine_lps = engine_logprobs(eng.url)
        assert output_ids != loaded[0] or not torch.equal(engine_lps, loaded[1])
        assert torch.equal(engine_lps, trainer_logprobs(trainer, output_ids))  # the gap is exactly 0.0

    # Refused before anything is written: a tensor that is no adapter, an adapter of the wrong shape.
    before = weight(eng.url, q)
    r = by_handover(eng.url, [("model.norm.weight", base["model.norm.weight"])], apply_strategy="lora")
    assert r.status_code == 400 and "is not an adapter" in r.json()["message"]
    bad = [(f"{q}.lora_A", torch.zeros(4, 3)), (f"{q}.lora_B", torch.zeros(base[q].shape[0], 4))]
    r = by_handover(eng.url, bad, apply_strategy="lora")
    assert r.status_code == 400 and "needs A [r, " in r.json()["message"]
    assert weight(eng.url, q) == before
    assert httpx.get(eng.url + "/health", timeout=10).status_code == 200
