"""The batch-invariant forward: engine-sampled log-probs equal the trainer's bit for bit (torch.equal)."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import torch

from hpcrl.engine.config import EngineConfig
from hpcrl.engine.embedded.scheduler import Scheduler, SchedulerConfig, SeqRequest
from hpcrl.model import invariant
from hpcrl.model.hf import load_model
from hpcrl.model.qwen3 import CausalLM, KVCache
from hpcrl.samples.support import TokenSupports
from hpcrl.trainer.batch import TrainBatch


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> CausalLM:
    torch.set_num_threads(1)
    return load_model(tiny_model_dir).eval()


def _requests(n: int, *, seed: int = 0, max_new_tokens: int = 10) -> list[SeqRequest]:
    rng = random.Random(seed)
    return [
        SeqRequest(
            rid=f"r{i}",
            prompt_ids=[rng.randrange(3, 99) for _ in range(rng.randrange(2, 14))],
            # Different lengths: rows finish at different steps, so the decode batch shrinks and refills.
            max_new_tokens=max_new_tokens - i % 4,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            seed=1000 + i,
            stop_token_ids=frozenset(),
            ignore_eos=True,
            return_logprob=True,
            return_sampling_mask=False,
            on_done=lambda r: None,
        )
        for i in range(n)
    ]


def _generate(
    model: CausalLM, reqs: list[SeqRequest], *, max_running: int, retract_after_steps: int | None = None
) -> list[SeqRequest]:
    """Drive a real scheduler on this thread (what its loop does) until every request finished."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    engine = EngineConfig(
        max_running_requests=max_running,
        dtype=dtype,  # type: ignore[arg-type]
        batch_invariant=True,
        deterministic=False,  # admit while others run: batches change size every few steps
    )
    sched = Scheduler(
        model,
        SchedulerConfig(engine=engine, context_length=64),
        device=torch.device("cpu"),
        dtype=next(model.parameters()).dtype,
    )
    sched.submit(reqs)
    steps = 0
    with torch.inference_mode():
        while sched.waiting or sched.running:
            sched._step()
            steps += 1
            if steps == retract_after_steps:
                sched.pause("retract")
                assert sched.waiting and not sched.running
                sched.resume_generation()
        sched._drain()
    assert all(r.finish_reason is not None for r in reqs)
    return reqs


def _trainer_logprobs(model: CausalLM, reqs: list[SeqRequest], micro_batch: int) -> list[torch.Tensor]:
    """What train.logprobs: invariant computes: right-padded micro-batches through invariant.token_logprobs."""
    out = []
    for start in range(0, len(reqs), micro_batch):
        mb = reqs[start : start + micro_batch]
        width = max(len(r.all_ids) for r in mb)
        ids = torch.tensor([r.all_ids + [0] * (width - len(r.all_ids)) for r in mb])
        with torch.no_grad():
            lp = invariant.token_logprobs(model, ids)
        for i, r in enumerate(mb):
            p = len(r.prompt_ids)
            out.append(lp[i, p - 1 : p - 1 + len(r.output_ids)])
    return out


@pytest.mark.parametrize(("batch_size", "micro_batch"), [(1, 1), (7, 3), (64, 16)])
def test_top_k_top_p_support_logprobs_of_the_engine_equal_the_trainers(
    model: CausalLM, batch_size: int, micro_batch: int
) -> None:
    """Under sampling-support replay the engine reports each token's log-prob renormalised over its top-k/top-p
    support; train.logprobs: invariant scores the same renormalisation from its own forward, over the supports the
    engine sent, in micro-batches whose width and support width differ from the engine's batches."""
    reqs = _requests(batch_size)
    for r in reqs:
        r.top_k, r.top_p, r.return_sampling_mask = 8, 0.9, True
    reqs = _generate(model, reqs, max_running=min(batch_size, 24))
    sizes = [len(ids) for r in reqs for ids in r.support_ids]
    assert min(sizes) >= 1 and max(sizes) > 1  # real supports, some wider than the sampled token alone
    moved = False
    for start in range(0, len(reqs), micro_batch):
        mb = reqs[start : start + micro_batch]
        batch = TrainBatch.from_sequences(
            [r.prompt_ids for r in mb],
            [r.output_ids for r in mb],
            supports=[TokenSupports.from_lists(r.support_ids) for r in mb],
        )
        supports = batch.padded_supports()
        assert supports is not None
        with torch.no_grad():
            lp = invariant.support_token_logprobs(model, batch.input_ids, *supports)
        for i, r in enumerate(mb):
            p = len(r.prompt_ids)
            got = lp[i, p - 1 : p - 1 + len(r.output_ids)]
            assert torch.equal(torch.tensor(r.support_logprobs, dtype=torch.float32), got), r.rid
            full = torch.tensor(r.logprobs, dtype=torch.float32)
            assert bool((got >= full).all())
            moved |= bool((got > full).any())
    assert moved  # the renormalisation is real: supports below the whole vocabulary lift the log-probs


@pytest.mark.parametrize(("batch_size", "micro_batch"), [(1, 1), (7, 3), (64, 16)])
def test_engine_sampled_logprobs_equal_the_trainers(model: CausalLM, batch_size: int, micro_batch: int) -> None:
    reqs = _generate(model, _requests(batch_size), max_running=min(batch_size, 24))
    trainer = _trainer_logprobs(model, reqs, micro_batch)
    for r, lp in zip(reqs, trainer, strict=True):
        assert len(r.output_ids) == r.max_new_tokens
        assert torch.equal(torch.tensor(r.logprobs, dtype=torch.float32), lp), r.rid


def test_prefill_equals_decode_at_every_position(model: CausalLM) -> None:
    torch.manual_seed(0)
    t = 70  # three key tiles: the tail tile of every length is masked, never cut
    ids = torch.randint(3, 99, (5, t))
    with torch.no_grad():
        whole = invariant.logits(model, ids)
        cache = KVCache.allocate(model.args, 5, 96, torch.float32, torch.device("cpu"))
        first = invariant.prefill(model, cache, ids[:, :1], 0, torch.zeros(5, dtype=torch.long))
        assert torch.equal(first, whole[:, 0])
        for pos in range(1, t):
            step = invariant.decode(model, cache, ids[:, pos], torch.full((5,), pos))
            assert torch.equal(step, whole[:, pos]), pos
        # A prefill of any prefix (what a re-prefill after a retract does) ends on the same row.
        for pos in range(1, t, 7):
            again = invariant.prefill(model, cache, ids[:2, : pos + 1], 0, torch.full((2,), pos))
            assert torch.equal(again, whole[:2, pos]), pos


def test_decode_rows_of_different_lengths_in_one_step(model: CausalLM) -> None:
    """Rows at positions 3 and 40 decoded together equal each one decoded alone."""
    torch.manual_seed(1)
    ids = torch.randint(3, 99, (2, 41))
    with torch.no_grad():
        whole = invariant.logits(model, ids)
        cache = KVCache.allocate(model.args, 2, 64, torch.float32, torch.device("cpu"))
        invariant.prefill(model, cache, torch.stack([ids[0, :40], ids[1, :40]]), 0, torch.full((2,), 39))
        # Row 0 decodes position 3 again (its later cache entries are masked), row 1 its next token.
        step = invariant.decode(model, cache, torch.tensor([ids[0, 3], ids[1, 40]]), torch.tensor([3, 40]))
    assert torch.equal(step[0], whole[0, 3]) and torch.equal(step[1], whole[1, 40])


def test_a_request_alone_equals_it_in_a_full_batch(model: CausalLM) -> None:
    alone = _generate(model, _requests(1, seed=5), max_running=1)[0]
    crowd = _requests(64, seed=6)
    crowd[37] = _requests(1, seed=5)[0]
    full = _generate(model, crowd, max_running=64)[37]
    assert full.output_ids == alone.output_ids
    assert torch.equal(torch.tensor(full.logprobs), torch.tensor(alone.logprobs))


def test_samples_of_one_prompt_share_its_prefill_and_equal_each_sample_alone(
    model: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's n samples are prefilled once (the others copy its K/V rows and logits row); each sample still
    draws with its own seed and gets the bits it would get alone."""
    from hpcrl.engine.embedded.runner import DecodeRunner

    prefilled_rows: list[int] = []
    real_prefill = DecodeRunner.prefill

    def counting_prefill(self: DecodeRunner, ids: torch.Tensor, first_slot: int, last: torch.Tensor) -> torch.Tensor:
        prefilled_rows.append(ids.shape[0])
        return real_prefill(self, ids, first_slot, last)

    def group(n: int) -> list[SeqRequest]:
        reqs = _requests(n, seed=11)
        for i, r in enumerate(reqs):
            r.prompt_ids, r.seed = list(reqs[i % 3].prompt_ids), 2000 + i  # 3 prompts, n samples in all
        return reqs

    monkeypatch.setattr(DecodeRunner, "prefill", counting_prefill)
    together = _generate(model, group(12), max_running=12)
    assert prefilled_rows == [3], "one prefill row per distinct prompt"
    for i in range(12):
        alone = _generate(model, [group(12)[i]], max_running=1)[0]
        assert together[i].output_ids == alone.output_ids, i
        assert torch.equal(torch.tensor(together[i].logprobs), torch.tensor(alone.logprobs)), i
    assert len({tuple(r.output_ids) for r in together}) > 3, "the samples of a prompt differ (own seeds)"


def test_a_retracted_request_continues_with_the_same_bits(model: CausalLM) -> None:
    plain = _generate(model, _requests(12, seed=3), max_running=12)
    retracted = _generate(model, _requests(12, seed=3), max_running=12, retract_after_steps=4)
    for a, b in zip(plain, retracted, strict=True):
        assert b.num_retractions == 1
        assert a.output_ids == b.output_ids
        assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs)), a.rid
    trainer = _trainer_logprobs(model, retracted, 5)
    for r, lp in zip(retracted, trainer, strict=True):
        assert torch.equal(torch.tensor(r.logprobs, dtype=torch.float32), lp)


@pytest.fixture(scope="module")
def bf16_model(tiny_model_dir: Path) -> CausalLM:
    return load_model(tiny_model_dir, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize(("batch_size", "micro_batch"), [(7, 3), (64, 16)])
def test_bfloat16_engine_logprobs_equal_the_trainers(bf16_model: CausalLM, batch_size: int, micro_batch: int) -> None:
    """The H200 runs bf16: the same forward in bf16 holds on the CPU too (GEMMs in bf16, reductions in fp32)."""
    reqs = _generate(bf16_model, _requests(batch_size, seed=8), max_running=min(batch_size, 24))
    trainer = _trainer_logprobs(bf16_model, reqs, micro_batch)
    for r, lp in zip(reqs, trainer, strict=True):
        assert torch.equal(torch.tensor(r.logprobs, dtype=torch.float32), lp), r.rid


def test_bfloat16_prefill_equals_decode_at_every_position(bf16_model: CausalLM) -> None:
    ids = torch.randint(3, 99, (3, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = invariant.logits(bf16_model, ids)
        cache = KVCache.allocate(bf16_model.args, 3, 48, torch.bfloat16, torch.device("cpu"))
        invariant.prefill(bf16_model, cache, ids[:, :1], 0, torch.zeros(3, dtype=torch.long))
        for pos in range(1, ids.shape[1]):
            step = invariant.decode(bf16_model, cache, ids[:, pos], torch.full((3,), pos))
            assert torch.equal(step, whole[:, pos]), pos


def test_the_fixed_order_log_softmax_of_cuda_matches_the_standard_one() -> None:
    """CUDA's logprob_rows sums each row in a fixed tree; it is log_softmax to rounding, in value and gradient,
    and a row's bits do not depend on how many rows come with it."""
    x = (torch.randn(37, 1187, generator=torch.Generator().manual_seed(0)) * 4).requires_grad_(True)
    lp = invariant._TreeLogSoftmax.apply(x)
    torch.testing.assert_close(lp, torch.log_softmax(x, -1), rtol=0, atol=2e-6)
    assert torch.equal(invariant._tree_log_softmax(x[5:6].detach()), lp[5:6].detach())
    upstream = torch.randn(37, 1187, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(lp, x, upstream)
    (want,) = torch.autograd.grad(torch.log_softmax(x, -1), x, upstream)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


def test_the_gradient_flows_through_the_invariant_forward(tiny_model_dir: Path) -> None:
    """train.logprobs: invariant trains on these log-probs: their gradient is the standard forward's, to rounding."""
    ids = torch.randint(3, 99, (3, 20), generator=torch.Generator().manual_seed(2))
    m = load_model(tiny_model_dir)
    invariant.token_logprobs(m, ids).sum().backward()
    inv_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    lp = torch.log_softmax(m(ids)[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    lp.sum().backward()
    for g, p in zip(inv_grads, m.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


def test_recompute_mode_reports_the_rescore_and_keeps_the_sampled(tiny_model_dir: Path) -> None:
    from hpcrl.model.qwen3 import token_logprobs_of_sequence
    from hpcrl.rollout.generate import recompute_abs_diff
    from hpcrl.samples.sample import Sample

    model = load_model(tiny_model_dir).eval()  # the plain CPU engine fuses its weights: not the shared model
    sched = Scheduler(
        model,
        SchedulerConfig(engine=EngineConfig(max_running_requests=8, logprobs="recompute"), context_length=64),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    reqs = _requests(6, seed=9)
    sched.submit(reqs)
    with torch.inference_mode():
        while sched.waiting or sched.running:
            sched._step()
        sched._drain()
    samples = []
    for r in reqs:
        with torch.inference_mode():
            rescore = token_logprobs_of_sequence(model, torch.tensor(r.all_ids), len(r.prompt_ids)).tolist()
        assert r.logprobs.tolist() == rescore and r.sampled_logprobs is not None
        assert len(r.sampled_logprobs) == len(r.output_ids)
        samples.append(
            Sample(
                r.prompt_ids, r.output_ids, r.logprobs.tolist(), "", "length", [], sampled_logprobs=r.sampled_logprobs
            )
        )
    diff = recompute_abs_diff(samples)
    expected = sum(abs(a - b) for r in reqs for a, b in zip(r.sampled_logprobs or [], r.logprobs, strict=True))
    assert diff == pytest.approx(expected / sum(len(r.output_ids) for r in reqs))
    assert recompute_abs_diff([Sample([1], [2], [0.0], "", "stop", [])]) is None


def test_the_invariant_http_engine_alone_vs_full_batch(engine_factory, model: CausalLM) -> None:
    """The real server with --batch-invariant: one request alone and inside a batch of 64 give the same
    tokens and log-probs, and they equal the trainer's invariant log-probs."""
    eng = engine_factory("--batch-invariant", "--max-running-requests", "64")
    prompt = [5, 17, 23, 40, 41]
    params = {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 11}
    one = httpx.post(
        eng.url + "/generate", json={"input_ids": prompt, "sampling_params": params, "return_logprob": True}, timeout=60
    ).json()
    others = [[(i * 7 + j) % 90 + 5 for j in range(3 + i % 9)] for i in range(63)]
    batch = httpx.post(
        eng.url + "/generate",
        json={
            "input_ids": [*others[:20], prompt, *others[20:]],
            "sampling_params": [{**params, "sampling_seed": 100 + i} for i in range(20)]
            + [params]
            + [{**params, "sampling_seed": 200 + i} for i in range(43)],
            "return_logprob": True,
        },
        timeout=120,
    ).json()[20]
    assert batch["output_ids"] == one["output_ids"]
    lps = [x[0] for x in one["meta_info"]["output_token_logprobs"]]
    assert [x[0] for x in batch["meta_info"]["output_token_logprobs"]] == lps
    with torch.no_grad():
        trainer = invariant.token_logprobs(model, torch.tensor([prompt + one["output_ids"]]))[0, len(prompt) - 1 :]
    assert torch.equal(torch.tensor(lps, dtype=torch.float32), trainer)


QUICKSTART = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"


def test_the_old_onpolicy_logprobs_key_is_refused_with_the_new_settings() -> None:
    from hpcrl.config import ConfigError
    from hpcrl.run_config import load_run_config

    with pytest.raises(ConfigError) as error:
        load_run_config(QUICKSTART, ["engine.onpolicy_logprobs=true"])
    message = str(error.value)
    assert "unknown key 'engine.onpolicy_logprobs': it was removed" in message
    assert "engine.logprobs: recompute" in message and "engine.batch_invariant: true" in message


def test_invariant_train_logprobs_need_the_invariant_engine_on_the_trainers_device_and_dtype() -> None:
    from hpcrl.run_config import load_run_config

    with pytest.raises(
        ValueError, match="train.logprobs=invariant needs engine.batch_invariant: true.*engine.batch_invariant=true"
    ):
        load_run_config(QUICKSTART, ["train.logprobs=invariant"])
    with pytest.raises(ValueError, match="batch_invariant covers device cpu or cuda in float32 or bfloat16"):
        load_run_config(QUICKSTART, ["engine.batch_invariant=true", "engine.dtype=float16"])
    with pytest.raises(ValueError, match="batch_invariant covers device cpu or cuda"):
        load_run_config(QUICKSTART, ["engine.batch_invariant=true", "engine.device=mps"])
    # The same forward on two GEMM libraries, or in two dtypes, is not the same bits.
    for mismatch in (["engine.device=cuda"], ["train.dtype=bfloat16"]):
        with pytest.raises(ValueError, match="the engine and the trainer on the same kind of device with the same"):
            load_run_config(QUICKSTART, ["engine.batch_invariant=true", "train.logprobs=invariant", *mismatch])
    with pytest.raises(ValueError, match="would replace the sampled log-probs"):
        load_run_config(QUICKSTART, ["engine.batch_invariant=true", "engine.logprobs=recompute"])
    from hpcrl.trainer.config import TrainConfig

    with pytest.raises(ValueError, match="the megatron backend runs megatron-core's own kernels"):
        TrainConfig(backend="megatron", logprobs="invariant")
    cfg = load_run_config(QUICKSTART, ["engine.batch_invariant=true", "train.logprobs=invariant"])
    assert cfg.engine.batch_invariant and cfg.train.logprobs == "invariant" and cfg.engine.logprobs == "sampled"
    on_gpu = ["engine.device=cuda", "train.device=cuda", "engine.dtype=bfloat16", "train.dtype=bfloat16"]
    cfg = load_run_config(QUICKSTART, ["engine.batch_invariant=true", "train.logprobs=invariant", *on_gpu])
    assert cfg.engine.device == cfg.train.device == "cuda" and cfg.train.dtype == "bfloat16"


def test_the_devices_and_dtypes_the_guarantee_covers_are_named_everywhere() -> None:
    """CUDA and bf16 pass the engine's config, the trainer's config and the forward's own check;
    fp16 and other devices are refused with what is covered."""
    from hpcrl.trainer.config import TrainConfig

    for device in ("cpu", "cuda", "cuda:1"):
        for dtype in ("float32", "bfloat16"):
            assert invariant.supported_reason(device, getattr(torch, dtype)) is None
            EngineConfig(device=device, dtype=dtype, batch_invariant=True)  # type: ignore[arg-type]
            TrainConfig(device=device, dtype=dtype, logprobs="invariant")  # type: ignore[arg-type]
    assert "not float16" in str(invariant.supported_reason("cuda", torch.float16))
    assert "not meta" in str(invariant.supported_reason("meta", torch.float32))
    with pytest.raises(ValueError, match="batch_invariant covers device cpu or cuda in float32 or bfloat16"):
        EngineConfig(device="cuda", dtype="float16", batch_invariant=True)
    with pytest.raises(ValueError, match="logprobs: invariant covers device cpu or cuda, not 'mps'"):
        TrainConfig(device="mps", logprobs="invariant")


def test_the_old_engine_flag_is_refused_before_a_model_loads(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(tmp_path), "--onpolicy-logprobs"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "hpcrl: error: --onpolicy-logprobs was removed" in out.stderr
    assert "--logprobs recompute" in out.stderr and "--batch-invariant" in out.stderr


@pytest.mark.parametrize(
    ("family", "qk_norm", "bias"), [("qwen2", False, True), ("llama", False, False)], ids=["qwen2", "llama"]
)
def test_qwen2_and_llama_layouts_hold_too(family: str, qk_norm: bool, bias: bool) -> None:
    """No QK-norm (both), q/k/v biases (Qwen2), untied LM head: engine at batch 7 vs trainer micro-batches."""
    from hpcrl.model.qwen3 import ModelArgs

    torch.manual_seed(3)
    args = ModelArgs(
        vocab_size=99, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, qk_norm=qk_norm, attention_bias=bias, tie_word_embeddings=False,
    )  # fmt: skip
    model = CausalLM(args).eval()
    if bias:
        for layer in model.model.decoder_layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias)  # nonzero: the bias add is on the path
    reqs = _generate(model, _requests(7, seed=4), max_running=4)
    for r, lp in zip(reqs, _trainer_logprobs(model, reqs, 2), strict=True):
        assert torch.equal(torch.tensor(r.logprobs, dtype=torch.float32), lp), (family, r.rid)


def test_the_progress_line_never_shows_a_recompute_gap_as_a_measurement() -> None:
    import io

    from hpcrl.store.progress import Progress

    row = {
        "timing/total_s": 0.1,
        "rollout/reward_mean": 0.5,
        "rollout/response_len_mean": 3.0,
        "rollout/response_len_max": 4.0,
        "rollout/truncated_share": 0.0,
        "train/train_rollout_logprob_abs_diff": float("nan"),
        "rollout/recompute_abs_diff": 3.25e-7,
    }
    out = io.StringIO()
    Progress(2, stream=out).step(0, row)
    assert "gap n/a (recompute: sampled vs reported 3.25e-07)" in out.getvalue()
    out = io.StringIO()
    Progress(2, stream=out).step(
        0, {**row, "train/train_rollout_logprob_abs_diff": 0.0} | {"rollout/recompute_abs_diff": 0.0}
    )
    assert "gap n/a" in out.getvalue()  # a recompute run says so even when the re-score matched
    plain = {k: v for k, v in row.items() if k != "rollout/recompute_abs_diff"} | {
        "train/train_rollout_logprob_abs_diff": 0.0
    }
    out = io.StringIO()
    Progress(2, stream=out).step(0, plain)
    assert "| gap 0.00e+00 |" in out.getvalue()


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("engine.kernels.invariant_matmul", "[64, 48, 128, 2, 3]", "invariant_matmul 64,48,128,2,3: expected 5"),
        ("engine.kernels.invariant_matmul", "[8, 16, 128, 2, 3]", "the blocks powers of two >= 16"),
        ("engine.kernels.invariant_attention", "[32, 64, 2]", "num_warps a power of two <= 32"),
        ("engine.kernels.invariant_attention", "[32, 4, 0]", "num_stages >= 1, like 32,4,2 (the default)"),
        ("engine.kernels.invariant_attention", "[32, 4]", "invariant_attention"),
        ("train.invariant_kernels.matmul", "[32, 16, 128, 3, 3]", "matmul 32,16,128,3,3: expected 5 integers"),
        ("train.invariant_kernels.attention", "[24, 4, 2]", "like 32,4,2 (the default)"),
    ],
)
def test_a_bad_invariant_kernel_tile_is_refused_naming_the_key_and_the_valid_form(
    where: str, value: str, message: str
) -> None:
    from hpcrl.run_config import load_run_config

    with pytest.raises(ValueError) as err:
        load_run_config(QUICKSTART, [f"{where}={value}"])
    assert message in str(err.value), str(err.value)
    assert where.rpartition(".")[2] in str(err.value), str(err.value)


@pytest.mark.parametrize("value", ["64,64", "a,b,c,d,e", "64,64,64,4,3,1", "64,,64,4,3", "64,48,64,4,3"])
def test_a_bad_invariant_tile_override_names_the_variable_and_the_fix(value: str) -> None:
    from hpcrl.engine.kernels_config import KernelsConfig, with_env_overrides
    from hpcrl.model.invariant_config import InvariantKernelsConfig
    from hpcrl.model.invariant_config import with_env_overrides as trainer_overrides

    env = {"HPCRL_INVARIANT_MATMUL": value}
    # The engine (engine serve) and the trainer apply the variable with the same rules.
    with pytest.raises(ValueError, match=r"HPCRL_INVARIANT_MATMUL=.*(exactly 5 .*32,16,128,2,3|powers of two).*unset"):
        with_env_overrides(KernelsConfig(), env)
    with pytest.raises(ValueError, match=r"HPCRL_INVARIANT_MATMUL=.*(exactly 5 .*32,16,128,2,3|powers of two).*unset"):
        trainer_overrides(InvariantKernelsConfig(), env)
    with pytest.raises(ValueError, match="HPCRL_INVARIANT_MATMULL: no batch-invariant kernel tile is called so"):
        trainer_overrides(InvariantKernelsConfig(), {"HPCRL_INVARIANT_MATMULL": "1"})
    resolved, overrides = with_env_overrides(KernelsConfig(), {"HPCRL_INVARIANT_MATMUL": "64,64,64,4,3"})
    assert resolved.invariant_matmul == (64, 64, 64, 4, 3)
    assert [str(o) for o in overrides] == ["invariant_matmul=64,64,64,4,3 (from HPCRL_INVARIANT_MATMUL)"]


def test_a_run_config_whose_engine_and_trainer_tiles_differ_is_refused() -> None:
    from hpcrl.run_config import load_run_config

    both = ["engine.batch_invariant=true", "train.logprobs=invariant"]
    with pytest.raises(ValueError, match=r"train.invariant_kernels.matmul \(32, 16, 128, 2, 3\).*engine.kernels"):
        load_run_config(QUICKSTART, [*both, "engine.kernels.invariant_matmul=[64,64,64,4,3]"])
    with pytest.raises(ValueError, match="set them alike"):
        load_run_config(QUICKSTART, [*both, "train.invariant_kernels.attention=[64,4,2]"])
    alike = ["engine.kernels.invariant_attention=[64,4,2]", "train.invariant_kernels.attention=[64,4,2]"]
    cfg = load_run_config(QUICKSTART, [*both, *alike])
    assert cfg.train.invariant_kernels == cfg.engine.kernels.invariant()
    # Without invariant log-probs the trainer launches no invariant kernel: nothing to compare.
    load_run_config(QUICKSTART, ["engine.kernels.invariant_matmul=[64,64,64,4,3]"])


def test_the_configured_tiles_reach_the_kernel_launch(model: CausalLM) -> None:
    from hpcrl.engine.kernels_config import KernelsConfig
    from hpcrl.model import invariant_kernels
    from hpcrl.model.invariant_config import InvariantKernelsConfig

    before = invariant_kernels.launch_config()
    assert before == InvariantKernelsConfig() and before.matmul == (32, 16, 128, 2, 3)
    try:
        # The engine: its engine.kernels section.
        knobs = KernelsConfig(invariant_matmul=(64, 32, 64, 4, 2), invariant_attention=(64, 8, 3))
        Scheduler(
            model,
            SchedulerConfig(engine=EngineConfig(max_running_requests=2, kernels=knobs), context_length=32),
            device=torch.device("cpu"),
            dtype=torch.float32,
        )
        assert invariant_kernels.launch_config() == InvariantKernelsConfig(
            matmul=(64, 32, 64, 4, 2), attention=(64, 8, 3)
        )
        # The trainer: train.invariant_kernels, with the environment's override applied on top.
        tiles = InvariantKernelsConfig(attention=(16, 2, 1))
        resolved = invariant.use_kernel_tiles(tiles, {"HPCRL_INVARIANT_MATMUL": "16,64,32,4,3", "HOME": "/"})
        assert invariant_kernels.launch_config() == resolved
        assert resolved == InvariantKernelsConfig(matmul=(16, 64, 32, 4, 3), attention=(16, 2, 1))
        # What the launch reads follows: the stacked GEMMs are used only where every weight starts on a BLOCK_N row.
        args = model.args
        widths = (args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, args.intermediate_size)
        assert invariant.fusable(args) == all(w % 64 == 0 for w in widths)
    finally:
        invariant_kernels.configure(before)
