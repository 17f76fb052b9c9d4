"""The fused decode kernels against the eager model they replace.

Runs on CUDA; without a GPU it runs under Triton's interpreter when TRITON_INTERPRET=1 (slow, fp32
only), and is skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hpcrl.engine.embedded.kernels import attention, gemm, launch, norms, sampler
from hpcrl.engine.embedded.sampling import RowParams, counter_uniform, sample
from hpcrl.engine.kernels_config import KernelsConfig
from hpcrl.model.qwen3 import CausalLM, KVCache, ModelArgs, rope_cos_sin
from tests.gpu.triton_support import DEVICE, DTYPES, needs_triton

pytestmark = needs_triton


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tiny_args(vocab: int = 300, head_dim: int = 32, *, llama: bool = False) -> ModelArgs:
    return ModelArgs(
        qk_norm=not llama,
        attention_bias=llama,  # Qwen2-style biases, with Llama's missing QK-norm: both branches of the kernels
        vocab_size=vocab,
        hidden_size=96,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        eos_token_ids=(2,),
    )


def random_model(args: ModelArgs, dtype: torch.dtype) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    return model.to(DEVICE, dtype).eval()


def test_uniform_kernel_has_the_reference_bits() -> None:
    seeds = torch.tensor([0, 1, 2**40 + 7, 12345678901], dtype=torch.int64, device=DEVICE)
    steps = torch.tensor([0, 5, 1000, 3], dtype=torch.int64, device=DEVICE)
    ref = counter_uniform(seeds.cpu(), steps.cpu(), 3000)  # the torch int64 implementation
    got = sampler.counter_uniform(seeds, steps, 3000).cpu()
    assert torch.equal(got, ref)


def full_vocab_params(temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> RowParams:
    """Sampling over the whole vocabulary (no top-k/top-p/min-p), the case the fused sampler takes."""
    n = temperature.shape[0]
    return RowParams(
        temperature=temperature,
        top_k=torch.full((n,), -1, device=DEVICE),
        top_p=torch.ones(n, device=DEVICE),
        min_p=torch.zeros(n, device=DEVICE),
        seeds=seeds,
        steps=steps,
    )


# 5,000 and 20,000 ids: two and five chunks of sampling.SAMPLE_CHUNK_IDS (a last one partly past the vocabulary).
# A config of four values also sets the draw's block: one smaller than the chunk loops over it, one larger is cut.
SAMPLE_CASES = [
    (99, None), (5000, (1024, 4)), (5000, (4096, 8, 8192, 8)), (5000, (512, 2)), (20000, (256, 4, 256, 2)),
]  # fmt: skip


@pytest.mark.parametrize("vocab,config", SAMPLE_CASES)
def test_sample_kernel_matches_torch_sampler(vocab: int, config: tuple[int, ...] | None) -> None:
    torch.manual_seed(1)
    n = 16
    logits = (torch.randn(n, vocab, device=DEVICE) * 3).to(torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3] * 4, device=DEVICE)
    seeds = torch.arange(n, dtype=torch.int64, device=DEVICE) * 7919 + 3
    steps = torch.arange(n, dtype=torch.int64, device=DEVICE) % 5
    p = full_vocab_params(temperature, seeds, steps)
    ref = sample(logits, p, want_support=False)
    tok = torch.empty(n, dtype=torch.int64, device=DEVICE)
    lp = torch.empty(n, 2, device=DEVICE)
    tokens = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    positions = torch.arange(n, dtype=torch.int64, device=DEVICE)
    steps_after = steps.clone()
    sampler.sample_rows(
        logits, temperature, seeds, steps_after, tok, lp, tokens=tokens, positions=positions, config=config
    )
    assert torch.equal(tok, ref.token_ids)
    assert torch.allclose(lp[:, 0], ref.logprobs, atol=1e-4, rtol=1e-4)
    assert torch.allclose(lp[:, 1], ref.scaled_logprobs, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, tok)
    assert torch.equal(positions, torch.arange(n, device=DEVICE) + 1)
    assert torch.equal(steps_after, steps + 1)


def test_sample_kernel_with_a_masked_vocabulary_matches_torch_sampler() -> None:
    # -inf logits (a vocabulary padded or masked past its real size): the sum-exp skips them without NaN,
    # and no draw lands in a chunk of no mass, also where a whole chunk of the row, or all but one entry, is masked.
    torch.manual_seed(2)
    n, vocab = 8, 13000  # chunks of 4,096 ids: 0-4095, 4096-8191, 8192-12287, 12288-12999
    logits = torch.randn(n, vocab, device=DEVICE) * 3
    logits[:, 10000:] = float("-inf")  # the last of 4 chunks entirely masked, the third partly
    logits[3, 1:] = float("-inf")  # one finite entry
    logits[5, ::2] = float("-inf")
    logits = logits.to(torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0, 1.3, 1.0, 0.5, 2.0], device=DEVICE)
    seeds = torch.arange(n, dtype=torch.int64, device=DEVICE) * 31 + 1
    steps = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    p = full_vocab_params(temperature, seeds, steps)
    ref = sample(logits, p, want_support=False)
    tok = torch.empty(n, dtype=torch.int64, device=DEVICE)
    lp = torch.empty(n, 2, device=DEVICE)
    sampler.sample_rows(logits, temperature, seeds, steps.clone(), tok, lp, config=(512, 4))
    assert torch.equal(tok, ref.token_ids) and int(tok[3]) == 0
    assert bool((tok < 10000).all())
    assert torch.isfinite(lp).all()
    assert torch.allclose(lp[:, 0], ref.logprobs, atol=1e-4, rtol=1e-4)
    assert torch.allclose(lp[:, 1], ref.scaled_logprobs, atol=1e-4, rtol=1e-4)
    assert abs(float(lp[3, 0])) < 1e-6  # the only finite entry has probability 1


@pytest.mark.parametrize("vocab", [99, 9000])
@pytest.mark.parametrize("fill", [float("-inf"), float("nan")])
def test_sample_kernel_on_a_row_with_no_finite_logit_gives_id_0_as_torch(vocab: int, fill: float) -> None:
    # A row that overflowed to NaN or was masked whole: torch's argmax answers id 0; an id of `vocab` would index
    # past the embedding at the next step. The row is a view with one spare column holding a large finite logit,
    # so a read of id `vocab` would show up in the reported log-prob.
    n = 4
    buf = torch.full((n, vocab + 1), fill, device=DEVICE)
    buf[:, vocab] = 50.0
    logits = buf[:, :vocab]
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0], device=DEVICE)
    seeds = torch.arange(n, dtype=torch.int64, device=DEVICE) + 5
    steps = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    ref = sample(logits, full_vocab_params(temperature, seeds, steps), want_support=False)
    tok = torch.empty(n, dtype=torch.int64, device=DEVICE)
    lp = torch.empty(n, 2, device=DEVICE)
    sampler.sample_rows(logits, temperature, seeds, steps.clone(), tok, lp)
    assert tok.tolist() == [0] * n == ref.token_ids.tolist()
    assert not bool((lp == 50.0).any())


def test_sample_kernel_on_log_prob_rows_reports_the_rows_own_entry() -> None:
    """The batch-invariant engine samples from its log-softmax rows: the kernel draws the torch sampler's token and
    reports that row's entry bit for bit (the trainer computes the same row), not a re-normalised copy of it."""
    torch.manual_seed(2)
    n, vocab = 16, 5000
    lp_rows = torch.log_softmax(torch.randn(n, vocab, device=DEVICE) * 3, dim=-1)
    ones = torch.ones(n, device=DEVICE)
    seeds = torch.arange(n, dtype=torch.int64, device=DEVICE) * 104729 + 11
    steps = torch.arange(n, dtype=torch.int64, device=DEVICE) % 7
    p = full_vocab_params(ones, seeds, steps)
    ref = sample(lp_rows, p, want_support=False, unit_temperature=True, logprobs=lp_rows)
    tok = torch.empty(n, dtype=torch.int64, device=DEVICE)
    lp = torch.empty(n, 2, device=DEVICE)
    sampler.sample_rows(lp_rows, ones, seeds, steps.clone(), tok, lp, logprob_rows=True)
    assert torch.equal(tok, ref.token_ids)
    entries = lp_rows.gather(1, tok[:, None])[:, 0]
    assert torch.equal(lp[:, 0], entries) and torch.equal(lp[:, 1], entries)
    # Without the flag the kernel re-normalises, which is what would have moved the bits.
    sampler.sample_rows(lp_rows, ones, seeds, steps.clone(), tok, lp)
    assert torch.allclose(lp[:, 0], entries, atol=1e-5)


# Small tiles, so that the tiny model's GEMMs have several tiles and every split-K program a share of K.
SMALL_GEMM_CONFIGS = {
    "qkv": (16, 32, 32, 1, 4, 2),
    "o": (16, 32, 16, 3, 4, 2),  # K = 128 in three slices of 48, 48 and 32: every partial has work
    "gate_up": (16, 32, 32, 1, 4, 2),
    "down": (16, 32, 32, 2, 4, 2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bias", "split"), [(False, 1), (True, 1), (False, 3)])  # partials take no bias
def test_linear_kernel_matches_f_linear(dtype: torch.dtype, bias: bool, split: int) -> None:
    torch.manual_seed(5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for m, k, n in ((5, 70, 40), (33, 130, 17)):
        x, w = torch.randn(m, k, device=DEVICE).to(dtype), torch.randn(n, k, device=DEVICE).to(dtype)
        b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
        out = gemm.linear(x, w, b, config=(16, 16, 32, split, 4, 2))
        assert out.shape == ((split, m, n) if split > 1 else (m, n))
        assert rel(out.sum(0) if split > 1 else out, torch.nn.functional.linear(x, w, b).float()) < tol
        gate_up = torch.randn(2 * n, k, device=DEVICE).to(dtype)
        act = gemm.linear(x, gate_up, config=(16, 16, 32, 1, 4, 2), gated=True)
        g, u = torch.nn.functional.linear(x, gate_up).split(n, dim=1)
        assert act.shape == (m, n) and rel(act, torch.nn.functional.silu(g) * u) < tol
        # add_rmsnorm sums the partials into the residual as it adds a whole product.
        r1 = torch.randn(m, n, device=DEVICE).to(dtype)
        r2 = r1.clone()
        weight = torch.rand(n, device=DEVICE).to(dtype) + 0.5
        h1, h2 = torch.empty_like(r1), torch.empty_like(r1)
        norms.add_rmsnorm(gemm.linear(x, w, config=(16, 16, 32, split, 4, 2)), r1, weight, 1e-6, h1)
        norms.add_rmsnorm(torch.nn.functional.linear(x, w), r2, weight, 1e-6, h2)
        assert rel(r1, r2) < tol and rel(h1, h2) < tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_linear_partials_sum_to_f_linear(dtype: torch.dtype) -> None:
    torch.manual_seed(7)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    x, w = torch.randn(9, 96, device=DEVICE).to(dtype), torch.randn(24, 96, device=DEVICE).to(dtype)
    assert torch.equal(gemm.split_k_linear(x, w, 1), torch.nn.functional.linear(x, w))
    for parts in (2, 3, 4):
        partials = gemm.split_k_linear(x, w, parts)
        assert partials.shape == (parts, 9, 24) and partials.dtype == torch.float32
        assert rel(partials.sum(0), torch.nn.functional.linear(x, w).float()) < tol
    with pytest.raises(ValueError, match="K = 96 must split into 5 equal parts"):
        gemm.split_k_linear(x, w, 5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_linear_is_silu_mul_of_the_same_products_bit_for_bit(dtype: torch.dtype) -> None:
    # The same tiles accumulate the same products, so the fused epilogue must round exactly as silu_mul does.
    torch.manual_seed(6)
    x = torch.randn(37, 96, device=DEVICE).to(dtype)
    gate_up = (torch.randn(2 * 64, 96, device=DEVICE) / 10).to(dtype)
    config = (16, 32, 32, 1, 4, 2)
    fused = gemm.linear(x, gate_up, config=config, gated=True)
    separate = torch.empty_like(fused)
    gemm.silu_mul(gemm.linear(x, gate_up, config=config), separate)
    assert torch.equal(fused, separate)


def test_linear_kernel_refuses_a_bias_or_gate_on_partials() -> None:
    x, w = torch.randn(4, 32, device=DEVICE), torch.randn(8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="SPLIT_K 2 returns partial products"):
        gemm.linear(x, w, torch.zeros(8, device=DEVICE), config=(16, 16, 32, 2, 4, 2))
    with pytest.raises(ValueError, match="SPLIT_K 2 returns partial products"):
        gemm.linear(x, w, config=(16, 16, 32, 2, 4, 2), gated=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("llama", [False, True])
@pytest.mark.parametrize("gemm_path", ["cublas", "cublas_split", "triton"])  # cublas_split: o and down split over K
def test_decode_step_matches_forward_cached(
    dtype: torch.dtype, llama: bool, gemm_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpcrl.engine.embedded.runner import DecodeRunner
    from hpcrl.engine.embedded.step_output import RowState

    knobs = KernelsConfig(
        gemm="triton" if gemm_path == "triton" else "cublas",
        cublas_split_k=(2, 4) if gemm_path == "cublas_split" else (1, 1),
        **{f"gemm_config_{stage}": tiles for stage, tiles in SMALL_GEMM_CONFIGS.items()},  # type: ignore[arg-type]
    )
    monkeypatch.setattr(launch, "SETTINGS", knobs)
    args = tiny_args(llama=llama)
    model = random_model(args, dtype)
    slots, max_len = 6, 40
    cache = KVCache.allocate(args, slots, max_len, dtype, DEVICE)
    ref_cache = KVCache.allocate(args, slots, max_len, dtype, DEVICE)
    torch.manual_seed(2)
    lengths = [5, 17, 1, 33, 9]
    n = len(lengths)
    width = max(lengths)
    ids = torch.randint(3, args.vocab_size, (n, width), device=DEVICE)
    zeros = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    last = torch.tensor(lengths, device=DEVICE) - 1
    with torch.no_grad():
        model.forward_cached(ids, cache, 0, zeros, last, from_start=True)
        model.forward_cached(ids, ref_cache, 0, zeros, last, from_start=True)
        nxt = torch.randint(3, args.vocab_size, (n,), device=DEVICE)
        start = torch.tensor(lengths, device=DEVICE)
        ref = model.forward_cached(nxt[:, None], ref_cache, 0, start, zeros).float()
        runner = DecodeRunner(model, cache, max_batch=slots, device=DEVICE, mode="triton")
        runner.write_rows(
            [RowState(int(t), p, 0, 0, 1.0, -1, 1.0, 0.0) for t, p in zip(nxt.tolist(), lengths, strict=True)]
        )
        got = runner.fast_forward(n).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert rel(got, ref) < tol, rel(got, ref)
    if gemm_path == "cublas_split":
        # Split up to CUBLAS_SPLIT_K_MAX_ROWS rows a step (where the H200 sweep found it faster), whole above.
        asked: list[int] = []
        split_k_linear = gemm.split_k_linear
        monkeypatch.setattr(
            gemm, "split_k_linear", lambda x, w, parts: asked.append(parts) or split_k_linear(x, w, parts)
        )
        for cap, want in ((n, {2, 4}), (n - 1, {1})):
            asked.clear()
            monkeypatch.setattr(gemm, "CUBLAS_SPLIT_K_MAX_ROWS", cap)
            with torch.no_grad():
                assert rel(runner.fast_forward(n).float(), ref) < tol
            assert set(asked) == want and len(asked) == 2 * args.num_layers
    for i in range(args.num_layers):
        for b, length in enumerate(lengths):
            assert rel(cache.k[i][b, :, : length + 1], ref_cache.k[i][b, :, : length + 1]) < tol
            assert rel(cache.v[i][b, :, : length + 1], ref_cache.v[i][b, :, : length + 1]) < tol


def test_a_row_past_the_cache_end_leaves_the_cache_and_the_other_rows_alone() -> None:
    """A finished row's look-ahead step sits at position max_len: its RoPE row is clamped to the table's last and
    its K/V write is dropped, while the rows beside it decode as they would alone."""
    from hpcrl.engine.embedded.runner import DecodeRunner
    from hpcrl.engine.embedded.step_output import RowState

    dtype = DTYPES[0]
    args = tiny_args()
    model = random_model(args, dtype)
    max_len = 12
    cache = KVCache.allocate(args, 2, max_len, dtype, DEVICE)
    alone = KVCache.allocate(args, 2, max_len, dtype, DEVICE)
    for c in (cache, alone):
        for t in c.k + c.v:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype))
    with torch.no_grad():
        runner = DecodeRunner(model, cache, max_batch=2, device=DEVICE, mode="triton")
        runner.write_rows([RowState(7, 4, 0, 0, 1.0, -1, 1.0, 0.0), RowState(9, max_len, 0, 0, 1.0, -1, 1.0, 0.0)])
        before = [t[1].clone() for t in cache.k + cache.v]
        got = runner.fast_forward(2).float()
        single = DecodeRunner(model, alone, max_batch=2, device=DEVICE, mode="triton")
        single.write_rows([RowState(7, 4, 0, 0, 1.0, -1, 1.0, 0.0)])
        ref = single.fast_forward(1).float()
    assert torch.isfinite(got).all()
    # Not bit-equal: a GEMM of 2 rows may round differently from one of 1.
    assert rel(got[0], ref[0]) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert all(torch.equal(t[1], b) for t, b in zip(cache.k + cache.v, before, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("llama", [False, True])
def test_fused_prefill_matches_forward_cached(dtype: torch.dtype, llama: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcrl.engine.embedded.runner import DecodeRunner

    args = tiny_args(llama=llama)
    model = random_model(args, dtype)
    slots, max_len, first_slot = 7, 40, 2
    cache = KVCache.allocate(args, slots, max_len, dtype, DEVICE)
    ref_cache = KVCache.allocate(args, slots, max_len, dtype, DEVICE)
    torch.manual_seed(4)
    lengths = [5, 17, 1, 12]
    n, width = len(lengths), max(lengths)
    ids = torch.randint(3, args.vocab_size, (n, width), device=DEVICE)
    last = torch.tensor(lengths, device=DEVICE) - 1
    monkeypatch.setattr(launch, "SETTINGS", KernelsConfig(prefill="fused"))
    runner = DecodeRunner(model, cache, max_batch=slots, device=DEVICE, mode="triton")
    assert runner.prefill_fused
    with torch.no_grad():
        zeros = torch.zeros(n, dtype=torch.int64, device=DEVICE)
        ref = model.forward_cached(ids, ref_cache, first_slot, zeros, last, from_start=True).float()
        got = runner.prefill(ids, first_slot, last).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert got.shape == ref.shape and rel(got, ref) < tol, rel(got, ref)
    rows = slice(first_slot, first_slot + n)
    for i in range(args.num_layers):
        for b, length in enumerate(lengths):
            s = first_slot + b
            assert rel(cache.k[i][s, :, :length], ref_cache.k[i][s, :, :length]) < tol
            assert rel(cache.v[i][s, :, :length], ref_cache.v[i][s, :, :length]) < tol
        # Slots outside first_slot.. are untouched.
        assert not cache.k[i][:first_slot].any() and not cache.k[i][rows.stop :].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an 8-bit K/V cache needs CUDA and bfloat16")
def test_fused_prefill_into_an_fp8_cache_matches_forward_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcrl.engine.embedded.runner import DecodeRunner

    args = tiny_args()
    model = random_model(args, torch.bfloat16)
    cache = KVCache.allocate(args, 6, 40, torch.float8_e4m3fn, DEVICE)
    ref_cache = KVCache.allocate(args, 6, 40, torch.float8_e4m3fn, DEVICE)
    torch.manual_seed(7)
    lengths = [9, 33, 4]
    ids = torch.randint(3, args.vocab_size, (3, 33), device=DEVICE)
    last = torch.tensor(lengths, device=DEVICE) - 1
    monkeypatch.setattr(launch, "SETTINGS", KernelsConfig(prefill="fused"))
    runner = DecodeRunner(model, cache, max_batch=6, device=DEVICE, mode="triton")
    with torch.no_grad():
        ref = model.forward_cached(ids, ref_cache, 1, torch.zeros(3, dtype=torch.int64, device=DEVICE), last,
                                   from_start=True).float()  # fmt: skip
        got = runner.prefill(ids, 1, last).float()
    assert rel(got, ref) < 3e-2
    for i in range(args.num_layers):
        for b, length in enumerate(lengths):
            k, k_ref = cache.k[i][1 + b, :, :length].float(), ref_cache.k[i][1 + b, :, :length].float()
            v, v_ref = cache.v[i][1 + b, :, :length].float(), ref_cache.v[i][1 + b, :, :length].float()
            assert rel(k, k_ref) < 5e-2 and rel(v, v_ref) < 5e-2


def test_fused_step_and_prefill_window_as_forward_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose first layer attends within 8 tokens: the fused prefill and decode step past the window."""
    from hpcrl.engine.embedded.runner import DecodeRunner
    from hpcrl.engine.embedded.step_output import RowState

    monkeypatch.setattr(launch, "SETTINGS", KernelsConfig(prefill="fused"))
    args = dataclasses.replace(tiny_args(), layer_windows=(8, None))
    model = random_model(args, torch.float32)
    cache = KVCache.allocate(args, 4, 40, torch.float32, DEVICE)
    ref_cache = KVCache.allocate(args, 4, 40, torch.float32, DEVICE)
    torch.manual_seed(9)
    lengths = [20, 5, 12]
    ids = torch.randint(3, args.vocab_size, (3, 20), device=DEVICE)
    zeros = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    last = torch.tensor(lengths, device=DEVICE) - 1
    runner = DecodeRunner(model, cache, max_batch=4, device=DEVICE, mode="triton")
    with torch.no_grad():
        ref = model.forward_cached(ids, ref_cache, 0, zeros, last, from_start=True)
        assert rel(runner.prefill(ids, 0, last), ref) < 1e-4
        for step in range(12):  # the short prompt's decode crosses its window
            nxt = torch.randint(3, args.vocab_size, (3,), device=DEVICE)
            start = torch.tensor(lengths, device=DEVICE) + step
            ref = model.forward_cached(nxt[:, None], ref_cache, 0, start, zeros)
            rows = [RowState(int(t), int(p), 0, 0, 1.0, -1, 1.0, 0.0) for t, p in zip(nxt, start, strict=True)]
            runner.write_rows(rows)
            assert rel(runner.fast_forward(3), ref) < 1e-4, step


# 8-bit K/V only under a bfloat16 q: the engine refuses them with float32 models (and the interpreter runs fp32 only).
@pytest.mark.parametrize(("dtype", "kv8"), [(d, False) for d in DTYPES] + [(torch.bfloat16, True)] * (len(DTYPES) > 1))
@pytest.mark.parametrize("config", [(64, 4, 2, 1), (32, 4, 2, 0), (32, 2, 4, 1), (32, 1, 3, 2), (64, 4, 2, 2)])
@pytest.mark.parametrize("window", [None, 37], ids=["full", "window-37"])
def test_decode_attention_against_sdpa(
    dtype: torch.dtype, kv8: bool, config: tuple[int, ...], window: int | None
) -> None:
    torch.manual_seed(3)
    n, h, kv, d, max_len = 5, 16, 8, 64, 200
    kc = torch.randn(n, kv, max_len, d, device=DEVICE).to(torch.float8_e4m3fn if kv8 else dtype)
    vc = torch.randn(n, kv, max_len, d, device=DEVICE).to(torch.float8_e4m3fn if kv8 else dtype)
    q = torch.randn(n, h, d, device=DEVICE).to(dtype)
    pos = torch.tensor([0, 63, 64, 150, 199], device=DEVICE)
    out = torch.empty_like(q)
    attention.decode_attention(q, kc, vc, pos, out, h, kv, d, 1 / math.sqrt(d), config=config, window=window)
    for b in range(n):
        L = int(pos[b]) + 1
        first = max(L - window, 0) if window else 0  # a sliding window: the last `window` keys
        k = kc[b, :, first:L].float().repeat_interleave(h // kv, 0)
        v = vc[b, :, first:L].float().repeat_interleave(h // kv, 0)
        w = torch.softmax(q[b].float()[:, None] @ k.transpose(1, 2) / math.sqrt(d), -1)
        ref = (w @ v)[:, 0]
        assert rel(out[b].float(), ref) < (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_graph_replay_equals_eager_kernels() -> None:
    from hpcrl.engine.embedded.runner import DecodeRunner
    from hpcrl.engine.embedded.step_output import RowState

    args = tiny_args()
    model = random_model(args, torch.bfloat16)
    cache = KVCache.allocate(args, 8, 32, torch.bfloat16, DEVICE)
    runner = DecodeRunner(model, cache, max_batch=8, device=DEVICE, mode="graph")
    rows = [RowState(5 + i, 3 + i, i, 0, 1.0, -1, 1.0, 0.0) for i in range(5)]
    with torch.no_grad():
        runner.write_rows(rows)
        eager = runner.fast_forward(5).float().clone()
        graph, logits = runner._graph(runner.graphs.bucket(5))
        graph.replay()
        assert torch.equal(logits[:5].float(), eager)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs a CUDA device of compute capability 9 or newer",
)
@pytest.mark.parametrize("kv8", [False, True])
def test_programmatic_dependent_launch_decodes_the_same_bits(kv8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each kernel waits on the device for the one before it; a wait missing or placed after a read would let a
    # kernel read its input before it is written, and the tokens, log-probs or cache of a 40-step generation
    # would differ from those of kernels launched one after the other.
    from hpcrl.engine.embedded.runner import DecodeRunner
    from hpcrl.engine.embedded.step_output import RowState

    args = tiny_args()
    model = random_model(args, torch.bfloat16)
    rows = [RowState(5 + i, 3 + i, i, 0, 1.0, -1, 1.0, 0.0) for i in range(8)]

    def generate(pdl: bool) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
        monkeypatch.setattr(launch, "SETTINGS", KernelsConfig(pdl=pdl))
        cache = KVCache.allocate(args, 8, 64, torch.float8_e4m3fn if kv8 else torch.bfloat16, DEVICE)
        runner = DecodeRunner(model, cache, max_batch=8, device=DEVICE, mode="graph")
        tokens, logprobs = [], []
        with torch.no_grad():
            runner.write_rows(rows)
            for _ in range(40):
                out = runner.decode(8, torch_sampler=False, want_support=False).result()
                tokens.append(out.tokens)
                logprobs.append(out.logprobs)
        # The runner falls back quietly (a failed capture to eager kernels, a failed sampler to torch's), and the
        # fallbacks give the same bits: without these the test could pass with the PDL path never run.
        assert runner.mode == "graph" and runner.fast_sampler and runner.stats["graph_captures"] >= 1
        assert launch.pdl_on(DEVICE) is pdl
        return tokens, logprobs, torch.stack([t.float() for t in cache.k + cache.v])

    plain, pdl = generate(False), generate(True)
    assert pdl[0] == plain[0]
    assert pdl[1] == plain[1]
    assert torch.equal(pdl[2], plain[2])


def test_rope_table_matches_rope_cos_sin() -> None:
    pos = torch.arange(50, device=DEVICE)
    cos, sin = rope_cos_sin(pos, 32, 1e6, torch.float32)
    c2, s2 = rope_cos_sin(pos[[3, 7, 49]], 32, 1e6, torch.float32)
    assert torch.equal(cos[[3, 7, 49]], c2) and torch.equal(sin[[3, 7, 49]], s2)
