"""Sampling-support replay (top-k/top-p): supports from the engine to the trainer ranks, and what replay refuses."""

from __future__ import annotations

import json
import shutil
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hpcrl.config import ConfigError
from hpcrl.engine.client import EngineClient
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.errors import EngineRequestError
from hpcrl.engine.fleet import EngineFleet
from hpcrl.rollout.config import DataConfig, RolloutConfig
from hpcrl.rollout.generate import PromptFormatter, Rollout, rollout_stats
from hpcrl.run_config import load_run_config
from hpcrl.samples.sample import Example, Group, Sample
from hpcrl.samples.support import TokenSupports
from hpcrl.store import load_metrics
from hpcrl.store.checkpoint import load_latest_checkpoint
from hpcrl.trainer.advantage import batch_from_groups
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.logprobs import support_mask_from_ids, support_token_logprobs, token_logprobs
from hpcrl.trainer.torch_backend import TorchTrainer
from tests.support import SMALL, assert_same_metrics, final_weights, hpcrl, run_ranks, signal_at_step

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "sglang-0.5.16" / "generate_sampling_mask.json"
REPLAY = ["rollout.top_k=8", "rollout.top_p=0.9", "rollout.temperature=1"]


# ----------------------------------------------------------------------------------------------------------------
# the ragged form


def test_supports_round_trip_through_plain_arrays_and_hdf5(tmp_path: Path) -> None:
    model_turn = TokenSupports.from_lists([[5, 9, 2], [7], [3, 4]])
    tool_result = TokenSupports.singletons([11, 12])  # tokens the model did not sample
    sample = TokenSupports.concat([model_turn, tool_result, TokenSupports.from_lists([[1, 8]])])
    assert sample.num_tokens == 6 and sample.sizes().tolist() == [3, 1, 2, 1, 1, 2]
    assert [sample.of(i).tolist() for i in range(6)] == [[5, 9, 2], [7], [3, 4], [11], [12], [1, 8]]
    sample.check_tokens([9, 7, 3, 11, 12, 8], where="sample 0")
    with pytest.raises(ValueError, match="support of token 2 does not hold the sampled token 5"):
        sample.check_tokens([9, 7, 5, 11, 12, 8], where="sample 0")
    with pytest.raises(ValueError, match="token 1 has an empty sampling support"):
        TokenSupports.from_lists([[1], []]).check_tokens([1, 2], where="r")
    with pytest.raises(ValueError, match="support of token 1 lists an id twice"):
        TokenSupports.from_lists([[1], [2, 3, 2]]).check_tokens([1, 2], where="r")

    arrays = sample.to_arrays()
    assert arrays["support_offsets"].dtype == np.int64 and arrays["support_ids"].dtype == np.int32
    with h5py.File(tmp_path / "buffer.h5", "w") as f:
        for name, values in arrays.items():
            f[f"sample0/{name}"] = values
    with h5py.File(tmp_path / "buffer.h5", "r") as f:
        back = TokenSupports.from_arrays({name: f[f"sample0/{name}"][()] for name in arrays})
    assert back == sample
    with pytest.raises(ValueError, match="non-decreasing"):
        TokenSupports(offsets=np.array([0, 2, 1]), ids=np.array([1], dtype=np.int32))


def test_train_batch_carries_supports_ragged_through_select_and_back() -> None:
    supports = [
        TokenSupports.from_lists([[4, 1], [6]]),
        TokenSupports.from_lists([[2, 3, 9]]),
        TokenSupports.singletons([5, 6, 7]),
    ]
    batch = TrainBatch.from_sequences(
        [[1, 2], [3], [4, 4, 4]], [[4, 6], [9], [5, 6, 7]], rollout_logprobs=[[-0.1, 0.0], [-0.5], [0.0] * 3],
        supports=supports,
    )  # fmt: skip
    # Ragged: one int32 per support id, never [tokens x vocab].
    assert batch.support_ids is not None and batch.support_ids.dtype == torch.int32
    assert batch.support_ids.numel() == sum(s.ids.size for s in supports)
    sub = batch.select(torch.tensor([2, 1]))
    padded = sub.padded_supports()
    assert padded is not None
    ids, valid = padded
    assert ids.shape == (2, 5, 3)  # the widest support of the selection: 3 ids
    got = [[ids[r, t][valid[r, t]].tolist() for t in range(ids.shape[1]) if valid[r, t].any()] for r in range(2)]
    assert got == [[[5], [6], [7]], [[2, 3, 9]]]
    # Supports sit on the positions whose targets are the response tokens.
    targets = sub.input_ids[:, 1:]
    assert bool(((ids == targets[..., None]) & valid).any(-1)[sub.loss_mask].all())


def test_support_logprobs_equal_the_dense_masked_softmax_with_its_gradient() -> None:
    torch.manual_seed(0)
    v = 13
    logits = torch.randn(2, 3, v, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[3, 0, 7], [1, 1, 12]])
    lists = [[3, 5], [0], [7, 2, 9], [], [1, 4, 6, 8], [12, 0]]  # position (0, 0) .. (1, 2); (1, 0) has none
    sup = TokenSupports.from_lists(lists)
    k = 4
    ids = torch.zeros(6, k, dtype=torch.long)
    valid = torch.zeros(6, k, dtype=torch.bool)
    for i, s in enumerate(lists):
        ids[i, : len(s)], valid[i, : len(s)] = torch.tensor(s, dtype=torch.long), True
    lp, ent = support_token_logprobs(logits, targets, ids.view(2, 3, k), valid.view(2, 3, k), with_entropy=True)
    dense = support_mask_from_ids([sup.of(i).tolist() for i in range(6)], v).view(2, 3, v)
    ref_lp, ref_ent = token_logprobs(logits, targets, support_mask=dense, with_entropy=True)
    has = dense.any(-1)
    torch.testing.assert_close(lp[has], ref_lp[has])
    assert ent is not None and ref_ent is not None
    torch.testing.assert_close(ent[has], ref_ent[has])
    assert lp[1, 0].item() == 0.0 and lp[0, 1].item() == 0.0  # no support, and a singleton: log 1
    (g,) = torch.autograd.grad((lp * has).sum() + (ent * has).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref_lp * has).sum() + (ref_ent * has).sum(), logits)
    torch.testing.assert_close(g, g_ref)
    with pytest.raises(ValueError, match="excludes its target"):
        support_token_logprobs(logits, targets.flip(-1), ids.view(2, 3, k), valid.view(2, 3, k))


# ----------------------------------------------------------------------------------------------------------------
# refusals at config load


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.top_p=0.9"], r"rollout: top_p=0.9 needs a positive top_k .* set rollout.top_k"),
        ([*REPLAY, "rollout.temperature=0.7"], r"rollout.temperature=0.7 differs from the trainer's temperature"),
        ([*REPLAY, "train.kl_coef=0.1"], r"train.kl_coef=0.1 adds a KL to the reference policy"),
        ([*REPLAY, "engine.logprobs=recompute"], r"engine.logprobs=recompute re-scores sequences over the full"),
    ],
)
def test_what_replay_cannot_reproduce_is_refused_at_load(workdir: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(workdir / "qs.yaml", overrides)


def test_replay_is_on_exactly_when_a_filter_truncates() -> None:
    assert not RolloutConfig().replays_support
    assert RolloutConfig(top_k=8).replays_support
    assert RolloutConfig(top_k=8, top_p=0.9).replays_support


def test_cli_refuses_top_p_without_top_k_and_writes_nothing(workdir: Path) -> None:
    out = hpcrl("run", "qs.yaml", "rollout.top_p=0.95", "--run-dir", "r", cwd=workdir, check=False)
    assert out.returncode != 0
    assert "hpcrl: error:" in out.stderr and "set rollout.top_k" in out.stderr
    assert not (workdir / "r").exists()


# ----------------------------------------------------------------------------------------------------------------
# the rollout reads supports under both spellings (SGLang 0.5.16's recorded answer, the embedded engine's old names)


class _Answer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, body: Any) -> None:
        super().__init__(("127.0.0.1", 0), _AnswerHandler)
        self.body = body
        self.requests: list[Any] = []


class _AnswerHandler(BaseHTTPRequestHandler):
    server: _Answer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        pass

    def do_GET(self) -> None:  # noqa: N802 - /health
        self._send(b"{}")

    def do_POST(self) -> None:  # noqa: N802 - /generate
        self.server.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self._send(json.dumps(self.server.body).encode())

    def _send(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def answering() -> Iterator[Any]:
    servers: list[_Answer] = []

    def start(body: Any) -> _Answer:
        server = _Answer(body)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _rollout(url: str, model_dir: Path, cfg: RolloutConfig) -> tuple[Rollout, EngineFleet]:
    from transformers import AutoTokenizer

    fleet = EngineFleet(EngineConfig(), [EngineClient(url)], launcher=None, on_event=lambda *_: None)
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(model_dir), DataConfig())
    return Rollout(cfg, fleet, formatter, seed=0), fleet


@pytest.mark.parametrize("spelling", ["sglang-0.5.16", "embedded-before"])
def test_rollout_keeps_the_golden_sglang_supports(answering: Any, tiny_model_dir: Path, spelling: str) -> None:
    exchange = json.loads(GOLDEN.read_text())["exchanges"][0]
    body, sent_params = exchange["response"]["body"], exchange["request"]["body"]["sampling_params"]
    meta = body["meta_info"]
    if spelling == "embedded-before":
        meta["sampling_mask"] = meta.pop("output_token_sampling_mask")
        meta["support_logprobs"] = meta.pop("output_token_sampling_logprobs")
    server = answering([body])  # a batch of one prompt is answered with a list
    cfg = RolloutConfig(
        n_samples_per_prompt=1, max_new_tokens=6, top_k=sent_params["top_k"], top_p=sent_params["top_p"]
    )
    rollout, fleet = _rollout(f"http://127.0.0.1:{server.server_port}", tiny_model_dir, cfg)
    try:
        (group,) = rollout.generate(0, [Example(prompt="1+2=", answer="3")])
    finally:
        rollout.close()
        fleet.close()
    assert server.requests[0]["return_sampling_mask"] is True
    (sample,) = group.samples
    golden = json.loads(GOLDEN.read_text())["exchanges"][0]["response"]["body"]["meta_info"]
    # The behaviour policy's log-prob is the support-normalised one, not the full-vocabulary one.
    assert sample.logprobs == golden["output_token_sampling_logprobs"]
    assert sample.supports == TokenSupports.from_lists(golden["output_token_sampling_mask"])
    stats = rollout_stats([group], 1.0)
    assert stats["rollout/support_size_mean"] == 5.0 and stats["rollout/support_size_max"] == 5.0


def test_rollout_refuses_an_answer_without_supports(answering: Any, tiny_model_dir: Path) -> None:
    body = json.loads(GOLDEN.read_text())["exchanges"][0]["response"]["body"]
    for key in ("output_token_sampling_mask", "output_token_sampling_logprobs", "output_token_sampling_mask_length"):
        del body["meta_info"][key]
    server = answering([body])
    rollout, fleet = _rollout(
        f"http://127.0.0.1:{server.server_port}", tiny_model_dir, RolloutConfig(n_samples_per_prompt=1, top_k=5)
    )
    try:
        with pytest.raises(EngineRequestError, match="without meta_info.output_token_sampling_mask"):
            rollout.generate(0, [Example(prompt="1+2=", answer="3")])
    finally:
        rollout.close()
        fleet.close()


# ----------------------------------------------------------------------------------------------------------------
# the gap of the first update, from identical weights, with and without replay


def _peaked_copy(model_dir: Path, out: Path, scale: float) -> Path:
    """The tiny model with its logits scaled (final norm x scale): peaked enough for top-p to cut inside top-k."""
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * scale
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_first_update_gap_with_replay_is_float_noise_and_without_it_is_not(
    engine_factory: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = _peaked_copy(tiny_model_dir, tmp_path / "peaked", scale=8.0)
    engine = engine_factory("--random-seed", "3", model_dir=model_dir)
    cfg = RolloutConfig(n_samples_per_prompt=8, max_new_tokens=8, temperature=1.0, top_k=8, top_p=0.9)
    rollout, fleet = _rollout(engine.url, model_dir, cfg)
    try:
        groups = rollout.generate(0, [Example(prompt=f"{a}+{a + 3}=", answer=str(2 * a + 3)) for a in range(4)])
    finally:
        rollout.close()
        fleet.close()
    for i, g in enumerate(groups):
        for s, sample in enumerate(g.samples):
            sample.reward = float((i + s) % 3)
    stats = rollout_stats(groups, 1.0)
    assert stats["rollout/support_size_max"] <= 8
    # Some supports cut by top-p inside the top 8, some not: both filters are exercised.
    assert 1 < stats["rollout/support_size_mean"] < 8, stats

    def first_update_gap(groups: list[Group]) -> float:
        trainer = TorchTrainer(TrainConfig(lr=1e-3), model_dir)  # fresh: the weights the engine sampled with
        return trainer.train_grpo(batch_from_groups(groups, normalize_std=True))["train_rollout_logprob_abs_diff"]

    with_replay = first_update_gap(groups)
    # Without replay the trainer scores the full vocabulary against the same behaviour log-probs.
    full_vocab = first_update_gap([Group(g.example, [_without_supports(s) for s in g.samples]) for g in groups])
    print(f"first-update gap: with replay {with_replay:.3e}, full vocabulary without replay {full_vocab:.3e}")
    assert with_replay <= 1e-6
    assert full_vocab > 1e3 * max(with_replay, 1e-9)


def _without_supports(s: Sample) -> Sample:
    return Sample(s.prompt_ids, s.output_ids, s.logprobs, s.text, s.finish, s.weight_versions, s.reward)


# ----------------------------------------------------------------------------------------------------------------
# end to end: `hpcrl run` with top-k/top-p on two trainer ranks


def test_run_with_top_k_top_p_replays_on_every_trainer_rank(workdir: Path) -> None:
    hpcrl("run", "qs.yaml", *SMALL, "num_steps=2", *REPLAY, "train.num_ranks=2", "--run-dir", "r", cwd=workdir)
    m = load_metrics(workdir / "r" / "metrics.h5")
    # The gap is summed over both ranks' tokens: a rank scoring the full vocabulary would show here.
    assert m["train/train_rollout_logprob_abs_diff"].max() <= 1e-6
    assert (m["rollout/support_size_max"] <= 8).all() and (m["rollout/support_size_mean"] >= 1).all()


def test_true_on_policy_holds_through_top_k_top_p_replay(workdir: Path) -> None:
    """engine.batch_invariant with train.logprobs: invariant and top-k/top-p: the engine's support-renormalised
    log-probs and the trainer's are the same bits (engine batches of 5 that shrink and refill, trainer micro-batches
    of 3)."""
    out = hpcrl(
        "run", "qs.yaml", *SMALL, "num_steps=2", *REPLAY, "engine.batch_invariant=true", "train.logprobs=invariant",
        "engine.max_running_requests=5", "engine.deterministic=false", "train.micro_batch_size=3",
        "--run-dir", "r", cwd=workdir,
    )  # fmt: skip
    m = load_metrics(workdir / "r" / "metrics.h5")
    assert (m["train/train_rollout_logprob_abs_diff"] == 0.0).all()
    assert (m["train/train_rollout_logprob_max_abs_diff"] == 0.0).all()
    assert (m["rollout/support_size_mean"] > 1).all() and (m["rollout/support_size_max"] <= 8).all()
    assert "gap 0.00e+00" in out.stdout


def test_a_replay_run_preempted_and_resumed_equals_the_uninterrupted_run(workdir: Path) -> None:
    # The synchronous loop checkpoints no rollout: the resumed steps draw their supports again, from the same seeds.
    args = [*SMALL, *REPLAY]
    hpcrl("run", "qs.yaml", *args, "--run-dir", "full", cwd=workdir)
    proc = signal_at_step(workdir, args, "cut", 3, signal.SIGTERM)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, rest
    out = hpcrl("run", "qs.yaml", *args, "--run-dir", "cut", cwd=workdir)
    assert "resumed from" in out.stdout and "step    6/6" in out.stdout
    full, cut = load_metrics(workdir / "full" / "metrics.h5"), load_metrics(workdir / "cut" / "metrics.h5")
    # Replay was on in both halves of the cut run: supports in every step, the gap float noise.
    assert (cut["rollout/support_size_max"] <= 8).all() and (cut["rollout/support_size_mean"] >= 1).all()
    assert cut["train/train_rollout_logprob_abs_diff"].max() <= 1e-6
    assert_same_metrics(full, cut)  # rewards, losses, gap, support sizes: every step, bit for bit
    a, b = final_weights(workdir / "full"), final_weights(workdir / "cut")
    assert sorted(a) == sorted(b) and all(torch.equal(a[name], b[name]) for name in a)


def test_an_async_replay_run_resumes_its_buffered_supports_and_trains_them(workdir: Path) -> None:
    # Async runs are not bitwise repeatable (arrival order depends on timing), so this checks the path instead:
    # the SIGTERM checkpoint holds the buffered groups' supports, and the resumed run trains those groups with
    # them. A resume that drops them trains the restored groups over the full vocabulary, silently: their steps
    # log no support sizes (NaN), or a batch mixing them with fresh groups is refused.
    args = [*SMALL, *REPLAY, "rollout.mode=async", "buffer.max_staleness=2"]
    proc = signal_at_step(workdir, args, "r", 3, signal.SIGTERM)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, rest
    ckpt = load_latest_checkpoint(workdir / "r" / "checkpoints")
    assert ckpt is not None
    buffer = ckpt.state["rollout_buffer"]
    buffered = [g["position"] for g in buffer["groups"]]
    assert buffered, "the preempted run's checkpoint should hold buffered groups"
    num_tokens = sum(s["output_len"] for g in buffer["groups"] for s in g["samples"])
    offsets = ckpt.tensors["rollout_buffer/support_offsets"]
    assert len(offsets) == num_tokens + 1 and len(ckpt.tensors["rollout_buffer/support_ids"]) == int(offsets[-1])
    out = hpcrl("run", "qs.yaml", *args, "--run-dir", "r", cwd=workdir)
    assert "resumed from" in out.stdout and "step    6/6" in out.stdout
    m = load_metrics(workdir / "r" / "metrics.h5")
    assert list(m["step"]) == list(range(6))
    assert (m["rollout/support_size_max"] <= 8).all() and (m["rollout/support_size_mean"] >= 1).all()
    ledger = json.loads((workdir / "r" / "prompt_ledger.json").read_text())
    trained_at = {p: step for p, status, step in zip(ledger["position"], ledger["status"], ledger["step"], strict=True)
                  if status == "trained"}  # fmt: skip
    resumed = [p for p in buffered if p in trained_at and trained_at[p] >= ckpt.step]
    assert resumed, f"no group restored from the checkpoint was trained: {buffered}, {trained_at}"


# ----------------------------------------------------------------------------------------------------------------
# the Megatron backend: supports joined over the vocab-parallel logits


def test_megatron_vocab_parallel_support_logprobs_and_step_match_the_torch_backend(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two TP ranks, each with half of a padded vocabulary: support-restricted log-probs, entropy and gradients
    equal the single-process computation, and one GRPO step with supports matches the torch backend."""
    from hpcrl.model.qwen3 import ModelArgs
    from tests.unit.megatron_ranks import NO_KL, fixed_batch, with_supports

    result = run_ranks("support", tiny_model_dir, tmp_path, 2, 1, 2)
    got = load_file(tmp_path / "support.safetensors")
    full = got["full"].double()[..., :11].requires_grad_(True)
    lp, ent = support_token_logprobs(full, got["targets"], got["ids"], got["valid"], with_entropy=True)
    assert ent is not None
    (lp.sum() * 0.7 + ent.sum() * 0.3).backward()
    torch.testing.assert_close(got["lp"].double(), lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["ent"].double(), ent.detach(), rtol=1e-5, atol=1e-5)
    assert full.grad is not None
    torch.testing.assert_close(got["grad"].double()[..., :11], full.grad, rtol=1e-5, atol=1e-5)
    assert (got["grad"][..., 11:] == 0).all()

    vocab = ModelArgs.from_dir(tiny_model_dir).vocab_size
    ref = TorchTrainer(TrainConfig(**NO_KL), tiny_model_dir).train_grpo(with_supports(fixed_batch(vocab), vocab))
    (step,) = result["metrics"]
    for key in ("loss", "grad_norm", "entropy", "pg_loss", "train_rollout_logprob_abs_diff"):
        np.testing.assert_allclose(step[key], ref[key], rtol=2e-5, atol=1e-6, err_msg=key)
