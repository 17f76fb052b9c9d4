"""True on-policy on the GPU: the batch-invariant forward on one H200, Qwen3-0.6B shape, bf16.

    PYTHONPATH=. python3 tools/gpu/onpolicy_gpu.py --section bits --out $OUT      # (a) bitwise checks
    PYTHONPATH=. python3 tools/gpu/onpolicy_gpu.py --section run --out $OUT       # (b) 10 colocated steps
    PYTHONPATH=. python3 tools/gpu/onpolicy_gpu.py --section price --out $OUT     # (c) the price, side by side
    # on the CPU, to check the script itself: --device cpu --shape tiny (small and quick)

Each section appends its figures to $OUT/onpolicy_gpu.json under its own key and prints one summary line per
figure, starting with `onpolicy:`.

(a) `bits`: engine-sampled log-probs (a real `Scheduler`, continuous batching with fewer slots than
    requests) against the trainer's `invariant.token_logprobs` on right-padded micro-batches, at batch sizes 1,
    7 and 64; one request alone against the same request in a full batch of 64; prefill against token-by-token
    decode at every position of 70 tokens (three key tiles); in `--dtype` and then fp32 (`--also-fp32`). For
    contrast, the plain engine (CUDA graphs, fused kernels) against the plain trainer forward on the same
    requests: its gap is what train.logprobs: invariant removes. Figures: how many tokens differ, the largest |diff|.
(b) `run`: `hpcrl run experiments/quickstart.yaml engine.batch_invariant=true train.logprobs=invariant` for
    `--steps` colocated steps (engine and trainer on one GPU, sync.transport=tensor), the 0.6B layer shape with
    the character vocabulary (a random model's ids must decode to text for the reward); the gap per step.
(c) `price`: tools/bench/invariant_price.py on this device: engine decode tok/s and trainer forward (and
    forward + backward) time, invariant vs plain, same model and prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LAYERS_0_6B = dict(num_layers=28, hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8, head_dim=128)
LAYERS_TINY = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)


def _record(out: Path, key: str, value: object) -> None:
    """Merge `value` under `key` into $OUT/onpolicy_gpu.json (each section runs as its own process)."""
    path = out / "onpolicy_gpu.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _model_dir(ns: argparse.Namespace, *, full_vocab: bool) -> Path:
    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, ModelShape, TinyModelSpec, init_shaped_model, init_tiny_model

    name = f"{ns.shape}-{'vocab' if full_vocab else 'chars'}"
    path = ns.workdir / name
    if (path / "config.json").exists():
        return path
    if full_vocab:
        shape = QWEN3_0_6B_SHAPE if ns.shape == "qwen3-0.6b" else ModelShape(vocab_size=1000, **LAYERS_TINY)
        return init_shaped_model(path, shape, dtype="float32", device=ns.device)
    dims = LAYERS_0_6B if ns.shape == "qwen3-0.6b" else LAYERS_TINY
    return init_tiny_model(path, TinyModelSpec(**dims, max_position_embeddings=512))


# ----- (a) bits -----
def _requests(n: int, vocab: int, *, seed: int, max_new_tokens: int) -> list:
    from hpcrl.engine.embedded.scheduler import SeqRequest

    rng = random.Random(seed)
    return [
        SeqRequest(
            rid=f"r{i}", prompt_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 30))],
            max_new_tokens=max_new_tokens - i % 4, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1000 + i,
            stop_token_ids=frozenset(), ignore_eos=True, return_logprob=True, return_sampling_mask=False,
            on_done=lambda r: None,
        )
        for i in range(n)
    ]  # fmt: skip


def _generate(model, reqs: list, *, max_running: int, batch_invariant: bool, device, dtype) -> list:  # noqa: ANN001
    import torch

    from hpcrl.engine.config import EngineConfig
    from hpcrl.engine.embedded.scheduler import Scheduler, SchedulerConfig

    engine = EngineConfig(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        max_running_requests=max_running,
        batch_invariant=batch_invariant,
        deterministic=False,  # admit while others run: the decode batch changes size every few steps
    )
    sched = Scheduler(
        model,
        SchedulerConfig(engine=engine, context_length=96),
        device=device,
        dtype=dtype,
    )
    sched.submit(reqs)
    with torch.inference_mode():
        while sched.waiting or sched.running:
            sched._step()
        sched._drain()
    if not all(r.finish_reason is not None for r in reqs):
        raise RuntimeError("a request did not finish")
    return reqs


def _trainer_logprobs(model, reqs: list, micro_batch: int, *, batch_invariant: bool) -> list:  # noqa: ANN001
    import torch

    from hpcrl.model import invariant
    from hpcrl.trainer.logprobs import token_logprobs

    device = next(model.parameters()).device
    out = []
    for start in range(0, len(reqs), micro_batch):
        mb = reqs[start : start + micro_batch]
        width = max(len(r.all_ids) for r in mb)
        ids = torch.tensor([r.all_ids + [0] * (width - len(r.all_ids)) for r in mb], device=device)
        with torch.no_grad():
            if batch_invariant:
                lp = invariant.token_logprobs(model, ids)
            else:
                lp = token_logprobs(model(ids)[:, :-1], ids[:, 1:])[0]
        for i, r in enumerate(mb):
            p = len(r.prompt_ids)
            out.append(lp[i, p - 1 : p - 1 + len(r.output_ids)].cpu())
    return out


def _compare(engine: list, trainer: list) -> dict[str, float]:
    """Tokens whose two log-probs differ in any bit, of all tokens, and the largest |difference|."""
    import torch

    e = torch.cat([torch.tensor(x, dtype=torch.float32) for x in engine])
    t = torch.cat([x.float() for x in trainer])
    diff = (e - t).abs()
    return {"tokens": int(e.numel()), "differing": int((e != t).sum()), "max_abs_diff": float(diff.max())}


def _line(label: str, c: dict[str, float]) -> str:
    verdict = "BITWISE EQUAL" if c["differing"] == 0 else "DIFFER"
    return (
        f"onpolicy: {label}: {verdict} ({c['differing']} of {c['tokens']} tokens differ, "
        f"max |diff| {c['max_abs_diff']:.3g})"
    )


def section_bits(ns: argparse.Namespace) -> dict[str, object]:
    import torch

    from hpcrl.model import invariant
    from hpcrl.model.hf import load_model, parse_dtype
    from hpcrl.model.qwen3 import KVCache

    model_dir = _model_dir(ns, full_vocab=True)
    device = torch.device(ns.device)
    report: dict[str, object] = {}
    ok = True
    for dtype_name in [ns.dtype, *(["float32"] if ns.also_fp32 and ns.dtype != "float32" else [])]:
        dtype = parse_dtype(dtype_name)
        t0 = time.perf_counter()
        model = load_model(model_dir, dtype=dtype, device=device).eval()
        vocab = model.args.vocab_size
        res: dict[str, object] = {}
        batch_sizes = ns.batch_sizes if dtype_name == ns.dtype else [max(ns.batch_sizes)]
        for bs in batch_sizes:
            reqs = _generate(model, _requests(bs, vocab, seed=bs, max_new_tokens=ns.max_new_tokens),
                             max_running=min(bs, 24), batch_invariant=True, device=device, dtype=dtype)  # fmt: skip
            micro = {1: 1, 7: 3}.get(bs, 16)
            c = _compare([r.logprobs for r in reqs], _trainer_logprobs(model, reqs, micro, batch_invariant=True))
            res[f"batch_{bs}_micro_{micro}"] = c
            ok &= c["differing"] == 0
            print(_line(f"{dtype_name} engine vs trainer, batch {bs}, micro-batch {micro}", c), flush=True)
        alone = _generate(model, _requests(1, vocab, seed=5, max_new_tokens=ns.max_new_tokens), max_running=1,
                          batch_invariant=True, device=device, dtype=dtype)[0]  # fmt: skip
        crowd = _requests(64, vocab, seed=6, max_new_tokens=ns.max_new_tokens)
        crowd[37] = _requests(1, vocab, seed=5, max_new_tokens=ns.max_new_tokens)[0]
        full = _generate(model, crowd, max_running=64, batch_invariant=True, device=device, dtype=dtype)[37]
        c = _compare([full.logprobs], [torch.tensor(alone.logprobs)])
        c["same_tokens"] = full.output_ids == alone.output_ids
        res["alone_vs_full_batch_64"] = c
        ok &= c["differing"] == 0 and bool(c["same_tokens"])
        print(_line(f"{dtype_name} a request alone vs in a full batch of 64 (same tokens: {c['same_tokens']})", c))
        # Prefill vs decode: logits of the whole sequence against one position at a time through the KV cache.
        ids = torch.randint(3, vocab, (5, 70), generator=torch.Generator().manual_seed(0)).to(device)
        with torch.no_grad():
            whole = invariant.logits(model, ids)
            cache = KVCache.allocate(model.args, 5, 96, dtype, device)
            steps = [invariant.prefill(model, cache, ids[:, :1], 0, torch.zeros(5, dtype=torch.long, device=device))]
            for pos in range(1, ids.shape[1]):
                steps.append(invariant.decode(model, cache, ids[:, pos], torch.full((5,), pos, device=device)))
            stepped = torch.stack(steps, dim=1)
        bad = int((stepped != whole).any(-1).sum())
        c = {
            "positions": 5 * 70,
            "differing": bad,
            "max_abs_diff": float((stepped.float() - whole.float()).abs().max()),
        }
        res["prefill_vs_decode_70"] = c
        ok &= bad == 0
        print(
            f"onpolicy: {dtype_name} prefill vs decode, 5 rows x 70 positions: "
            f"{'BITWISE EQUAL' if bad == 0 else 'DIFFER'} ({bad} of 350 logit rows differ, "
            f"max |diff| {c['max_abs_diff']:.3g})",
            flush=True,
        )
        if dtype_name == ns.dtype:
            # The contrast: the default engine (fused kernels, CUDA graphs on CUDA) vs the plain trainer forward.
            reqs = _generate(model, _requests(64, vocab, seed=64, max_new_tokens=ns.max_new_tokens), max_running=24,
                             batch_invariant=False, device=device, dtype=dtype)  # fmt: skip
            c = _compare([r.logprobs for r in reqs], _trainer_logprobs(model, reqs, 16, batch_invariant=False))
            res["plain_engine_vs_plain_trainer_batch_64"] = c
            print(_line(f"{dtype_name} PLAIN engine vs plain trainer (the gap on-policy removes), batch 64", c))
        res["wall_s"] = time.perf_counter() - t0
        report[dtype_name] = res
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["all_bitwise_equal"] = ok
    print(f"onpolicy: bits summary: {'all invariant checks BITWISE EQUAL' if ok else 'SOME CHECK DIFFERS'}")
    return report


# ----- (b) run -----
def section_run(ns: argparse.Namespace) -> dict[str, object]:
    from hpcrl.store import load_metrics

    model_dir = _model_dir(ns, full_vocab=False)
    run_dir = ns.workdir / "run-onpolicy"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    overrides = [
        f"model.path={model_dir}", f"num_steps={ns.steps}", "sft.num_steps=0",
        "data.prompts_per_step=16", "rollout.n_samples_per_prompt=8", f"rollout.max_new_tokens={ns.max_new_tokens}",
        f"engine.device={ns.device}", f"train.device={ns.device}", f"engine.dtype={ns.dtype}",
        f"train.dtype={ns.dtype}", "train.micro_batch_size=32", "checkpoint.every_steps=1000000",
        "engine.batch_invariant=true", "train.logprobs=invariant", "guard.mode=off",
        *(["sync.transport=tensor"] if ns.device.startswith("cuda") else []),
        *ns.extra,
    ]  # fmt: skip
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
    log = ns.out / "onpolicy_run.log"
    t0 = time.perf_counter()
    timed_out = False
    with open(log, "w") as f:
        # Its own session, so a stop reaches the engine and trainer processes it started too.
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            code = proc.wait(timeout=ns.run_timeout_s)
        except subprocess.TimeoutExpired:
            # Stop it and report the steps it finished: metrics.h5 gets a row per step as the run goes.
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
    wall_s = time.perf_counter() - t0
    if timed_out:
        print(f"onpolicy: run: stopped after {ns.run_timeout_s:g} s (--run-timeout-s); reporting the steps it finished")
    if code and not (timed_out and (run_dir / "metrics.h5").exists()):
        print(f"onpolicy: run: hpcrl run exited {code}; last lines of {log.name}:")
        print("\n".join(log.read_text().splitlines()[-30:]))
        for extra in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []:
            print(f"--- {extra.name}\n" + "\n".join(extra.read_text().splitlines()[-15:]))
        return {"exit_code": code, "wall_s": wall_s}
    try:
        m = load_metrics(run_dir / "metrics.h5")
    except Exception as e:  # noqa: BLE001 - a run stopped mid-write: say so, keep the other sections' figures
        print(f"onpolicy: run: metrics.h5 unreadable ({e})")
        return {"exit_code": code, "wall_s": wall_s, "timed_out": timed_out}
    gap = [float(x) for x in m["train/train_rollout_logprob_abs_diff"]]
    gap_max = [float(x) for x in m.get("train/train_rollout_logprob_max_abs_diff", [math.nan] * len(gap))]
    out: dict[str, object] = {
        "steps": len(gap), "gap": gap, "gap_max": gap_max, "wall_s": wall_s,
        "step_s": [float(x) for x in m["timing/total_s"]],
        "train_s": [float(x) for x in m["timing/train_s"]] if "timing/train_s" in m else None,
        "reward_mean": [float(x) for x in m["rollout/reward_mean"]], "timed_out": timed_out,
    }  # fmt: skip
    zero = bool(gap) and all(g == 0.0 for g in gap) and all(g == 0.0 for g in gap_max)
    print(f"onpolicy: run: {len(gap)} colocated steps{' with ' + ' '.join(ns.extra) if ns.extra else ''}, gap per "
          f"step {gap}, max gap per step {gap_max}")  # fmt: skip
    if "rollout/support_size_mean" in m:
        sizes = [round(float(x), 2) for x in m["rollout/support_size_mean"]]
        print(f"onpolicy: run: support size mean per step {sizes}")
    if not gap:
        print("onpolicy: run summary: NO STEP FINISHED (see onpolicy_run.log)")
    else:
        median_s = sorted(float(x) for x in m["timing/total_s"])[len(gap) // 2]
        print(f"onpolicy: run summary: gap {'EXACTLY 0.0 at every step' if zero else 'NOT ZERO'} ({len(gap)} steps, "
              f"{ns.dtype} on {ns.device}), median step {median_s:.2f} s")  # fmt: skip
    out["gap_exactly_zero"] = zero
    return out


# ----- (c) price -----
def section_price(ns: argparse.Namespace) -> dict[str, object]:
    path = ns.workdir / "price.json"
    cmd = [sys.executable, str(REPO / "tools/bench/invariant_price.py"), "--device", ns.device, "--dtype", ns.dtype,
           "--shapes", ns.shape, "--num-seqs", str(ns.price_seqs), "--max-new-tokens", str(ns.max_new_tokens),
           "--prompt-len", "32", "--micro-batch", "16", "--repeats", str(ns.repeats), "--threads", "4",
           "--json", str(path)]  # fmt: skip
    code = subprocess.run(cmd, cwd=REPO).returncode
    if code or not path.exists():
        print(f"onpolicy: price: invariant_price.py exited {code}")
        return {"exit_code": code}
    return json.loads(path.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", required=True, choices=["bits", "run", "price"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "tiny"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 7, 64])
    p.add_argument("--also-fp32", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--run-timeout-s", type=float, default=100.0, help="run: stop hpcrl run after this long")
    p.add_argument(
        "--extra", nargs="*", default=[], help="run: more config overrides, e.g. rollout.top_k=64 rollout.top_p=0.95"
    )
    p.add_argument("--price-seqs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hpcrl-onpolicy-gpu"))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/hpcrl-gpu-out")))
    ns = p.parse_args()
    ns.workdir.mkdir(parents=True, exist_ok=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(4 if ns.device.startswith("cuda") else 1)
    t0 = time.perf_counter()
    result = {"bits": section_bits, "run": section_run, "price": section_price}[ns.section](ns)
    result["section_wall_s"] = time.perf_counter() - t0
    _record(ns.out, ns.section, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
