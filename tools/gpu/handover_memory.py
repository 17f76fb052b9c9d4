"""CUDA paths of the embedded engine's colocation endpoints, at Qwen3-0.6B's shape in bf16.

    PYTHONPATH=. python3 tools/gpu/handover_memory.py --out $OUT [--model DIR]

1. `update_weights_from_tensor` from this (another) process: all weights packed in one flat CUDA
   buffer (`hpcrl.weightwire.handover.create_handover`), one IPC handle; the HTTP call timed end to end,
   three times, and checked with /get_weights_by_name.
2. `/release_memory_occupation` and `/resume_memory_occupation` (tags cuda_graph + kv_cache, then
   weights; resume weights, push weights, resume kv_cache + cuda_graph): the bytes freed as torch
   reports them inside the engine (allocated/reserved before and after) and as NVML sees the device
   (memory used, before and after), and the seconds each call takes; then the same seeded request
   must give the same tokens as before the release.
Prints a table last and writes handover_memory.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

from hpcrl.model.hf import load_model  # noqa: E402
from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, ModelShape, init_shaped_model  # noqa: E402
from hpcrl.weightwire.handover import create_handover  # noqa: E402
from tests.conftest import start_engine  # noqa: E402


def nvml_used() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # noqa: BLE001 - no NVML (a CPU smoke test): report torch's numbers only
        return None


def post(url: str, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    r = httpx.post(url + path, json=body, timeout=600)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{path} -> {r.status_code}: {r.text}")
    return (r.json() if r.content and r.content.strip() != b"null" else {}), dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: write a random 0.6B-shaped one)")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--out", default=".")
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test this script (shared-memory handover)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape instead of Qwen3-0.6B's (smoke test)")
    ns = p.parse_args()
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hpcrl-handover-"))
    shape = QWEN3_0_6B_SHAPE
    if ns.tiny:
        shape = ModelShape(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
        )
    model_dir = Path(ns.model) if ns.model else init_shaped_model(work / "m", shape, device=ns.device)
    res: dict[str, Any] = {}
    eng = start_engine(
        model_dir,
        work,
        "--device",
        ns.device,
        "--dtype",
        "bfloat16",
        "--max-running-requests",
        str(ns.max_running_requests),
        "--context-length",
        str(ns.context_length),
        timeout_s=600,
    )
    url = eng.url
    try:
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 16, "sampling_seed": 7}}
        reference = httpx.post(url + "/generate", json=body, timeout=600).json()["output_ids"]

        # ---- 1. CUDA IPC weight handover from this process ----
        named = list(load_model(model_dir, dtype=torch.bfloat16, device=ns.device).state_dict().items())
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        res["weights_bytes"] = nbytes
        res["weights_tensors"] = len(named)
        probe = "model.layers.0.self_attn.q_proj.weight"
        calls = []
        for i in range(3):
            scaled = [(n, t * (1.0 + 0.01 * (i + 1))) for n, t in named] if i < 2 else named
            if ns.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with create_handover(scaled) as payload:
                t1 = time.perf_counter()
                r, dt = post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
            calls.append({"pack_s": t1 - t0, "http_s": dt, "engine_s": r.get("seconds"), "success": r.get("success")})
            got = httpx.post(url + "/get_weights_by_name", json={"name": probe, "truncate_size": 8}, timeout=60).json()
            want = dict(scaled)[probe].float().flatten()[:8].cpu().tolist()
            calls[-1]["values_match"] = got == want
        res["handover_calls"] = calls
        print("[handover] " + json.dumps(calls), flush=True)
        after_push = httpx.post(url + "/generate", json=body, timeout=600).json()["output_ids"]
        res["generate_after_push_equals_before"] = after_push == reference  # weights restored to the originals

        # ---- 2. release / resume ----
        steps = []

        def step(path: str, tags: list[str]) -> dict[str, Any]:
            n0 = nvml_used()
            r, dt = post(url, path, {"tags": tags})
            time.sleep(0.2)  # NVML reads the driver's accounting; give it a moment
            n1 = nvml_used()
            row = {"call": path.strip("/"), "tags": tags, "http_s": dt, **r}
            if n0 is not None and n1 is not None:
                row.update({"nvml_used_before": n0, "nvml_used_after": n1, "nvml_freed": n0 - n1})
            steps.append(row)
            print("[memory] " + json.dumps(row), flush=True)
            return row

        httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
        step("/release_memory_occupation", ["cuda_graph", "kv_cache"])
        step("/release_memory_occupation", ["weights"])
        step("/resume_memory_occupation", ["weights"])
        with create_handover(named) as payload:
            r, dt = post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
        res["push_after_resume_s"] = dt
        step("/resume_memory_occupation", ["kv_cache", "cuda_graph"])
        res["memory_steps"] = steps
        again = httpx.post(url + "/generate", json=body, timeout=600).json()["output_ids"]
        res["generate_after_resume_equals_before"] = again == reference
    finally:
        eng.stop()
        (out_dir / "engine_handover.log").write_text(eng.log()[-200_000:])
    (out_dir / "handover_memory.json").write_text(json.dumps(res, indent=2))

    gib = 1 << 30
    print("\n| update_weights_from_tensor | pack s | HTTP s (end to end) | engine s | values match |")
    print("|---|---:|---:|---:|---|")
    for i, c in enumerate(res["handover_calls"]):
        print(f"| call {i + 1} | {c['pack_s']:.3f} | {c['http_s']:.3f} | {c['engine_s']:.3f} | {c['values_match']} |")
    print("\n| call | tags | s | torch allocated before -> after (GiB) | reserved before -> after | NVML freed (GiB) |")
    print("|---|---|---:|---|---|---:|")
    for s in res["memory_steps"]:
        alloc = (
            f"{(s.get('device_allocated_before') or 0) / gib:.2f} -> {(s.get('device_allocated_after') or 0) / gib:.2f}"
        )
        resv = (
            f"{(s.get('device_reserved_before') or 0) / gib:.2f} -> {(s.get('device_reserved_after') or 0) / gib:.2f}"
        )
        if "device_allocated_before" not in s:
            alloc = f"-> {(s.get('device_allocated_after') or 0) / gib:.2f}"
            resv = f"-> {(s.get('device_reserved_after') or 0) / gib:.2f}"
        nv = s.get("nvml_freed")
        nv_s = f"{nv / gib:.2f}" if nv is not None else "-"
        print(f"| {s['call']} | {','.join(s['tags'])} | {s['http_s']:.3f} | {alloc} | {resv} | {nv_s} |")
    print(
        f"\nsame tokens after push: {res['generate_after_push_equals_before']}; "
        f"after release/resume: {res['generate_after_resume_equals_before']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
