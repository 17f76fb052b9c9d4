#!/usr/bin/env python3
"""LoRA on the GPU machine: push bytes and seconds, SGLang's adapter path against the merged push, and LoRA runs.

    source .sglang/activate.sh .sglang/sglang-site.tar.xz && export PYTHONPATH=$PWD:$PYTHONPATH
    python3 tools/gpu/lora_gpu.py --out $OUT/lora [--sections push,sglang,quickstart] [--steps 8]

Sections (they run at once; about 5-6 minutes on one H100 or H200, most of it SGLang's two start-ups):
- push: the Qwen3-0.6B shape in bf16 (random init, hpcrl.model.tiny.init_shaped_model) with rank-16 adapters
  (alpha 32) on every linear layer, on CUDA: the bytes of an adapter-only push against a full one, the trainer's
  collection of each, and the embedded engine's apply strategies on a CUDA copy of the weights (`replace` of every
  weight against `lora`, the merge of the first version and of the steady state), the merged weight checked equal
  to the trainer's bit for bit.
- sglang: stock SGLang with `--enable-lora` on that model. The adapter path (hpcrl's peft export written, then
  /load_lora_adapter of it under a new name) against the merged push (every merged weight through hpcrl's SGLang
  push, update_weights_from_tensor), in seconds; and for each, the train/rollout log-prob gap: SGLang's log-probs
  of 8 prompts x 32 sampled tokens (with lora_path naming the adapter, or none after the merged push) against the
  trainer's log-probs of the same tokens (hpcrl's model with its adapters, bf16, the merged weights).
- quickstart: experiments/quickstart-lora.yaml from the quickstart's SFT start (made first, on the GPU) for --steps
  steps, on the embedded engine (engine.device=cuda train.device=cuda) and on stock SGLang colocated (the flags of
  tools/gpu/run_sglang_gpu.sh's quickstart), printing the mean reward and the gap per step.
Writes lora_gpu.json (every figure) and the runs' logs to --out; prints a results table. Exit 1 if a section failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RANK, ALPHA = 16, 32.0
SGLANG_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                "--max-total-tokens", "16384"]  # fmt: skip
MIB = 2**20
DEADLINE = time.monotonic() + 400.0  # main() sets it from --budget-s: runs get what is left, the JSON is written
DEVICE = "cuda"  # every section runs on the GPU (a CPU smoke run of the push section may set "cpu")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any) -> tuple[Any, float]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def shaped_model(workdir: Path) -> Path:
    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, init_shaped_model

    model_dir = workdir / "qwen3-0.6b-shape"
    if not (model_dir / "config.json").is_file():
        init_shaped_model(model_dir, QWEN3_0_6B_SHAPE, dtype="bfloat16", device=DEVICE, overwrite=True)
    return model_dir


def lora_model(model_dir: Path, seed: int = 1) -> tuple[Any, Any]:
    """hpcrl's model on CUDA in bf16 with rank-16 adapters whose B is drawn at random (as after some steps)."""
    from hpcrl.model.hf import load_model
    from hpcrl.trainer.config import LoRAConfig, TrainConfig
    from hpcrl.trainer.converters.lora import LoRA

    cfg = TrainConfig(dtype="bfloat16", device=DEVICE, converters=("lora",), lora=LoRAConfig(rank=RANK, alpha=ALPHA))
    model = load_model(model_dir, dtype=torch.bfloat16, device=torch.device(DEVICE))
    lora = LoRA(cfg)
    lora.convert(model)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():
        for layer in lora.layers.values():
            w = layer.lora_B.weight
            w.copy_(torch.randn(w.shape, generator=gen, device=DEVICE) * 0.01)
    return model, lora


# ----- push: adapter-only against full, into the embedded engine's weights on CUDA -----


def section_push(workdir: Path) -> dict[str, Any]:
    from hpcrl.engine.embedded.apply import MergeLoRA, Replace

    model_dir = shaped_model(workdir)
    model, lora = lora_model(model_dir)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    full, full_collect_s = timed(lambda: list(lora.export_state(model, state).items()))
    adapters, lora_collect_s = timed(lambda: list(lora.push_state(model, state).items()))
    with lora.reference(model):  # the weights as loaded: what an engine serves before its first push
        loaded = [(n, t.detach().clone()) for n, t in lora.export_state(model, state).items()]
    replaced = {n: t.clone() for n, t in loaded}
    _, replace_s = timed(lambda: Replace().apply(replaced, full))
    served = dict(loaded)  # the lora strategy keeps a host copy of each adapted weight as loaded, merges into it
    merge = MergeLoRA()
    _, merge_first_s = timed(lambda: merge.apply(served, adapters))
    steady = [timed(lambda: merge.apply(served, adapters))[1] for _ in range(3)]
    name = next(iter(lora.layers))
    exact = torch.equal(served[f"{name}.weight"], lora.layers[name].weight.detach())
    nbytes = lambda named: sum(t.numel() * t.element_size() for _, t in named)  # noqa: E731
    return {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, 
        "model": "Qwen3-0.6B shape, bf16, random", "rank": RANK,
        "adapted_layers": len(lora.layers), "full_push_mib": nbytes(full) / MIB,
        "lora_push_mib": nbytes(adapters) / MIB,
        "full_collect_s": full_collect_s, "lora_collect_s": lora_collect_s, "engine_replace_s": replace_s,
        "engine_merge_first_s": merge_first_s, "engine_merge_steady_s": statistics.median(steady),
        "host_base_copy_mib": sum(t.numel() * t.element_size() for t in merge.base.values()) / MIB,
        "merged_equals_trainer": exact,
    }  # fmt: skip


# ----- sglang: the adapter path against the merged push -----


def launch_sglang(model_dir: Path, port: int, log: Path, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--skip-server-warmup", "--mem-fraction-static", "0.9", *SGLANG_FLAGS,
           *extra]  # fmt: skip
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"SGLang exited with {proc.returncode} during start-up")
        try:
            if httpx.get(url + "/health", timeout=5.0, trust_env=False).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"SGLang did not answer /health within {timeout_s:.0f} s")


def trainer_logprobs(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output], device=DEVICE)
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    return lp.tolist()


def gap_of(model: Any, adapters: Any, lora_name: str | None, prompts: list[list[int]]) -> dict[str, float]:
    diffs: list[float] = []
    for i, prompt in enumerate(prompts):
        output, engine_lp = adapters.generate(prompt, lora_name, max_new_tokens=32, seed=100 + i)
        trainer_lp = trainer_logprobs(model, prompt, output)
        diffs += [abs(a - b) for a, b in zip(engine_lp, trainer_lp, strict=True)]
    return {"mean_abs_gap": sum(diffs) / len(diffs), "max_abs_gap": max(diffs), "tokens": len(diffs)}


def section_sglang(workdir: Path, out: Path) -> dict[str, Any]:
    from hpcrl.engine.client import EngineClient
    from hpcrl.sync.config import SyncConfig
    from hpcrl.sync.push import WeightSync
    from hpcrl.trainer.converters.lora import write_peft_adapter

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling client
    from sglang_lora_client import LORA_SERVER_ARGS, SGLangAdapters

    model_dir = shaped_model(workdir)
    # Two servers, started at once: one with SGLang's LoRA path, one as a run starts it (the merged push).
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
    lora_url, plain_url = (f"http://127.0.0.1:{p}" for p in ports)
    flags = [*LORA_SERVER_ARGS, "--max-lora-rank", str(RANK), "--max-loras-per-batch", "1"]
    procs = [
        launch_sglang(model_dir, ports[0], out / "sglang_lora_server.log", flags),
        launch_sglang(model_dir, ports[1], out / "sglang_plain_server.log", ["--enable-memory-saver"]),
    ]
    report: dict[str, Any] = {}
    try:
        model, lora = lora_model(model_dir)  # while SGLang starts
        model.eval()
        report["startup_s"] = [wait_up(lora_url, procs[0]), wait_up(plain_url, procs[1])]
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 99, (16,), generator=gen).tolist() for _ in range(8)]

        adapters = SGLangAdapters(lora_url)

        def adapter_path(version: int) -> list[str]:
            path = write_peft_adapter(lora, workdir / "adapters" / f"v{version}", base_model=str(model_dir))
            return adapters.load(f"policy-v{version}", str(path))

        _, report["adapter_load_first_s"] = timed(lambda: adapter_path(1))
        _, report["adapter_load_s"] = timed(lambda: adapter_path(2))  # a new version under a new name
        adapters.unload("policy-v1")
        report["adapter_bytes_mib"] = (workdir / "adapters" / "v2" / "adapter_model.safetensors").stat().st_size / MIB
        report["adapter_gap"] = gap_of(model, adapters, "policy-v2", prompts)
        print(f"sglang adapter path: {report['adapter_gap']}", flush=True)
        adapters.close()

        client = EngineClient(plain_url, timeout_s=300)
        weights = WeightSync(SyncConfig(transport="tensor"), [client], device=torch.device(DEVICE), colocated=True,
                             engine_kind="sglang")  # fmt: skip
        weights.connect()
        state = {k: v.detach() for k, v in model.state_dict().items()}
        merged = list(lora.export_state(model, state).items())
        report["merged_bytes_mib"] = sum(t.numel() * t.element_size() for _, t in merged) / MIB
        pushes = [timed(lambda v=v: weights.push(merged, v))[1] for v in (1, 2)]
        report["merged_push_first_s"], report["merged_push_s"] = pushes
        plain = SGLangAdapters(plain_url)  # its generate with no adapter named: the served (merged) weights
        report["merged_gap"] = gap_of(model, plain, None, prompts)
        print(f"sglang merged push: {report['merged_gap']}", flush=True)
        weights.close()
        plain.close()
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):  # a server that failed its start is gone already
                os.killpg(proc.pid, 15)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
    return report


# ----- quickstart: LoRA runs on the embedded engine and on SGLang -----


def hpcrl_run(args: list[str], log: Path, timeout_s: float) -> int:
    timeout_s = max(10.0, min(timeout_s, DEADLINE - time.monotonic()))
    with open(log, "wb") as f:
        try:
            return subprocess.run([sys.executable, "-m", "hpcrl.cli", "run", *args], stdout=f, stderr=subprocess.STDOUT,
                                  cwd=REPO, timeout=timeout_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            return 124


def run_metrics(run_dir: Path) -> dict[str, list[float]]:
    from hpcrl.store.metrics import load_metrics

    path = run_dir / "metrics.h5"
    if not path.is_file():
        return {}
    m = load_metrics(path)
    keys = {"reward": "rollout/reward_mean", "gap": "train/train_rollout_logprob_abs_diff",
            "gap_max": "train/train_rollout_logprob_max_abs_diff", "step_s": "time/step_s"}  # fmt: skip
    return {short: [float(x) for x in m[key]] for short, key in keys.items() if key in m}


def section_quickstart(workdir: Path, out: Path, steps: int) -> dict[str, Any]:
    sft = workdir / "quickstart-sft"
    report: dict[str, Any] = {}
    if not (sft / "model" / "config.json").is_file():
        t0 = time.monotonic()
        rc = hpcrl_run(["experiments/quickstart.yaml", "num_steps=0", "engine.device=cuda", "train.device=cuda",
                        "--run-dir", str(sft)], out / "quickstart_sft.log", 200)  # fmt: skip
        report["sft"] = {"rc": rc, "seconds": time.monotonic() - t0}
        if rc != 0:
            return report
    common = ["experiments/quickstart-lora.yaml", f"model.path={sft / 'model'}", f"num_steps={steps}",
              "engine.device=cuda", "train.device=cuda", "checkpoint.every_steps=1000"]  # fmt: skip
    sglang_args = json.dumps(SGLANG_FLAGS)
    variants = {
        "embedded": common,
        "sglang": [*common, "engine.kind=sglang", "engine.dtype=bfloat16", "train.dtype=bfloat16",
                   "engine.mem_fraction_static=0.15", "engine.enable_memory_saver=true",
                   "engine.offload_during_train=true", f"engine.sglang_args={sglang_args}"],
    }  # fmt: skip
    results: dict[str, Any] = {}

    def one(name: str, args: list[str]) -> None:
        run_dir = workdir / f"quickstart-lora-{name}"
        t0 = time.monotonic()
        rc = hpcrl_run(
            [*args, "--run-dir", str(run_dir)], out / f"quickstart_lora_{name}.log", float("inf")
        )  # up to --budget-s
        results[name] = {"rc": rc, "seconds": time.monotonic() - t0, **run_metrics(run_dir)}

    threads = [threading.Thread(target=one, args=item) for item in variants.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.update(results)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where lora_gpu.json and the logs go")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/hpcrl-lora-gpu"), help="models and runs")
    ap.add_argument("--sections", default="push,sglang,quickstart", help="comma-separated: push, sglang, quickstart")
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps of each quickstart run (default 8)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="the quickstart runs stop by then (default 420)")
    ns = ap.parse_args()
    global DEADLINE
    DEADLINE = time.monotonic() + ns.budget_s
    out: Path = ns.out
    sections = ns.sections.split(",")
    unknown = sorted(set(sections) - {"push", "sglang", "quickstart"})
    if unknown:
        ap.error(f"unknown section(s) {unknown}; valid: push, sglang, quickstart")
    ns.out.mkdir(parents=True, exist_ok=True)
    ns.workdir.mkdir(parents=True, exist_ok=True)
    shaped_model(ns.workdir)  # once, before the sections that share it start
    report: dict[str, Any] = {}
    failed: list[str] = []
    lock = threading.Lock()

    def guarded(name: str, fn: Any) -> None:
        t0 = time.monotonic()
        try:
            result = fn()
            with lock:  # the sections finished so far, in case a later one is cut off
                report[name] = result
                (out / "lora_gpu.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        except Exception as exc:  # noqa: BLE001 - a section's failure is reported and the others go on
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            failed.append(name)
        print(f"section {name} done in {time.monotonic() - t0:.0f} s", flush=True)

    jobs = {
        "push": lambda: section_push(ns.workdir),
        "sglang": lambda: section_sglang(ns.workdir, ns.out),
        "quickstart": lambda: section_quickstart(ns.workdir, ns.out, ns.steps),
    }
    threads = [threading.Thread(target=guarded, args=(n, jobs[n])) for n in sections]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (ns.out / "lora_gpu.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print_table(report)
    for name in failed:
        print(f"section {name} FAILED: {report[name]['error']}", flush=True)
    qs = report.get("quickstart", {})
    failed += [f"quickstart {k}" for k in ("embedded", "sglang") if isinstance(qs.get(k), dict) and qs[k].get("rc")]
    return 1 if failed else 0


def print_table(report: dict[str, Any]) -> None:
    push = report.get("push", {})
    if "full_push_mib" in push:
        print(f"\npush on {push['device']}, {push['model']}, rank {push['rank']} ({push['adapted_layers']} layers)")
        print(f"| | full | adapters |\n|---|---:|---:|\n| push MiB | {push['full_push_mib']:.1f} | "
              f"{push['lora_push_mib']:.1f} |\n| trainer collect s | {push['full_collect_s']:.4f} | "
              f"{push['lora_collect_s']:.4f} |\n| engine apply s (first) | {push['engine_replace_s']:.4f} | "
              f"{push['engine_merge_first_s']:.4f} |\n| engine apply s (steady) | {push['engine_replace_s']:.4f} | "
              f"{push['engine_merge_steady_s']:.4f} |")  # fmt: skip
        print(f"merged weight equals the trainer's bit for bit: {push['merged_equals_trainer']}")
    sg = report.get("sglang", {})
    if "adapter_gap" in sg:
        print(
            "\nSGLang: the adapter path (peft dir + /load_lora_adapter) against the merged push "
            "(update_weights_from_tensor)"
        )
        print("| path | MiB | seconds (first, then) | mean gap | max gap |\n|---|---:|---:|---:|---:|")
        print(f"| adapter | {sg['adapter_bytes_mib']:.1f} | {sg['adapter_load_first_s']:.3f}, "
              f"{sg['adapter_load_s']:.3f} "
              f"| {sg['adapter_gap']['mean_abs_gap']:.3g} | {sg['adapter_gap']['max_abs_gap']:.3g} |")  # fmt: skip
        if "merged_gap" in sg:
            print(f"| merged | {sg['merged_bytes_mib']:.1f} | {sg['merged_push_first_s']:.3f}, "
                  f"{sg['merged_push_s']:.3f}"
                  f" | {sg['merged_gap']['mean_abs_gap']:.3g} | {sg['merged_gap']['max_abs_gap']:.3g} |")  # fmt: skip
    for name, run in (report.get("quickstart") or {}).items():
        if not isinstance(run, dict) or "reward" not in run:
            continue
        print(f"\nquickstart-lora on {name} (rc {run['rc']}, {run['seconds']:.0f} s): step, reward, gap")
        for i, (r, g) in enumerate(
            zip(run["reward"], run.get("gap", [float("nan")] * len(run["reward"])), strict=False)
        ):
            print(f"  {i + 1:3d}  {r:.3f}  {g:.3g}")


if __name__ == "__main__":
    sys.exit(main())
