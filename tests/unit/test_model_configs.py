"""Model configs against transformers: every field that changes the function is computed as transformers computes
it (log-probs within 1e-4 in fp32 on sequences longer than the window / the original context) or refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcrl.model.hf import load_model
from hpcrl.model.qwen3 import ModelArgs

transformers = pytest.importorskip("transformers")

SEQ_LEN = 48
DIMS = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip


def _hf_model(kind: str, tmp_path: Path, **overrides: Any) -> tuple[Any, Path]:
    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[kind]
    torch.manual_seed(0)
    config = config_cls(**{**DIMS, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # larger weights than the initialiser's, so positions and windows move the log-probs
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    out = tmp_path / kind
    model.save_pretrained(out)
    return model, out


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


def _max_gap(kind: str, tmp_path: Path, **overrides: Any) -> tuple[float, float]:
    """(max |hpcrl - transformers| log-prob, max |transformers with the setting - without it|)."""
    reference, path = _hf_model(kind, tmp_path, **overrides)
    ids = torch.randint(0, DIMS["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    ours = load_model(path, dtype=torch.float32, device=torch.device("cpu")).eval()
    with torch.no_grad():
        want = _logprobs(reference(ids).logits, ids)
        got = _logprobs(ours(ids), ids)
        plain_cfg = json.loads((path / "config.json").read_text())
        for key in ("sliding_window", "rope_scaling", "rope_parameters", "layer_types", "use_sliding_window"):
            plain_cfg.pop(key, None)
        plain = transformers.AutoModelForCausalLM.from_config(
            type(reference.config).from_dict(plain_cfg), attn_implementation="eager"
        ).float()
        plain.load_state_dict(reference.state_dict())
        baseline = _logprobs(plain.eval()(ids).logits, ids)
    return float((got - want).abs().max()), float((baseline - want).abs().max())


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("mistral", {"sliding_window": 8}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    ],
    ids=["mistral-window-8", "qwen2-sliding", "qwen3-sliding", "llama3-rope", "qwen3-yarn"],
)  # fmt: skip
def test_setting_computed_equal_to_transformers(kind: str, overrides: dict[str, Any], tmp_path: Path) -> None:
    gap, effect = _max_gap(kind, tmp_path, **overrides)
    assert gap <= 1e-4, f"hpcrl and transformers differ by {gap} with {overrides}"
    # The setting matters on these sequences: ignoring it would have been caught.
    assert effect > 1e-3, f"the setting {overrides} changed transformers' log-probs by only {effect}"


def _refusal(cfg_overrides: dict[str, Any], model_type: str = "llama") -> str:
    cfg = {"model_type": model_type, **DIMS, **cfg_overrides}
    with pytest.raises(ValueError) as info:
        ModelArgs.from_hf_config(cfg)
    return str(info.value)


def test_uncomputed_fields_are_refused_by_name() -> None:
    assert "hidden_act 'gelu_pytorch_tanh'" in _refusal({"hidden_act": "gelu_pytorch_tanh"})
    assert "o_proj" in _refusal({"attention_bias": True})
    assert "mlp_bias" in _refusal({"mlp_bias": True})
    assert "rope_type 'longrope'" in _refusal({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    assert "partial_rotary_factor" in _refusal({"partial_rotary_factor": 0.5})
    assert "layer_types ['chunked_attention']" in _refusal(
        {"sliding_window": 8, "layer_types": ["chunked_attention"] * 3}, model_type="mistral"
    )
    assert "model_type 'deepseek_v3'" in _refusal({}, model_type="deepseek_v3")


def test_window_reaches_only_the_layers_transformers_windows() -> None:
    cfg = {"model_type": "qwen2", **DIMS, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    assert ModelArgs.from_hf_config(cfg).layer_windows == (None, None, 8)
    cfg["use_sliding_window"] = False
    assert ModelArgs.from_hf_config(cfg).layer_windows == ()


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_cached_forward_windows_as_the_trainer_does(kind: str, tmp_path: Path) -> None:
    """forward_cached (the engine's prefill off the CPU path): a prefill longer than the window, then chunks of
    new tokens on top of the cache, score each token as the trainer's forward of the whole sequence does."""
    from hpcrl.model.qwen3 import KVCache

    overrides = {"sliding_window": 8} if kind == "mistral" else {"use_sliding_window": True, "sliding_window": 8}
    _, path = _hf_model(kind, tmp_path, **overrides)
    model = load_model(path, dtype=torch.float32, device=torch.device("cpu")).eval()
    ids = torch.randint(0, DIMS["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    cache = KVCache.allocate(model.args, 2, SEQ_LEN, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        want = model(ids)
        start = torch.zeros(2, dtype=torch.long)
        got = [model.forward_cached(ids[:, :12], cache, 0, start, torch.tensor([11, 11]), from_start=True)]
        for pos in range(12, SEQ_LEN, 6):
            last = torch.tensor([5, 5])
            got.append(model.forward_cached(ids[:, pos : pos + 6], cache, 0, torch.tensor([pos, pos]), last))
    assert float((torch.stack(got, 1) - want[:, 11::6]).abs().max()) <= 1e-4


def test_the_batch_invariant_forward_scales_rope_as_the_trainer_does(tmp_path: Path) -> None:
    from hpcrl.model import invariant

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    _, path = _hf_model("qwen3", tmp_path, rope_scaling=scaling)
    model = load_model(path, dtype=torch.float32, device=torch.device("cpu")).eval()
    ids = torch.randint(0, DIMS["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        gap = (invariant.logits(model, ids) - model(ids)).abs().max()
    assert float(gap) <= 1e-4


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_the_batch_invariant_forward_windows_as_the_trainer_does(kind: str, tmp_path: Path) -> None:
    """The invariant forward (the trainer's and the engine's prefill) within the window equals the trainer's forward;
    the engine's invariant decode past the window gives the prefill's bits at every position."""
    from hpcrl.model import invariant
    from hpcrl.model.qwen3 import KVCache

    overrides = {"sliding_window": 8} if kind == "mistral" else {"use_sliding_window": True, "sliding_window": 8}
    _, path = _hf_model(kind, tmp_path, **overrides)
    model = load_model(path, dtype=torch.float32, device=torch.device("cpu")).eval()
    assert invariant.unsupported_model(model.args) is None
    ids = torch.randint(0, DIMS["vocab_size"], (3, SEQ_LEN), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = invariant.logits(model, ids)
        assert float((whole - model(ids)).abs().max()) <= 1e-6
        cache = KVCache.allocate(model.args, 3, SEQ_LEN, torch.float32, torch.device("cpu"))
        first = invariant.prefill(model, cache, ids[:, :12], 0, torch.full((3,), 11))
        assert torch.equal(first, whole[:, 11])
        for pos in range(12, SEQ_LEN):
            assert torch.equal(invariant.decode(model, cache, ids[:, pos], torch.full((3,), pos)), whole[:, pos]), pos
