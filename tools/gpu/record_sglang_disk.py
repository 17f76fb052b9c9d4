#!/usr/bin/env python3
"""Record what stock SGLang answers to `POST /update_weights_from_disk`, the call by which hpcrl's disk-delta agent
(hpcrl/sync/delta_agent.py) has SGLang load the weights it patched, one JSON file per case.

    python3 tools/gpu/record_sglang_disk.py --out DIR              # starts SGLang on a tiny model (GPU, ~4 min)
    python3 tools/gpu/record_sglang_disk.py --out DIR --embedded   # checks the script: hpcrl's engine (CPU)

Two model directories: A (a tiny model made like `hpcrl model init-tiny`) and B (A with every weight perturbed,
written as the agent writes its copy: one model.safetensors, the other files linked from A). The server starts
on A (`--mem-fraction-static 0.9 --max-total-tokens 65536`: other recorders share the GPU). Cases:
  update_weights_from_disk                  {model_path: B}; then model_info, a greedy generate, get_weights_by_name
  update_weights_from_disk_missing_path     the agent's body with a path that does not exist; then generate
  update_weights_from_disk_weight_version   the agent's body (load_format, weight_version, ...) with A; then
                                            model_info (the version) and generate (A's tokens again)
The greedy generation on A before the first case is part of that case. The files go to
tests/golden/sglang-0.5.16/disk/ (manifest.json included), for a replay test to read; the
format is tests/golden/sglang-0.5.16/README.md's. The embedded engine has no /update_weights_from_disk: with
--embedded the cases record its 404s, which checks the script end to end and nothing else.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record_sglang import (  # noqa: E402 - the sibling recorder, found through the path above
    PROMPT,
    Ctx,
    Recorder,
    Server,
    engine_version,
    free_port,
    make_model,
    new_manifest,
    record_case,
    start_server,
    write_manifest,
)

from hpcrl.engine.protocol.requests import GenerateRequest, SamplingParams  # noqa: E402

SGLANG_ARGS = (
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
    "--skip-server-warmup", "--mem-fraction-static", "0.9", "--max-total-tokens", "65536",
)  # fmt: skip
PROBE = "model.embed_tokens.weight"
PROBE_SIZE = 2  # rows of it that get_weights_by_name answers


def agent_body(model_path: Path | str, version: str) -> dict[str, Any]:
    """What hpcrl/sync/delta_agent.py sends (kept equal to it by the replay test)."""
    return {
        "model_path": str(model_path), "load_format": "safetensors", "weight_version": version,
        "abort_all_requests": False, "flush_cache": True,
    }  # fmt: skip


def greedy() -> dict[str, Any]:
    return GenerateRequest(
        input_ids=list(PROMPT), sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0), return_logprob=True
    ).to_dict()


def perturbed_copy(model_a: Path, model_b: Path) -> dict[str, Any]:
    """B: A's weights perturbed (about 1% of their scale), one model.safetensors, A's other files linked; what
    get_weights_by_name should then answer for the probe (its first rows, float32), for A and for B."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_a.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    gen = torch.Generator().manual_seed(7)
    perturbed = {
        n: (t.float() + 0.01 * t.float().std() * torch.randn(t.shape, generator=gen)).to(t.dtype)
        if t.is_floating_point() else t
        for n, t in tensors.items()
    }  # fmt: skip
    shutil.rmtree(model_b, ignore_errors=True)
    model_b.mkdir(parents=True)
    for entry in model_a.iterdir():
        if entry.is_file() and entry.suffix != ".safetensors" and not entry.name.endswith(".index.json"):
            os.symlink(entry.absolute(), model_b / entry.name)
    save_file({n: t.contiguous() for n, t in perturbed.items()}, str(model_b / "model.safetensors"))
    return {
        "probe": PROBE,
        "probe_a": tensors[PROBE].float()[:PROBE_SIZE].tolist() if PROBE in tensors else None,
        "probe_b": perturbed[PROBE].float()[:PROBE_SIZE].tolist() if PROBE in perturbed else None,
    }


def case_update_weights_from_disk(rec: Recorder, ctx: Ctx, dirs: dict[str, Any]) -> None:
    ctx.notes.update(model_a=str(dirs["a"]), model_b=str(dirs["b"]), **dirs["probes"])
    rec.send("generate on A", "POST", "/generate", greedy())
    loaded = rec.send("load B", "POST", "/update_weights_from_disk", {"model_path": str(dirs["b"])}, timeout_s=300)
    ctx.expect(loaded["status"] in (200, 400), f"load B answered HTTP {loaded['status']}")
    rec.send("model_info", "GET", "/model_info")
    rec.send("generate on B", "POST", "/generate", greedy())
    rec.send("get_weights_by_name", "POST", "/get_weights_by_name", {"name": PROBE, "truncate_size": PROBE_SIZE})


def case_update_weights_from_disk_missing_path(rec: Recorder, ctx: Ctx, dirs: dict[str, Any]) -> None:
    missing = dirs["a"].parent / "no-such-model"
    ctx.notes["model_path"] = str(missing)
    rec.send("load a missing path", "POST", "/update_weights_from_disk", agent_body(missing, "5"), timeout_s=300)
    rec.send("model_info", "GET", "/model_info")
    rec.send("generate (still B)", "POST", "/generate", greedy())
    rec.send("health", "GET", "/health")


def case_update_weights_from_disk_weight_version(rec: Recorder, ctx: Ctx, dirs: dict[str, Any]) -> None:
    ctx.notes["model_path"] = str(dirs["a"])
    rec.send("load A with a version", "POST", "/update_weights_from_disk", agent_body(dirs["a"], "7"), timeout_s=300)
    rec.send("model_info", "GET", "/model_info")
    rec.send("generate on A again", "POST", "/generate", greedy())
    rec.send("get_weights_by_name", "POST", "/get_weights_by_name", {"name": PROBE, "truncate_size": PROBE_SIZE})


CaseFn = Callable[[Recorder, Ctx, dict[str, Any]], None]
CASES: dict[str, tuple[str, CaseFn]] = {
    "update_weights_from_disk": (
        "generate on A; update_weights_from_disk {model_path: B}; model_info, generate and get_weights_by_name",
        case_update_weights_from_disk,
    ),
    "update_weights_from_disk_missing_path": (
        "update_weights_from_disk with the agent's body and a path that does not exist; model_info, generate, health",
        case_update_weights_from_disk_missing_path,
    ),
    "update_weights_from_disk_weight_version": (
        "update_weights_from_disk with the agent's body (A, weight_version 7); model_info, generate, "
        "get_weights_by_name",
        case_update_weights_from_disk_weight_version,
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (one JSON file per case)")
    parser.add_argument("--python", default="python3", help="the interpreter that has sglang (default python3)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="wait for /health (default 300)")
    parser.add_argument("--request-timeout-s", type=float, default=120.0, help="per request (default 120)")
    parser.add_argument("--embedded", action="store_true", help="run against hpcrl's embedded engine (CPU)")
    args = parser.parse_args(argv)
    out: Path = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    model_a = make_model(out / "model-a", max_position_embeddings=1024)
    dirs = {"a": model_a, "b": out / "model-b", "probes": perturbed_copy(model_a, out / "model-b")}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if args.embedded:
        cmd = [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model_a), "--port", str(port)]
    else:
        cmd = [args.python, "-m", "sglang.launch_server", "--model-path", str(model_a), "--host", "127.0.0.1",
               "--port", str(port), *SGLANG_ARGS]  # fmt: skip
    server = Server(cmd, url, out / "server.log")
    atexit.register(server.stop)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    what = "the embedded engine" if args.embedded else "SGLang"
    if not start_server(server, what, args.startup_timeout_s, "record_sglang_disk"):
        return 1
    manifest = new_manifest(embedded=args.embedded, version=engine_version(url), command=cmd[1:])
    failed: list[str] = []
    for name, (description, run) in CASES.items():  # in order: each case starts from the weights the last left
        ctx = Ctx(long_new_tokens=0)
        _, survived = record_case(
            out, manifest, name, description, run, server=server, case_args=(dirs,),
            request_timeout_s=args.request_timeout_s, ctx=ctx, width=42,
        )  # fmt: skip
        if ctx.problems:
            failed.append(name)
        if not survived:
            print(server.log_tail(), flush=True)
            break
    write_manifest(out, manifest, failed)
    print(f"copy them: cp {out}/*.json tests/golden/sglang-0.5.16/disk/", flush=True)
    server.stop()
    return 1 if failed or len(manifest["cases"]) < len(CASES) else 0


if __name__ == "__main__":
    sys.exit(main())
