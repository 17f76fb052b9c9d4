"""An 8-bit (float8 e4m3) K/V cache: what the torch side writes and reads, and who may ask for one.

The decode step that reads 8-bit K/V is fused Triton code, run on the GPU machine (tests/gpu/test_engine_cuda.py);
here: the prefill and masked-attention writes the CUDA engine also runs (plain torch), the
copies between slots, and every refusal, each before a model loads.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.config import load_yaml
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.embedded.launch import embedded_launch
from hpcrl.engine.launch import LaunchSlot
from hpcrl.engine.sglang import sglang_command
from hpcrl.model.hf import load_model
from hpcrl.model.qwen3 import KVCache, to_cache_dtype

FP8 = torch.float8_e4m3fn


def _decode_logprobs(model_dir: Path, cache_dtype: torch.dtype, steps: int = 12) -> tuple[torch.Tensor, KVCache]:
    """Prefill 3 prompts, then decode `steps` greedy tokens one at a time through the cache; log-probs [steps, 3, V]."""
    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    cache = KVCache.allocate(model.args, 4, 64, cache_dtype, torch.device("cpu"))
    ids = torch.tensor([[1, 20, 21, 14, 22, 32], [5, 6, 7, 8, 9, 10], [3, 3, 4, 4, 5, 5]])
    out = []
    with torch.inference_mode():
        logits = model.forward_cached(ids, cache, 0, torch.zeros(3, dtype=torch.long), torch.full((3,), 5),
                                      from_start=True)  # fmt: skip
        for step in range(steps):
            out.append(torch.log_softmax(logits.float(), -1))
            nxt = logits.argmax(-1, keepdim=True)
            start = torch.full((3,), 6 + step)
            logits = model.forward_cached(nxt, cache, 0, start, torch.zeros(3, dtype=torch.long))
    return torch.stack(out), cache


def test_an_fp8_cache_holds_a_quarter_of_the_bytes_and_decodes_close_to_the_full_cache(tiny_model_dir: Path) -> None:
    full, full_cache = _decode_logprobs(tiny_model_dir, torch.float32)
    fp8, fp8_cache = _decode_logprobs(tiny_model_dir, FP8)
    assert fp8_cache.nbytes() * 4 == full_cache.nbytes()
    assert fp8_cache.k[0].dtype == FP8
    diff = (fp8 - full).abs()
    # The same greedy tokens, log-probs off by the rounding of 3 mantissa bits, not by garbage.
    assert torch.equal(fp8.argmax(-1), full.argmax(-1))
    assert 0 < diff.max().item() < 0.05, diff.max().item()
    # The written entries are the full cache's, rounded: every one within e4m3's half-step (2^-4 relative).
    written = full_cache.k[0][:3, :, :17]
    err = (fp8_cache.k[0][:3, :, :17].float() - written).abs()
    assert (err <= written.abs() * 2**-4 + 2**-9).all()


def test_values_past_e4m3s_range_saturate_instead_of_turning_nan() -> None:
    x = torch.tensor([1000.0, -1000.0, 3.0, float("nan")])
    y = to_cache_dtype(x, FP8).float()
    assert y[:3].tolist() == [448.0, -448.0, 3.0]
    assert torch.isnan(y[3])  # a NaN stays a NaN: the engine's NaN checks must still see it
    assert to_cache_dtype(x, torch.float32) is x


def test_samples_of_one_prompt_get_an_exact_copy_of_its_8bit_prefix(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"))
    cache = KVCache.allocate(model.args, 4, 16, FP8, torch.device("cpu"))
    cache.buffer.view(torch.uint8).random_(0, 120)  # finite e4m3 bit patterns
    cache.copy_prefix([0, 0], [2, 3], 9)
    bits = cache.buffer.view(torch.uint8)
    assert torch.equal(bits[:, :, 2, :, :9], bits[:, :, 0, :, :9])
    assert torch.equal(bits[:, :, 3, :, :9], bits[:, :, 0, :, :9])
    assert not torch.equal(bits[:, :, 2, :, 9:], bits[:, :, 0, :, 9:])  # only the prefix moved


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"device": "cpu", "dtype": "float32"}, "needs a CUDA device"),
        ({"device": "cuda", "dtype": "float32"}, "needs dtype bfloat16 or float16"),
        ({"device": "cuda", "dtype": "bfloat16", "batch_invariant": True}, "cannot go with batch_invariant"),
        ({"device": "cuda", "dtype": "bfloat16", "decode_mode": "eager"}, "needs decode_mode auto, graph or triton"),
    ],
)
def test_the_run_config_refuses_an_fp8_cache_the_embedded_engine_cannot_read(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        EngineConfig(kind="embedded", kv_cache_dtype="fp8_e4m3", **settings)
    assert "kv_cache_dtype: auto" in str(err.value)


def test_engines_are_launched_with_the_cache_dtype(tmp_path: Path) -> None:
    slot = LaunchSlot(index=0, position=0, model_dir="/m", host="127.0.0.1", port=30001, api_key="k", seed=0,
                      run_dir=tmp_path)  # fmt: skip
    fp8 = EngineConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    embedded = embedded_launch(fp8, slot).cmd
    assert load_yaml(embedded[embedded.index("--config") + 1])["kv_cache_dtype"] == "fp8_e4m3"
    sglang = sglang_command(
        EngineConfig(kind="sglang", device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3"), python="python3",
        model_dir="/m", host="127.0.0.1", port=30001, config_file=tmp_path / "c.yaml", seed=0, weight_version="0",
    )  # fmt: skip
    assert sglang[sglang.index("--kv-cache-dtype") + 1] == "fp8_e4m3"


def test_engine_serve_refuses_an_fp8_cache_on_the_cpu_before_loading_anything(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(tmp_path / "absent"),
         "--kv-cache-dtype", "fp8_e4m3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "kv_cache_dtype: fp8_e4m3 needs a CUDA device" in proc.stderr
    assert "use kv_cache_dtype: auto" in proc.stderr and "--kv-cache-dtype fp8_e4m3" in proc.stderr
