"""The Megatron-core trainer backend on CPU: layout round trip, forward equality, TP/PP steps, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hpcrl.model.hf import iter_safetensors
from hpcrl.model.qwen3 import CausalLM, ModelArgs
from hpcrl.store import load_events, load_metrics
from hpcrl.trainer.config import TrainConfig
from hpcrl.trainer.megatron.layout import Shard, check_parallel_sizes, hf_names, to_hf, to_megatron
from tests.support import (
    REPO,
    SMALL,
    assert_same_metrics,
    hpcrl,
    run_ranks,
    signal_at_step,
)


def random_hf_state(args: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(args).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


QWEN3_TIED_ODD_VOCAB = ModelArgs(
    vocab_size=99, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8
)
QWEN2_UNTIED_BIAS = ModelArgs(
    vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    tie_word_embeddings=False, qk_norm=False, attention_bias=True,
)  # fmt: skip


@pytest.mark.parametrize("args", [QWEN3_TIED_ODD_VOCAB, QWEN2_UNTIED_BIAS], ids=["qwen3-tied", "qwen2-untied-bias"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_to_megatron_to_hf_is_bitwise(args: ModelArgs, tp: int, pp: int) -> None:
    hf = random_hf_state(args)
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        shards = [
            to_megatron(hf.__getitem__, args, Shard(tp_rank=r, tp_size=tp, pp_rank=stage, pp_size=pp,
                                                    num_layers=args.num_layers))
            for r in range(tp)
        ]  # fmt: skip
        # Each TP rank holds a different, equally shaped slice (vocab padded to a multiple of tp).
        assert all(shards[0][k].shape == s[k].shape for s in shards for k in s)
        stage_shard = Shard(pp_size=pp, pp_rank=stage, tp_size=tp, num_layers=args.num_layers)
        back.update(to_hf(lambda n, shards=shards: [s[n] for s in shards], args, stage_shard))
    assert list(back) == hf_names(args)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_split_sizes_that_do_not_fit_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads \\(2\\) is not a multiple of tensor_parallel_size"):
        check_parallel_sizes(QWEN3_TIED_ODD_VOCAB, 4, 1)
    with pytest.raises(ValueError, match="num_hidden_layers \\(4\\) is not a multiple of pipeline_parallel_size"):
        check_parallel_sizes(QWEN3_TIED_ODD_VOCAB, 1, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 is not implemented by backend: torch"):
        TrainConfig(tensor_parallel_size=2, num_ranks=2)
    with pytest.raises(ValueError, match="multiple of tensor_parallel_size x pipeline_parallel_size"):
        TrainConfig(backend="megatron", tensor_parallel_size=2, num_ranks=3)
    with pytest.raises(ValueError, match="logprobs: invariant"):
        TrainConfig(backend="megatron", logprobs="invariant")


def test_distributed_optimizer_on_cpu_is_refused_before_anything_runs(workdir: Path) -> None:
    """Megatron's distributed optimizer needs CUDA: asking for it on CPU names the fix, exits non-zero
    and leaves no run directory behind; `auto` is what CPU runs get."""
    out = hpcrl("run", "qs.yaml", "train.backend=megatron", "train.megatron_optimizer=distributed",
                "--run-dir", "r", cwd=workdir, check=False)  # fmt: skip
    assert out.returncode != 0
    assert "megatron_optimizer: distributed needs CUDA" in out.stderr and "megatron_optimizer: local" in out.stderr
    assert not (workdir / "r").exists()
    with pytest.raises(ValueError, match="megatron_optimizer: local is not implemented by backend: torch"):
        TrainConfig(megatron_optimizer="local")


def test_vocab_parallel_logprobs_equal_the_full_softmax(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two ranks, each with half of a padded vocabulary: log-probs, entropy and gradients equal the
    full-vocabulary computation (float64 autograd) and the padding column gets no probability."""
    run_ranks("logprobs", tiny_model_dir, tmp_path, 2, 1, 2)
    got = load_file(tmp_path / "logprobs.safetensors")
    full = got["full"].double()[..., :11].requires_grad_(True)
    logp = torch.log_softmax(full, dim=-1)
    lp = logp.gather(-1, got["targets"][..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp.sum() * 0.7 + ent.sum() * 0.3).backward()
    torch.testing.assert_close(got["lp"].double(), lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["ent"].double(), ent.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["grad"].double()[..., :11], full.grad, rtol=1e-5, atol=1e-5)
    assert (got["grad"][..., 11:] == 0).all()


def test_fused_head_equals_the_full_softmax(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two ranks, each with half of a padded LM head: log-probs, entropy and the gradients of the hidden states
    and the head from the fused head equal the full-vocabulary computation (float64 autograd); padding rows get
    no probability and no gradient, also where a rank holds padding only."""
    run_ranks("head", tiny_model_dir, tmp_path, 2, 1, 2)
    got = load_file(tmp_path / "head.safetensors")
    for vocab in (11, 5):
        hidden = got["hidden"].double().requires_grad_(True)
        weight = got["weight"].double().requires_grad_(True)
        logp = torch.log_softmax(hidden @ weight[:vocab].t(), dim=-1)
        lp = logp.gather(-1, got[f"{vocab}/targets"][:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        (lp.sum() * 0.7 + ent.sum() * 0.3).backward()
        assert hidden.grad is not None and weight.grad is not None
        torch.testing.assert_close(got[f"{vocab}/lp"].double(), lp.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[f"{vocab}/ent"].double(), ent.detach(), rtol=1e-5, atol=1e-5)
        assert torch.equal(got[f"{vocab}/lp_no_grad"], got[f"{vocab}/lp"])
        torch.testing.assert_close(got[f"{vocab}/grad_hidden"].double(), hidden.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[f"{vocab}/grad_weight"].double(), weight.grad, rtol=1e-5, atol=1e-5)
        assert (got[f"{vocab}/grad_weight"][vocab:] == 0).all()


# Each lever set on a fresh trainer. Compiling costs many seconds per trainer, so each split compiles once, with
# the fused head (a lever set's checks cover both levers it names): one rank, then TP=2 (the TP collectives in the
# graphs, and the head alone); PP=2 (an untied LM head of its own on the last stage) checks the head alone.
LEVERS = {
    "tp1": (1, 1, 1, "plain,head+compile", False),
    "tp2": (2, 1, 2, "plain,head,head+compile", False),
    "pp2-untied": (1, 2, 2, "plain,head", True),
}


@pytest.mark.parametrize("case", list(LEVERS))
def test_fused_head_and_compiled_layers_train_like_the_plain_step(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """train.logprob_chunk_tokens and train.torch_compile on the Megatron backend: one GRPO step (KL to the
    reference, entropy bonus, two micro-batches of different lengths) gives the plain step's loss, statistics and
    gradients (fp32, to rounding). The fused head never runs the output layer, so no [tokens x vocab] logits
    exist; the compiled layers really compile, with no graph break (one would leave the rest of a layer eager)."""
    tp, pp, world, levers, untied = LEVERS[case]
    model_dir = untied_copy(tiny_model_dir, tmp_path / "untied") if untied else tiny_model_dir
    monkeypatch.setenv("HPCRL_TEST_LEVERS", levers)
    result = run_ranks("levers", model_dir, tmp_path / "out", tp, pp, world)
    grads = load_file(tmp_path / "out" / "grads.safetensors")
    plain, plain_ran = result["plain"]["metrics"], result["plain"]["ran"]
    assert plain_ran["logits"] > 0 and plain_ran["fused"] == 0 and plain_ran["graphs"] == 0
    names = [k.removeprefix("plain/") for k in grads if k.startswith("plain/")]
    assert ("lm_head.weight" in names) == untied and "model.embed_tokens.weight" in names
    assert plain["grad_norm"] > 0 and plain["entropy"] > 0
    for lever in levers.split(",")[1:]:
        metrics, ran = result[lever]["metrics"], result[lever]["ran"]
        if "head" in lever:
            assert ran["logits"] == 0 and ran["fused"] > 0, (lever, ran)
        if "compile" in lever:
            assert ran["graphs"] > 0 and ran["breaks"] == 0, (lever, ran)
        for key in ("loss", "pg_loss", "entropy", "train_rollout_logprob_abs_diff"):
            assert metrics[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), (lever, key)
        assert metrics["kl"] == pytest.approx(plain["kl"], abs=1e-7), lever
        assert metrics["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4), lever
        for name in names:
            torch.testing.assert_close(grads[f"{lever}/{name}"], grads[f"plain/{name}"], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, lever=lever, name=name: f"{lever} {name}: {m}")  # fmt: skip


def test_fused_head_and_compile_settings_on_the_megatron_backend() -> None:
    """Both levers are accepted with any TP/PP split; what they cannot serve is refused with the fix."""
    from hpcrl.run_config import load_run_config

    cfg = TrainConfig(backend="megatron", tensor_parallel_size=2, pipeline_parallel_size=2, num_ranks=4,
                      logprob_chunk_tokens=4096, torch_compile=True)  # fmt: skip
    assert cfg.logprob_chunk_tokens == 4096 and cfg.torch_compile
    with pytest.raises(ValueError, match="logprob_chunk_tokens must be >= 1"):
        TrainConfig(backend="megatron", logprob_chunk_tokens=0)
    with pytest.raises(ValueError, match="logprobs: invariant"):
        TrainConfig(backend="megatron", logprobs="invariant", torch_compile=True)
    quickstart = REPO / "experiments" / "quickstart.yaml"
    megatron = ["train.backend=megatron", "train.logprob_chunk_tokens=4096", "train.torch_compile=true"]
    assert load_run_config(quickstart, megatron).train.backend == "megatron"
    # Top-k/top-p replay scores each token's support from the logits: the fused head would not run.
    with pytest.raises(ValueError, match="train.logprob_chunk_tokens .* would not be used"):
        load_run_config(quickstart, [*megatron, "rollout.top_k=20"])


@pytest.fixture(scope="module")
def torch_reference(tiny_model_dir: Path) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """Three GRPO steps of the torch backend on the batch the Megatron ranks use."""
    sys.path.insert(0, str(REPO))
    from hpcrl.trainer.torch_backend import TorchTrainer
    from tests.unit.megatron_ranks import TRAIN, fixed_batch

    trainer = TorchTrainer(TrainConfig(**TRAIN), tiny_model_dir)
    batch = fixed_batch(ModelArgs.from_dir(tiny_model_dir).vocab_size)
    metrics = [trainer.train_grpo(batch) for _ in range(3)]
    return metrics, {k: v.clone() for k, v in trainer.export_weights()}


@pytest.mark.parametrize("tp,pp,world", [(1, 1, 1), (2, 1, 2), (1, 2, 2), (1, 1, 2)], ids=["tp1", "tp2", "pp2", "dp2"])
def test_grpo_steps_match_the_torch_backend(
    tiny_model_dir: Path, tmp_path: Path, torch_reference: tuple, tp: int, pp: int, world: int
) -> None:
    ref_metrics, ref_weights = torch_reference
    result = run_ranks("grpo", tiny_model_dir, tmp_path, tp, pp, world)
    for step, (a, b) in enumerate(zip(ref_metrics, result["metrics"], strict=True)):
        for key in ("loss", "grad_norm", "entropy", "kl", "pg_loss", "train_rollout_logprob_abs_diff"):
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=f"step {step} {key}")
    weights = load_file(tmp_path / "weights.safetensors")
    assert set(weights) == set(ref_weights)
    worst = max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights)
    print(f"TP={tp} PP={pp} ranks={world}: max |w_megatron - w_torch| after 3 steps (lr 1e-2) = {worst:.2e}")
    assert worst < 1e-3


def untied_copy(model_dir: Path, out: Path) -> Path:
    """The tiny model with an LM head of its own (Qwen2/Llama-style untied embeddings)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": False}))
    tensors = dict(iter_safetensors(model_dir))
    g = torch.Generator().manual_seed(5)
    emb = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = emb + 0.05 * torch.randn(emb.shape, generator=g)
    for f in out.glob("*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def test_untied_embeddings_under_pp_match_the_torch_backend(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With PP=2 and untied embeddings the first stage's embedding and the last stage's LM head are two
    weights: neither their gradients nor the gradient norm may treat them as one."""
    from hpcrl.trainer.torch_backend import TorchTrainer
    from tests.unit.megatron_ranks import TRAIN, fixed_batch

    model_dir = untied_copy(tiny_model_dir, tmp_path / "untied")
    batch = fixed_batch(ModelArgs.from_dir(model_dir).vocab_size)
    reference = TorchTrainer(TrainConfig(**TRAIN), model_dir)
    ref_metrics = [reference.train_grpo(batch) for _ in range(3)]
    ref_weights = dict(reference.export_weights())
    result = run_ranks("grpo", model_dir, tmp_path / "out", 1, 2, 2)
    for step, (a, b) in enumerate(zip(ref_metrics, result["metrics"], strict=True)):
        for key in ("loss", "grad_norm", "pg_loss"):
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=f"step {step} {key}")
    weights = load_file(tmp_path / "out" / "weights.safetensors")
    assert "lm_head.weight" in weights
    assert max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights) < 1e-3


def test_forward_equals_transformers(tiny_model_dir: Path) -> None:
    """The Megatron GPTModel built from the HF dir gives transformers' logits (fp32, CPU)."""
    code = f"""
import torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from hpcrl.model.hf import iter_safetensors
from hpcrl.model.qwen3 import ModelArgs
from hpcrl.trainer.megatron.layout import Shard, to_megatron
from hpcrl.trainer.megatron.model import build_gpt_model, init_parallel_state
d = {str(tiny_model_dir)!r}
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
init_parallel_state(1, 1)
args = ModelArgs.from_dir(d)
hf = dict(iter_safetensors(d))
m = build_gpt_model(args, tp_size=1, pp_size=1, pp_rank=0, dtype=torch.float32, device=torch.device("cpu"))
m.load_state_dict(to_megatron(hf.__getitem__, args, Shard(num_layers=args.num_layers)), strict=False)
ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
ids = torch.randint(0, args.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ours = m(ids, torch.arange(40).expand(3, 40), None)[..., :args.vocab_size]
    theirs = ref(ids).logits
print("max_abs_diff", float((ours - theirs).abs().max()), "max_abs", float(theirs.abs().max()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("max_abs_diff"))
    print(line)
    diff, scale = float(line.split()[1]), float(line.split()[3])
    assert scale > 0.1 and diff < 1e-5


def test_bf16_weights_leave_in_one_dtype_and_checkpoints_keep_fp32_norms(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Megatron keeps norm weights in fp32 under bf16: the push must still send the model dtype alone (mixed
    dtypes cut it into a bucket per dtype run), while the checkpoint keeps the fp32 values (PP=2 moves them)."""
    result = run_ranks("bf16", tiny_model_dir, tmp_path, 1, 2, 2)
    assert result["pushed"] == ["torch.bfloat16"]
    assert result["saved"]["model/model.layers.0.self_attn.q_proj.weight"] == "torch.bfloat16"
    assert result["saved"]["model/model.norm.weight"] == "torch.float32"  # from the last stage


def test_checkpoint_moves_between_splits(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A TP=2 checkpoint (HF layout, Adam moments included) resumes on one rank: same weights, same next step."""
    result = run_ranks("reshard", tiny_model_dir, tmp_path, 2, 1, 2)
    assert result["restored_equal"]
    for key in ("loss", "grad_norm", "train_rollout_logprob_abs_diff"):
        np.testing.assert_allclose(result["next_single"][key], result["next_sharded"][key], rtol=2e-5, err_msg=key)


def test_checkpoint_resumes_under_the_same_split(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two data-parallel ranks: a fresh trainer that loads the checkpoint holds the same weights and
    takes exactly the step the original took next."""
    result = run_ranks("resume", tiny_model_dir, tmp_path, 1, 1, 2)
    assert result["optimizer"] == "local" and result["restored_equal"]
    timing = ("forward_s",)
    assert {k: v for k, v in result["next_resumed"].items() if k not in timing} == {
        k: v for k, v in result["next"].items() if k not in timing
    }
    assert result["after_max_abs_diff"] == 0.0


MEGATRON_TP2 = ["train.backend=megatron", "train.num_ranks=2", "train.tensor_parallel_size=2"]


def test_megatron_run_killed_and_rerun_equals_an_uninterrupted_run(workdir: Path) -> None:
    """`hpcrl run` with TP=2 over two trainer processes: SIGKILL after a checkpoint, rerun, same result."""
    import signal

    args = [*SMALL, "num_steps=4", *MEGATRON_TP2]
    hpcrl("run", "qs.yaml", *args, "--run-dir", "full", cwd=workdir)
    proc = signal_at_step(workdir, args, "cut", 3, signal.SIGKILL)
    proc.wait(30)
    out = hpcrl("run", "qs.yaml", *args, "--run-dir", "cut", cwd=workdir)
    assert "resumed from" in out.stdout
    full = load_metrics(workdir / "full" / "metrics.h5")
    assert full["train/train_rollout_logprob_abs_diff"].max() < 1e-4
    assert_same_metrics(full, load_metrics(workdir / "cut" / "metrics.h5"))
    a, b = (load_file(workdir / run / "model" / "model.safetensors") for run in ("full", "cut"))
    assert sorted(a) == sorted(b) == sorted(name for name, _ in iter_safetensors(workdir / "full" / "model"))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert "resumed" in [e["kind"] for e in load_events(workdir / "cut" / "metrics.h5")]
    # The TP=2 run goes on under one rank without TP: its checkpoint is in HF layout.
    single = [*SMALL, "num_steps=5", "train.backend=megatron"]
    out = hpcrl("run", "qs.yaml", *single, "--run-dir", "full", cwd=workdir)
    assert "resumed from" in out.stdout and "step    5/5" in out.stdout
    resumed = load_metrics(workdir / "full" / "metrics.h5")
    assert list(resumed["step"]) == list(range(5))
    assert_same_metrics({k: v[:4] for k, v in resumed.items()}, full)
    assert resumed["train/train_rollout_logprob_abs_diff"][4] < 1e-4
