#!/usr/bin/env python3
"""Record what a real SGLang 0.5.16 server answers to its LoRA calls, one JSON file per case (GPU, ~4 minutes).

    python3 tools/gpu/record_sglang_lora.py --out DIR       # starts SGLang with --enable-lora on a tiny model

The server runs with `--enable-lora --max-lora-rank 8 --lora-target-modules all --max-loras-per-batch 2` on a tiny
model made like `hpcrl model init-tiny` (`--mem-fraction-static 0.9 --max-total-tokens 65536`: it shares the GPU
with other recorders; start-up takes 130-150 s). The adapters are hpcrl's peft export (`write_peft_adapter` of the
`lora` converter on that model, B drawn at random so that an adapter changes the log-probs), two versions. Cases:
- lora_load_generate: load v1 from its directory, generate with lora_path v1 and with the base (log-probs);
- lora_swap_versions: load v2 under a new name, unload v1, generate with v2, then with v1 (now unknown);
- lora_error_bad_path: load from a directory that does not exist;
- lora_error_unknown_adapter: generate naming an adapter never loaded; unload one never loaded.
The files go to tests/golden/sglang-0.5.16/lora/ (manifest.json with them; the format of record_sglang.py, whose
server handling this script reuses), where a replay test can read them through
tools/gpu/sglang_lora_client.py. `--embedded` is not offered: hpcrl's embedded engine has no adapter endpoints.
"""

from __future__ import annotations

import argparse
import atexit
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record_sglang import (  # noqa: E402 - the sibling script, found through the path above
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

RANK = 8
LORA_ARGS = (
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
    "--skip-server-warmup", "--mem-fraction-static", "0.9", "--max-total-tokens", "65536",
    "--enable-lora", "--max-lora-rank", str(RANK), "--lora-target-modules", "all", "--max-loras-per-batch", "2",
)  # fmt: skip


def write_adapter(model_dir: Path, out_dir: Path, seed: int) -> Path:
    """hpcrl's peft export of rank-8 adapters on every linear layer of `model_dir`, with B drawn from `seed`."""
    import torch

    from hpcrl.model.hf import load_model
    from hpcrl.trainer.config import LoRAConfig, TrainConfig
    from hpcrl.trainer.converters.lora import LoRA, write_peft_adapter

    cfg = TrainConfig(converters=("lora",), lora=LoRAConfig(rank=RANK, alpha=16.0))
    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    lora = LoRA(cfg)
    lora.convert(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.layers.values():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.05)
    return write_peft_adapter(lora, out_dir, base_model=str(model_dir))


def _gen(adapter: str | None, seed: int = 7) -> dict[str, Any]:
    return {
        "input_ids": list(PROMPT),
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": seed},
        "return_logprob": True,
        "lora_path": adapter,
    }


def _ok(response: dict[str, Any]) -> bool:
    return response["status"] == 200


def case_lora_load_generate(rec: Recorder, ctx: Ctx, paths: dict[str, str]) -> None:
    loaded = rec.send("load v1", "POST", "/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": paths["v1"]})
    ctx.expect(_ok(loaded), f"load answered {loaded['status']}")
    with_adapter = rec.send("generate with v1", "POST", "/generate", _gen("policy-v1"))
    base = rec.send("the same request on the base", "POST", "/generate", _gen(None))
    ctx.expect(_ok(with_adapter) and _ok(base), "a generate failed")
    lp = [(r.get("body") or {}).get("meta_info", {}).get("output_token_logprobs") for r in (with_adapter, base)]
    ctx.notes["adapter_changes_logprobs"] = lp[0] != lp[1]


def case_lora_swap_versions(rec: Recorder, ctx: Ctx, paths: dict[str, str]) -> None:
    loaded = rec.send("load v2 under a new name", "POST", "/load_lora_adapter",
                      {"lora_name": "policy-v2", "lora_path": paths["v2"]})  # fmt: skip
    ctx.expect(_ok(loaded), f"load v2 answered {loaded['status']}")
    gone = rec.send("unload v1", "POST", "/unload_lora_adapter", {"lora_name": "policy-v1"})
    ctx.expect(_ok(gone), f"unload answered {gone['status']}")
    fresh = rec.send("generate with v2", "POST", "/generate", _gen("policy-v2"))
    ctx.expect(_ok(fresh), f"generate with v2 answered {fresh['status']}")
    rec.send("generate with the unloaded v1", "POST", "/generate", _gen("policy-v1"))


def case_lora_error_bad_path(rec: Recorder, ctx: Ctx, paths: dict[str, str]) -> None:
    bad = rec.send("load from a missing directory", "POST", "/load_lora_adapter",
                   {"lora_name": "missing", "lora_path": paths["missing"]})  # fmt: skip
    ctx.expect(bad["status"] != 200, "a missing directory was loaded")


def case_lora_error_unknown_adapter(rec: Recorder, ctx: Ctx, paths: dict[str, str]) -> None:
    rec.send("generate naming an adapter never loaded", "POST", "/generate", _gen("never-loaded"))
    rec.send("unload an adapter never loaded", "POST", "/unload_lora_adapter", {"lora_name": "never-loaded"})


Case = Callable[[Recorder, Ctx, dict[str, str]], None]
CASES: dict[str, tuple[str, Case]] = {
    "lora_load_generate": ("load hpcrl's peft export as policy-v1; generate with it and with the base (log-probs)",
                           case_lora_load_generate),
    "lora_swap_versions": ("load v2 as policy-v2, unload policy-v1, generate with v2, then with the unloaded v1",
                           case_lora_swap_versions),
    "lora_error_bad_path": ("load_lora_adapter from a directory that does not exist", case_lora_error_bad_path),
    "lora_error_unknown_adapter": ("generate and unload naming an adapter never loaded",
                                   case_lora_error_unknown_adapter),
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (one JSON file per case)")
    parser.add_argument("--python", default="python3", help="the interpreter that has sglang (default python3)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="wait for /health (default 300)")
    parser.add_argument("--request-timeout-s", type=float, default=120.0, help="per request (default 120)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(out / "model", max_position_embeddings=2048)
    paths = {v: str(write_adapter(model_dir, out / "adapters" / v, seed)) for v, seed in (("v1", 1), ("v2", 2))}
    paths["missing"] = str(out / "adapters" / "missing")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [args.python, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), *LORA_ARGS]  # fmt: skip
    server = Server(cmd, url, out / "server.log")
    atexit.register(server.stop)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not start_server(server, "SGLang with --enable-lora", args.startup_timeout_s, "record_sglang_lora"):
        return 1
    manifest = new_manifest(embedded=False, version=engine_version(url), command=server.cmd[1:], adapter_rank=RANK)
    failed: list[str] = []
    for name, (description, run) in CASES.items():
        ctx = Ctx(long_new_tokens=0)
        _, survived = record_case(
            out, manifest, name, description, run, server=server, case_args=(paths,),
            request_timeout_s=args.request_timeout_s, ctx=ctx, width=30,
        )  # fmt: skip
        if ctx.problems:
            failed.append(name)
        if not survived:
            print(server.log_tail(), flush=True)
            break
    write_manifest(out, manifest, failed)
    server.stop()
    return 1 if failed or len(manifest["cases"]) < len(CASES) else 0


if __name__ == "__main__":
    sys.exit(main())
