"""Median time of one GRPO step of a fixed workload, by phase, against a named baseline in the same run.

    python tools/bench/step_time.py [--steps 20] [--threads 2] [--device cpu|cuda] [--shape bench|qwen3-0.6b]

Workload: a Qwen3-shaped model (hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 512,
character vocabulary); 16 prompts x 8 samples; <= 8 new tokens at temperature 1; one optimizer step per
rollout; 2 torch threads. hpcrl's step includes everything: HTTP round trips to a real engine process,
the weight push and HDF5 logging. Target on a 2-core machine: median step <= 0.5 s.

Baseline "hf-inproc": the same step done the plain way in one process — transformers `generate`
(num_return_sequences=8) for the rollout, the same reward, one forward/backward + AdamW step of the
transformers model; no engine, no weight push, no logging.

Peer "trl": `--peer trl [--rounds 3]` runs TRL 1.16's GRPOTrainer (tools/bench/trl_peer.py) on
the same model dir and the same prompts (those of hpcrl's steps, in order), alternating with hpcrl, round by
round, and prints s/step of both per round. TRL lives in its own venv (`--trl-venv`, default /tmp/trl-venv),
made on first use with `pip install trl==1.16.*`; that venv sees this interpreter's site-packages through
a .pth file, so both sides run the very same torch and transformers builds. Target: hpcrl <= 0.8x TRL.

LoRA: `--lora` trains rank-16 (alpha 32) adapters on every linear layer of the decoder layers instead of the model,
on both sides: hpcrl's `converters: [lora]`, TRL with a peft LoraConfig of the same rank, alpha and targets, at the
same learning rate (`--lr`, 1e-3 with --lora, the quickstart's LoRA rate). `--model DIR` runs on an existing model
dir instead of a random one; the rewards mean something only from a warm start:

    hpcrl run experiments/quickstart.yaml num_steps=0 --run-dir runs/quickstart-sft
    python tools/bench/step_time.py --peer trl --lora --model runs/quickstart-sft/model --rounds 2 --steps 20

With --peer trl the table also gives each side's mean reward of its first 5 and last 5 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {
    "bench": dict(num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64),
    "qwen3-0.6b": dict(
        num_layers=28, hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8, head_dim=128
    ),
}
PHASES = ("rollout", "reward", "logprob", "train", "sync", "checkpoint", "total")


def hpcrl_step_times(model_dir: Path, run_dir: Path, ns: argparse.Namespace) -> dict[str, list[float]]:
    overrides = [
        f"model.path={model_dir}",
        f"num_steps={ns.steps}",
        "sft.num_steps=0",
        "data.prompts_per_step=16",
        "rollout.n_samples_per_prompt=8",
        "rollout.max_new_tokens=8",
        "rollout.temperature=1.0",
        f"train.num_threads={ns.threads}",
        f"engine.num_threads={ns.threads}",
        f"train.device={ns.device}",
        f"engine.device={ns.device}",
        f"engine.dtype={ns.dtype}",
        f"train.dtype={ns.dtype}",
        "train.micro_batch_size=128",
        "checkpoint.every_steps=1000000",
        f"train.backend={ns.backend}",
    ]
    if ns.colocate:
        overrides.append("sync.transport=tensor")
    if ns.lr is not None:
        overrides.append(f"train.lr={ns.lr}")
    if ns.lora:
        overrides += [
            "train.converters=[lora]",
            f"train.lora.rank={ns.lora_rank}",
            f"train.lora.alpha={ns.lora_alpha}",
            "train.lora.target_modules="
            + (ns.lora_targets if ns.lora_targets == "all-linear" else f"[{ns.lora_targets}]"),
        ]
    overrides += ns.set
    cmd = [
        sys.executable,
        "-m",
        "hpcrl.cli",
        "run",
        "experiments/quickstart.yaml",
        *overrides,
        "--run-dir",
        str(run_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(ns.threads)}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL if ns.quiet else None)
    if proc.returncode:
        for log in sorted((run_dir / "logs").glob("*.log")):
            print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text().splitlines()[-25:]), file=sys.stderr)
        raise SystemExit(f"hpcrl run exited with {proc.returncode}")
    from hpcrl.store import load_metrics

    m = load_metrics(run_dir / "metrics.h5")
    warm = slice(3, None)  # the first steps pay one-time costs (allocator warm-up, first push)
    gap = m["train/train_rollout_logprob_abs_diff"]
    print(
        f"train_rollout_logprob_abs_diff ({ns.backend} trainer vs engine): mean {gap.mean():.3e}, max {gap.max():.3e}"
    )
    # Step 0 trains on the same rollout whatever the trainer split (same weights, same seed): its loss
    # compares splits on the same data.
    print(f"step 0 ({' '.join(ns.set) or 'default split'}): loss {m['train/loss'][0]:.6e}, "
          f"grad_norm {m['train/grad_norm'][0]:.6e}, gap {gap[0]:.6e}")  # fmt: skip
    out = {p: m[f"timing/{p}_s"][warm].tolist() for p in PHASES if f"timing/{p}_s" in m}
    # Orchestration overhead: what the step spends outside every phase it times. Parts
    # timed inside a phase (logprob inside train, sync_send inside sync) are counted once, in their phase.
    from hpcrl.report.summary import parent_phase, phase_names

    found = phase_names(m.keys())
    tops = [p for p in found if p != "total" and parent_phase(p, found) is None]
    covered = sum(np.nan_to_num(m[f"timing/{p}_s"], nan=0.0) for p in tops)
    out["other"] = (m["timing/total_s"] - covered)[warm].tolist()
    print(f"phases summed for the overhead: {', '.join(tops)}")
    out["reward_mean"] = m["rollout/reward_mean"].tolist()  # every step's, not only the timed ones
    return out


def baseline_step_times(model_dir: Path, ns: argparse.Namespace) -> dict[str, list[float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.rollout.data import PromptSource, make_addition_task
    from hpcrl.rollout.rewards import arithmetic_answer
    from hpcrl.trainer.advantage import group_advantages
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.logprobs import token_logprobs
    from hpcrl.trainer.loss import PolicyLossConfig, policy_loss

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[ns.dtype]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(ns.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = PromptSource(make_addition_task(5000, 2, 0), batch_size=16, seed=0)
    times: dict[str, list[float]] = {p: [] for p in ("rollout", "reward", "train", "total")}
    for step in range(ns.steps):
        t0 = time.perf_counter()
        examples = data.batch(step)
        prompts = [tok.encode(e.prompt, add_special_tokens=False) for e in examples]
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts], device=ns.device)
        mask = (
            torch.arange(width, device=ns.device)[None]
            >= torch.tensor([width - len(p) for p in prompts], device=ns.device)[:, None]
        ).long()
        model.eval()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=8,
                num_return_sequences=8, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        t1 = time.perf_counter()
        responses = [row[width:].tolist() for row in out]
        responses = [r[: r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r for r in responses]
        rewards = [
            arithmetic_answer(tok.decode(r, skip_special_tokens=True), examples[i // 8].answer)
            for i, r in enumerate(responses)
        ]
        t2 = time.perf_counter()
        adv = group_advantages(torch.tensor(rewards).view(16, 8)).flatten()
        batch = TrainBatch.from_sequences(
            [prompts[i // 8] for i in range(128)], [r or [0] for r in responses], advantages=adv.tolist()
        )
        batch = batch.to(ns.device)
        model.train()
        logits = model(batch.input_ids).logits
        lp, ent = token_logprobs(logits[:, :-1], batch.input_ids[:, 1:], with_entropy=True)
        loss, _ = policy_loss(lp, lp.detach(), batch.advantages, batch.loss_mask, PolicyLossConfig(), entropy=ent)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ns.device.startswith("cuda"):
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        if step >= 3:
            for k, v in (("rollout", t1 - t0), ("reward", t2 - t1), ("train", t3 - t2), ("total", t3 - t0)):
                times[k].append(v)
    return times


TRL_VERSION = "1.16.*"
QUICKSTART_LR = 5e-4
"""train.lr of experiments/quickstart.yaml: hpcrl's rate when --lr is not given, and so TRL's too."""


def trl_python(venv: Path) -> Path:
    """The python of a venv with trl, made on first use; it imports torch and transformers from ours."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    print(f"installing trl=={TRL_VERSION} into {venv} (once)", flush=True)
    # The same base interpreter as ours: the .pth below makes our (version-specific) packages importable.
    subprocess.run([str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "venv", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir()]
    (site / "hpcrl-bench-base.pth").write_text("\n".join(ours) + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
    return python


def step_prompts(num_steps: int) -> dict[str, list[str]]:
    """The prompts (and answers) of hpcrl's first `num_steps` steps under experiments/quickstart.yaml, in order."""
    from hpcrl.rollout.data import PromptSource, make_addition_task

    data = PromptSource(make_addition_task(5000, 2, 0), batch_size=16, seed=0)
    examples = [e for step in range(num_steps) for e in data.batch(step)]
    return {"prompts": [e.prompt for e in examples], "answers": [e.answer for e in examples]}


def trl_step_times(model_dir: Path, tmp: Path, ns: argparse.Namespace) -> dict[str, list[float]]:
    import json

    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(step_prompts(ns.steps)))
    here = Path(__file__).resolve()
    cmd = [str(trl_python(Path(ns.trl_venv))), str(here.with_name("trl_peer.py")), "--model", str(model_dir)]
    cmd += ["--prompts", str(prompts), "--steps", str(ns.steps), "--threads", str(ns.threads)]
    cmd += ["--lr", str(ns.lr if ns.lr is not None else QUICKSTART_LR)]
    if ns.lora:
        cmd += ["--lora-rank", str(ns.lora_rank), "--lora-alpha", str(ns.lora_alpha), "--lora-targets", ns.lora_targets]
    env = {**os.environ, "OMP_NUM_THREADS": str(ns.threads), "PYTHONPATH": str(here.parents[2])}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the TRL peer exited with {out.returncode}:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"total": result["total"], "reward_mean": result["reward_mean"]}


def peer_rounds(model_dir: Path, tmp: Path, ns: argparse.Namespace) -> int:
    rows = []
    for r in range(ns.rounds):
        ours = hpcrl_step_times(model_dir, tmp / f"run{r}", ns)
        trl = trl_step_times(model_dir, tmp, ns)
        rows.append((r + 1, ours, trl))
        print(
            f"round {r + 1}: hpcrl {statistics.median(ours['total']):.3f} s/step, "
            f"TRL {statistics.median(trl['total']):.3f} s/step",
            flush=True,
        )
    what = f"LoRA rank {ns.lora_rank} alpha {ns.lora_alpha} on {ns.lora_targets}" if ns.lora else "full fine-tuning"
    lr = ns.lr if ns.lr is not None else QUICKSTART_LR
    print(
        f"\nGRPO step, {what}, lr {lr:g}, model {ns.model or 'shape=' + ns.shape}, threads={ns.threads}, 16 prompts x "
        f"8 samples x <=8 tokens, median over {ns.steps - 3} steps (first 3 dropped), hpcrl and TRL {TRL_VERSION} "
        "alternating; reward: mean of the step's 128 samples, first 5 and last 5 steps"
    )
    print(
        "| round | hpcrl (s/step) | TRL GRPOTrainer (s/step) | hpcrl / TRL | hpcrl reward first 5 -> last 5 "
        "| TRL reward first 5 -> last 5 |\n|---|---|---|---|---|---|"
    )
    ratios = []
    for r, ours, trl in rows:
        a, b = statistics.median(ours["total"]), statistics.median(trl["total"])
        ratios.append(a / b)
        print(f"| {r} | {a:.3f} | {b:.3f} | {a / b:.2f} | {_rewards(ours)} | {_rewards(trl)} |")
    ratio = statistics.median(ratios)
    print(f"median hpcrl / TRL: {ratio:.2f} (target <= 0.80: {'met' if ratio <= 0.8 else 'NOT met'})")
    return 0


def _rewards(times: dict[str, list[float]]) -> str:
    r = times["reward_mean"]
    return f"{statistics.fmean(r[:5]):.3f} -> {statistics.fmean(r[-5:]):.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--shape", default="bench", choices=sorted(SHAPES))
    ap.add_argument(
        "--colocate", action="store_true", help="push weights by same-host handover (sync.transport=tensor)"
    )
    ap.add_argument("--backend", default="torch", choices=["torch", "megatron"], help="trainer backend")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="extra config override, e.g. --set train.num_ranks=2 --set train.tensor_parallel_size=2",
    )  # fmt: skip
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--peer", choices=["trl"], help="compare with TRL's GRPOTrainer in rounds instead")
    ap.add_argument("--rounds", type=int, default=3, help="--peer: alternating hpcrl/peer rounds")
    ap.add_argument("--trl-venv", default="/tmp/trl-venv", help="--peer trl: venv holding trl (made if missing)")
    ap.add_argument("--model", type=Path, help="an existing model dir instead of a random one of --shape")
    ap.add_argument(
        "--lr", type=float, help=f"learning rate of both sides (default: the quickstart's, {QUICKSTART_LR})"
    )
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters instead of the model (both sides)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--lora-targets", default="all-linear", help="all-linear, or comma-separated names: q_proj,v_proj")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the per-step phase times here")
    ns = ap.parse_args()
    if ns.lora and ns.lr is None:
        ns.lr = 1e-3  # experiments/quickstart-lora.yaml's rate: adapters want a larger one
    torch.set_num_threads(ns.threads)
    from hpcrl.model.tiny import TinyModelSpec, init_tiny_model

    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-") as tmp:
        model_dir = (
            ns.model.resolve()
            if ns.model
            else init_tiny_model(Path(tmp) / "model", TinyModelSpec(**SHAPES[ns.shape], max_position_embeddings=512))
        )
        if ns.peer == "trl":
            if ns.device != "cpu" or ns.dtype != "float32" or ns.backend != "torch":
                raise SystemExit("--peer trl compares the CPU float32 torch step: drop --device/--dtype/--backend")
            return peer_rounds(model_dir, Path(tmp), ns)
        ours = hpcrl_step_times(model_dir, Path(tmp) / "run", ns)
        base = {} if ns.no_baseline else baseline_step_times(model_dir, ns)
    med = {k: statistics.median(v) for k, v in ours.items()}
    bmed = {k: statistics.median(v) for k, v in base.items()}
    print(
        f"\nGRPO step, shape={ns.shape} device={ns.device} dtype={ns.dtype} threads={ns.threads} "
        f"16 prompts x 8 samples x <=8 tokens, median over {ns.steps - 3} steps (first 3 dropped)"
    )
    print("| phase | hpcrl (s) | baseline hf-inproc (s) |\n|---|---|---|")
    for p in (*PHASES[:-1], "other", "total"):
        if p in med:
            b = f"{bmed[p]:.3f}" if p in bmed else "—"
            print(f"| {p} | {med[p]:.3f} | {b} |")
    share = statistics.median(o / t for o, t in zip(ours["other"], ours["total"], strict=True) if t > 0)
    print(
        f"overhead: step time minus the sum of its phases, median {med['other']:.4f} s = {share:.2%} of the step "
        f"(median over steps; target <= 2%: {'met' if share <= 0.02 else 'NOT met'})"
    )
    if ns.json is not None:
        ns.json.write_text(json.dumps({"setup": {k: str(v) for k, v in vars(ns).items()}, "hpcrl": ours,
                                       "baseline": base, "overhead_share": share}, indent=1))  # fmt: skip
    print(f"target: median hpcrl step <= 0.5 s on 2 CPU cores -> {'met' if med['total'] <= 0.5 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
