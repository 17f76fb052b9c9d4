#!/usr/bin/env python3
"""Disk-delta weight pushes on the Qwen3-0.6B shape in bf16, into hpcrl's embedded engine and into stock SGLang
0.5.16 (through the disk-delta agent), against the tensor push (CUDA IPC) of the same weights in the same run.

    source .sglang/activate.sh .sglang/sglang-site.tar.xz && export PYTHONPATH=$PYTHONPATH:$PWD
    python3 tools/gpu/delta_gpu.py --out $OUT/delta          # about 5-6 minutes on one H100, 2.5 of them start-up

What it does: a random-weight model of Qwen3-0.6B's shape (hpcrl.model.tiny.init_shaped_model, bf16, tied
embeddings); one SGLang server (`--mem-fraction-static 0.9 --max-total-tokens 16384`: other scripts may share
the GPU) and one embedded engine start on it while the trainer (transformers' Qwen3 in fp32 on the GPU, AdamW,
a next-token loss on random token batches) takes its steps: --pushes steps at lr 1e-6, then --pushes at 1e-5,
each followed by pushes of the same bf16 weights as version v:
  1. disk_delta into the embedded engine (sync/disk_delta.py writes the delta, the engine patches in place);
  2. the tensor push into the embedded engine (CUDA IPC);
  3. disk_delta into SGLang: the agent (its own process beside the server, as hpcrl's launcher starts it:
     `python -m hpcrl.sync.delta_agent_server`) patches its copy, then has SGLang load it, alternately from disk
     (update_weights_from_disk: odd versions and the last) and as tensors (update_weights_from_tensor: the
     other even versions);
  4. the tensor push into SGLang (CUDA IPC).
Version 0 (the launch weights) is pushed first: it writes the first snapshot. Per push: delta bytes (against the
full bf16 payload), changed share, write seconds, the engine's apply seconds and the push's whole pause (pause
to continue, `sync/seconds`). Checks: after the last delta push (before its tensor push) the embedded engine
holds the trainer's bf16 weights bitwise (several tensors read back whole); the SGLang agent's copy (the
safetensors file it had SGLang load) equals them bitwise (every tensor); SGLang's parameters read back with
/get_weights_by_name (the first rows of PROBED) equal the trainer's after the delta load and after the tensor push;
SGLang's greedy log-probs after the delta load (asked twice) equal those after the tensor push of the same weights
(and, recorded, after the same directory is loaded from disk again).
Writes delta_gpu.json and the servers' logs to --out; prints a results table; exits 1 when a check fails.
`--cpu-smoke` runs the embedded half on a CPU with a small shape (28 layers of width 64; about 2 minutes on 2
busy cores), which is how the script is checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hpcrl.engine.client import EngineClient  # noqa: E402
from hpcrl.sync.config import SyncConfig  # noqa: E402
from hpcrl.sync.delta_agent import UPDATE_WEIGHTS_FROM_DISK  # noqa: E402
from hpcrl.sync.push import WeightSync  # noqa: E402

SGLANG_ARGS = (
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
    "--skip-server-warmup", "--mem-fraction-static", "0.9", "--max-total-tokens", "16384",
    "--dtype", "bfloat16", "--random-seed", "0", "--disable-cuda-graph", "--max-running-requests", "16",
)  # fmt: skip
CHECKED = ("model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.27.self_attn.k_proj.weight")
PROMPT = [20, 21, 14, 22, 23, 32, 40, 41]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    print("starting:", " ".join(cmd[:6]), "...", flush=True)
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_up(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"server {url} exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"server {url} not up in {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


def greedy_logprobs(url: str) -> list[float]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}, "return_logprob": True}
    reply = httpx.post(url + "/generate", json=body, timeout=120, trust_env=False).json()
    return [float(t[0]) for t in reply["meta_info"]["output_token_logprobs"]]


PROBED = ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.27.mlp.down_proj.weight")
"""SGLang parameters that /get_weights_by_name reads back for Qwen3 (q/k/v and gate/up are fused under other
names there); their first rows, against the trainer's."""


def sglang_weights_match(client: EngineClient, named: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per probed name: True when SGLang's first 4 rows equal the trainer's bitwise, else the answer's error."""
    out: dict[str, Any] = {}
    for name in PROBED:
        try:
            got = torch.tensor(client.get_weights_by_name(name, truncate_size=4), dtype=torch.float64)
        except Exception as exc:  # noqa: BLE001 - recorded as the answer
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        want = named[name][: got.shape[0]].float().cpu().double()
        out[name] = bool(got.shape == want.shape and torch.equal(got, want))
    return out


def push_row(kind: str, lr: float, version: int, metrics: dict[str, float], full_bytes: int) -> dict[str, Any]:
    row: dict[str, Any] = {"push": kind, "lr": lr, "version": version, "pause_s": round(metrics["sync/seconds"], 3)}
    if "sync/delta_bytes" in metrics:
        row.update(
            delta_bytes=int(metrics["sync/delta_bytes"]),
            bytes_vs_full=round(metrics["sync/delta_bytes"] / full_bytes, 4),
            changed_share=round(metrics["sync/delta_changed_share"], 5),
            write_s=round(metrics["sync/delta_write_s"], 3),
        )
    if "sync/engine_apply_s" in metrics:
        row["apply_s"] = round(metrics["sync/engine_apply_s"], 3)
    if "sync/snapshot_bytes" in metrics:
        row["snapshot_bytes"] = int(metrics["sync/snapshot_bytes"])
    return row


def main() -> int:  # noqa: PLR0915 - one linear script, read top to bottom
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--python", default=sys.executable, help="the interpreter that has sglang")
    ap.add_argument("--pushes", type=int, default=3, help="pushes per learning rate (default 3)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="check the script on a CPU: a small shape, the embedded engine only"
    )
    ns = ap.parse_args()
    out: Path = ns.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    from transformers import AutoModelForCausalLM

    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, ModelShape, init_shaped_model

    work = Path(tempfile.mkdtemp(prefix="hpcrl-delta-gpu-"))
    dev = "cpu" if ns.cpu_smoke else "cuda"
    if ns.cpu_smoke:
        shape = ModelShape(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=28, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=4096,
        )  # fmt: skip
    else:
        shape = ModelShape(**{**QWEN3_0_6B_SHAPE.__dict__, "max_position_embeddings": 4096})
    model_dir = init_shaped_model(work / "model", shape, dtype="bfloat16", device=dev)
    s_port, e_port = free_port(), free_port()
    s_url, e_url = f"http://127.0.0.1:{s_port}", f"http://127.0.0.1:{e_port}"
    sglang = None if ns.cpu_smoke else launch(
        [ns.python, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1", "--port",
         str(s_port), *SGLANG_ARGS], out / "sglang.log",
    )  # fmt: skip
    embedded = launch(
        [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model_dir), "--port", str(e_port),
         "--device", dev, "--dtype", "bfloat16", "--context-length", "2048", "--max-running-requests", "16"],
        out / "embedded.log",
    )  # fmt: skip
    results: dict[str, Any] = {"shape": shape.__dict__, "rows": [], "checks": {}}
    failures: list[str] = []
    agent: subprocess.Popen[bytes] | None = None
    run_dir, agent_dir = work / "run", work / "agent"
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev)
        params = dict(model.named_parameters())
        full_bytes = sum(p.numel() * 2 for p in params.values())
        results["full_push_bytes"] = full_bytes
        print(f"model: {sum(p.numel() for p in params.values()) / 1e6:.0f} M parameters, {full_bytes / 2**30:.2f} GiB"
              " in bf16", flush=True)  # fmt: skip
        print(f"embedded engine up after {wait_up(e_url, embedded, out / 'embedded.log', ns.startup_timeout_s):.0f} s")
        if sglang is not None:
            up_s = wait_up(s_url, sglang, out / "sglang.log", ns.startup_timeout_s)
            print(f"SGLang up after {up_s:.0f} s", flush=True)
            (run_dir / "engines").mkdir(parents=True)
            (work / "sglang.key").write_text("")  # this server was started without an API key
            record = run_dir / "engines" / "engine-0.agent.json"
            agent = launch(
                [sys.executable, "-m", "hpcrl.sync.delta_agent_server", "--engine-url", s_url, "--key-file",
                 str(work / "sglang.key"), "--model-dir", str(model_dir), "--record", str(record),
                 "--dtype", "bfloat16", "--local-dir", str(agent_dir)], out / "agent.log",
            )  # fmt: skip
            t0 = time.monotonic()
            while not record.exists():
                if agent.poll() is not None or time.monotonic() - t0 > 120:
                    raise SystemExit(f"the delta agent did not start:\n{(out / 'agent.log').read_text()[-4000:]}")
                time.sleep(0.2)
        device = torch.device(dev)
        e_client, s_client = EngineClient(e_url, timeout_s=600), EngineClient(s_url, timeout_s=600)
        e_delta = WeightSync(
            SyncConfig(transport="disk_delta", delta_dir=str(work / "w-embedded")), [e_client], device=device
        )
        e_tensor = WeightSync(SyncConfig(transport="tensor"), [e_client], device=device, colocated=True)
        s_delta = WeightSync(
            SyncConfig(transport="disk_delta", delta_dir=str(work / "w-sglang")), [s_client], device=device,
            engine_kind="sglang", run_dir=run_dir,
        )  # fmt: skip
        s_tensor = WeightSync(
            SyncConfig(transport="tensor"), [s_client], device=device, colocated=True, engine_kind="sglang"
        )
        syncs = (e_delta, e_tensor) if sglang is None else (e_delta, e_tensor, s_delta, s_tensor)
        for sync in syncs:
            sync.connect()
        gen = torch.Generator(device=dev).manual_seed(0)
        version = 0
        schedule = [(0.0, 0)] + [(1e-6, i) for i in range(ns.pushes)] + [(1e-5, i) for i in range(ns.pushes)]
        optim: torch.optim.Optimizer | None = None
        lr_now = None
        named: list[tuple[str, torch.Tensor]] = []
        for lr, _ in schedule:
            if lr > 0:
                if lr != lr_now:
                    optim, lr_now = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0), lr
                assert optim is not None
                ids = torch.randint(100, shape.vocab_size, (ns.batch, ns.seq_len), device=dev, generator=gen)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
                version += 1
            named = [(n, p.detach().to(torch.bfloat16)) for n, p in params.items()]
            last = lr > 0 and version == 2 * ns.pushes
            row = push_row("embedded disk_delta", lr, version, e_delta.push(named, version), full_bytes)
            results["rows"].append(row)
            if last:  # before the tensor push: what the delta alone left in the engine
                for name in CHECKED:
                    got = torch.tensor(e_client.get_weights_by_name(name, truncate_size=10**8)).flatten()
                    want = dict(named)[name].float().flatten().cpu().double()
                    same = bool(torch.equal(got.double(), want))
                    results["checks"][f"embedded {name} bitwise"] = same
                    if not same:
                        failures.append(f"the embedded engine's {name} differs from the trainer's after the deltas")
            results["rows"].append(push_row("embedded tensor", lr, version, e_tensor.push(named, version), full_bytes))
            if sglang is None:
                print(f"version {version} (lr {lr:g}) pushed 2 ways", flush=True)
                continue
            # The last push, the one checked against the tensor push, goes through update_weights_from_disk.
            agent_mode = "disk" if version % 2 == 1 or version == 0 or last else "tensor"
            s_delta.transport.agent_mode = agent_mode  # type: ignore[attr-defined]
            metrics = s_delta.push(named, version)
            row = push_row(f"sglang disk_delta ({agent_mode})", lr, version, metrics, full_bytes)
            results["rows"].append(row)
            if last:
                from safetensors.torch import load_file

                copy = load_file(str(agent_dir / f"v{version:08d}" / "model.safetensors"))
                copy_same = all(torch.equal(copy[n].view(torch.int16), t.cpu().view(torch.int16)) for n, t in named)
                results["checks"]["sglang agent copy bitwise"] = copy_same
                if not copy_same:
                    failures.append("the SGLang agent's copy differs from the trainer's weights")
                after_delta = [greedy_logprobs(s_url), greedy_logprobs(s_url)]  # twice: is one request repeatable?
                probes = sglang_weights_match(s_client, dict(named))
                results["checks"]["sglang weights after the delta load (first rows bitwise)"] = probes
                if any(v is False for v in probes.values()):
                    failures.append(f"SGLang's weights differ from the trainer's after the delta load: {probes}")
            results["rows"].append(push_row("sglang tensor", lr, version, s_tensor.push(named, version), full_bytes))
            if last:
                after_tensor = greedy_logprobs(s_url)
                probes = sglang_weights_match(s_client, dict(named))
                results["checks"]["sglang weights after the tensor push (first rows bitwise)"] = probes
                if any(v is False for v in probes.values()):
                    failures.append(f"SGLang's weights differ from the trainer's after the tensor push: {probes}")
                # The same directory loaded again from disk: the disk path's numerics against the tensor path's.
                again = {"model_path": str(agent_dir / f"v{version:08d}"), "load_format": "safetensors"}
                s_client.call(UPDATE_WEIGHTS_FROM_DISK, {**again, "flush_cache": True})
                after_disk_again = greedy_logprobs(s_url)
                same = after_delta[0] == after_tensor
                results["checks"]["sglang greedy logprobs delta == tensor push"] = same
                results["checks"]["sglang logprobs"] = {"after_delta": after_delta, "after_tensor": after_tensor,
                                                        "after_disk_again": after_disk_again}  # fmt: skip
                if not same:
                    failures.append("SGLang generates differently after the delta load than after the tensor push")
            print(f"version {version} (lr {lr:g}) pushed 4 ways", flush=True)
            for row in results["rows"][-4:]:
                print("   ", json.dumps(row), flush=True)
            # Written after every version: a run stopped by its time limit still leaves what it measured.
            (out / "delta_gpu.json").write_text(json.dumps({**results, "failures": failures}, indent=1))
        for sync in syncs:
            sync.close()
    except SystemExit as exc:
        failures.append(str(exc)[:4000])
    except Exception as exc:  # noqa: BLE001 - reported in the JSON and the exit status
        failures.append(f"{type(exc).__name__}: {exc}"[:4000])
    finally:
        for proc in (p for p in (agent, sglang, embedded) if p is not None):
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
    results["failures"] = failures
    results["seconds"] = round(time.monotonic() - t_start, 1)
    (out / "delta_gpu.json").write_text(json.dumps(results, indent=1))
    keys = ("push", "lr", "version", "delta_bytes", "bytes_vs_full", "changed_share", "write_s", "apply_s", "pause_s")
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in results["rows"]:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")
    for name, value in results["checks"].items():
        print(f"check {name}: {value}")
    for failure in failures:
        print(f"FAILED: {failure}")
    print(f"{results['seconds']} s; results in {out / 'delta_gpu.json'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
