"""Sliding-window and scaled-RoPE models served by the embedded engine: what it generates is scored as transformers
scores it, past the window and past the original context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.conftest import start_engine
from tests.unit.test_model_configs import _hf_model

transformers = pytest.importorskip("transformers")

WINDOW = 8
CONFIGS = {
    "mistral-window-8": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
}
# RoPE scaled past an original context of 16 positions: every sequence below runs past it.
ROPE_CONFIGS = {
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen3-yarn": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 16}}),
}  # fmt: skip
# A prompt longer than the window (its prefill must window) and a short one whose decode crosses the window.
PROMPTS = [[3, 17, 29, 41, 5, 8, 13, 21, 34, 55, 2, 9, 60], [7, 11, 19]]
NEW_TOKENS = 24


def engine_vs_transformers(kind: str, overrides: dict[str, Any], tmp_path: Path, *flags: str) -> tuple[float, str]:
    """The largest |engine log-prob - transformers' log-prob| (fp32) over the tokens the engine generated, and the
    engine's log."""
    from hpcrl.model.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    reference, path = _hf_model(kind, tmp_path, vocab_size=len(tokenizer), **overrides)
    tokenizer.save_pretrained(path)
    engine = start_engine(path, tmp_path, "--dtype", "float32", *flags, timeout_s=120.0)
    try:
        body = {
            "input_ids": PROMPTS,
            "sampling_params": [{"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "sampling_seed": s} for s in (1, 2)],
            "return_logprob": True,
        }
        r = httpx.post(engine.url + "/generate", json=body, timeout=120.0)
        assert r.status_code == 200, r.text + engine.log()
        outs = r.json()
    finally:
        engine.stop()
    log = engine.log()
    # The same weights without the setting (no window, plain RoPE): it must move these log-probs, or the test
    # proves nothing.
    full, _ = _hf_model(kind, tmp_path / "plain", vocab_size=len(tokenizer))
    full.load_state_dict(reference.state_dict())
    gap = effect = 0.0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert len(out["output_ids"]) == NEW_TOKENS
        ids = torch.tensor(prompt + out["output_ids"])
        got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        want, without = (_logprobs(m, ids, len(prompt)) for m in (reference, full))
        gap = max(gap, float((got - want).abs().max()))
        effect = max(effect, float((without - want).abs().max()))
    assert effect > 1e-3, f"the setting changed transformers' log-probs by only {effect}"
    return gap, log


def _logprobs(model: Any, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids[None]).logits[0, prompt_len - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[prompt_len:, None])[:, 0]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("mode", ["eager", "compile", "invariant"])
def test_engine_logprobs_equal_transformers_past_the_window(
    config: str, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind, overrides = CONFIGS[config]
    if mode == "compile":
        # The compile mode's step function as written, without minutes of inductor on a shared CPU: the window is
        # in its math, which torch.compile keeps.
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    flags = ("--batch-invariant",) if mode == "invariant" else ("--decode-mode", mode)
    gap, log = engine_vs_transformers(kind, overrides, tmp_path, *flags)
    if mode == "compile":
        assert "compiled the CPU decode step" in log and "step failed" not in log, log  # no fallback to eager
    print(f"{config} {mode}: max |engine - transformers| log-prob = {gap:.2e}")
    assert gap <= 1e-4, f"{config} ({mode}): the engine's log-probs differ from transformers' by {gap}"


@pytest.mark.parametrize("config", list(ROPE_CONFIGS))
@pytest.mark.parametrize("mode", ["eager", "invariant"])
def test_engine_logprobs_equal_transformers_past_the_original_context(config: str, mode: str, tmp_path: Path) -> None:
    # The engine's decode step reads its own cos/sin tables: they must carry the model's RoPE scaling.
    kind, overrides = ROPE_CONFIGS[config]
    flags = ("--batch-invariant",) if mode == "invariant" else ("--decode-mode", mode)
    gap, _ = engine_vs_transformers(kind, overrides, tmp_path, *flags)
    print(f"{config} {mode}: max |engine - transformers| log-prob = {gap:.2e}")
    assert gap <= 1e-4, f"{config} ({mode}): the engine's log-probs differ from transformers' by {gap}"
