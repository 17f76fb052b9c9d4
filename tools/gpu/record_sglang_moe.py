#!/usr/bin/env python3
"""Record what a real SGLang 0.5.16 server answers about routed experts on a tiny Qwen3-MoE model.

    python3 tools/gpu/record_sglang_moe.py --out DIR                  # SGLang (GPU): ~2 server starts, < 6 min
    python3 tools/gpu/record_sglang_moe.py --out DIR --embedded       # the same cases, hpcrl's embedded engine (CPU)

Copy DIR/*.json (manifest.json included) to tests/golden/sglang-0.5.16/moe/, where a replay test can read them
(format: tests/golden/sglang-0.5.16/README.md). The model is `hpcrl model init-tiny --moe` (2 layers, 8 experts,
top-2, float32, an untied head: SGLang's Qwen3-MoE loads no head from a tied checkpoint). First server: started with
--enable-return-routed-experts; cases server_info (the top-level `enable_return_routed_experts` key kept),
generate_routed_experts_single (one prompt, `return_routed_experts: true`, log-probs) and
generate_routed_experts_batch (2 prompts). Second server, the same model WITHOUT the flag (skipped with
--no-second-server): server_info_no_capture and generate_no_capture (the same request: what it answers). Each server
is started with --mem-fraction-static 0.9 and --max-total-tokens 65536 (other recorders may share the GPU); a case
with a transport error or a dead server is written with its `problems` and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import atexit
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_sglang import (  # noqa: E402 - the sibling recorder's server and recording helpers
    PROMPT,
    PROMPTS,
    SERVER_INFO_KEYS,
    Ctx,
    Recorder,
    Server,
    engine_version,
    free_port,
    new_manifest,
    record_case,
    start_server,
    write_manifest,
)

from hpcrl.engine.protocol.requests import GenerateRequest, SamplingParams  # noqa: E402

FLAG = "--enable-return-routed-experts"
SGLANG_ARGS = (
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--skip-server-warmup",
    "--mem-fraction-static",
    "0.9",
    "--max-total-tokens",
    "65536",
)
CAPTURE_KEY = "enable_return_routed_experts"
NEW_TOKENS = 8


def _routes_request(prompts: list[list[int]], seed: int) -> dict[str, Any]:
    return GenerateRequest(
        input_ids=prompts if len(prompts) > 1 else prompts[0],
        sampling_params=SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling_seed=seed),
        return_logprob=True,
        return_routed_experts=True,
    ).to_dict()


def _items(response: dict[str, Any]) -> list[dict[str, Any]]:
    body = response.get("body")
    return body if isinstance(body, list) else [body] if isinstance(body, dict) else []


def case_server_info(rec: Recorder, ctx: Ctx) -> None:
    response = rec.send("server_info", "GET", "/server_info")
    body = response.get("body")
    if isinstance(body, dict):
        ctx.notes["all_keys"] = len(body)
        response["body"] = {k: body[k] for k in (*SERVER_INFO_KEYS, CAPTURE_KEY) if k in body}
    ctx.expect(response["status"] == 200, f"server_info answered {response['status']}")


def _generate(prompts: list[list[int]], captured: bool) -> Callable[[Recorder, Ctx], None]:
    def run(rec: Recorder, ctx: Ctx) -> None:
        response = rec.send(f"generate {len(prompts)} prompt(s)", "POST", "/generate", _routes_request(prompts, 7))
        ctx.notes["prompt_lengths"] = [len(p) for p in prompts]
        ctx.notes["new_tokens"] = NEW_TOKENS
        if not captured:
            return  # what a server without the flag answers is the recording; nothing to expect of it
        ctx.expect(response["status"] == 200, f"generate answered {response['status']}")
        items = _items(response)
        ctx.expect(len(items) == len(prompts), f"{len(items)} answers for {len(prompts)} prompts")
        for item in items:
            ctx.expect(isinstance(item.get("meta_info", {}).get("routed_experts"), str), "no routed_experts string")

    return run


def _server_info(rec: Recorder, ctx: Ctx) -> None:
    case_server_info(rec, ctx)


CAPTURE_CASES: dict[str, tuple[str, Callable[[Recorder, Ctx], None]]] = {
    "server_info": (f"GET /server_info of a server started with {FLAG}, trimmed", case_server_info),
    "generate_routed_experts_single": (
        "one prompt with return_routed_experts and log-probs, 8 new tokens",
        _generate([list(PROMPT)], True),
    ),
    "generate_routed_experts_batch": (
        "2 prompts with return_routed_experts and log-probs, 8 new tokens each",
        _generate([list(p) for p in PROMPTS[:2]], True),
    ),
}
PLAIN_CASES: dict[str, tuple[str, Callable[[Recorder, Ctx], None]]] = {
    "server_info_no_capture": (f"GET /server_info of a server started without {FLAG}, trimmed", _server_info),
    "generate_no_capture": (
        f"the single-prompt return_routed_experts request to a server started without {FLAG}",
        _generate([list(PROMPT)], False),
    ),
}


def make_moe_model(model_dir: Path) -> Path:
    from hpcrl.model.tiny import TinyModelSpec, init_tiny_model

    config_file = model_dir / "config.json"
    # A tied checkpoint from an older recorder stores no lm_head.weight, which SGLang's Qwen3-MoE then leaves unloaded.
    if config_file.is_file() and json.loads(config_file.read_text()).get("tie_word_embeddings") is False:
        return model_dir
    return init_tiny_model(model_dir, TinyModelSpec(num_experts=8, num_experts_per_tok=2), overwrite=True)


def command(args: argparse.Namespace, model_dir: Path, port: int, capture: bool) -> list[str]:
    if args.embedded:
        return [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model_dir), "--port", str(port)]
    flag = [FLAG] if capture else []
    return [args.python, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), *SGLANG_ARGS, *flag]  # fmt: skip


def record(
    args: argparse.Namespace, model_dir: Path, capture: bool, cases: dict[str, Any], manifest: dict[str, Any]
) -> list[str]:
    """Start one server, run `cases` against it, write one file per case; the names of failed cases."""
    out: Path = args.out
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server(command(args, model_dir, port, capture), url, out / "server.log")
    atexit.register(server.stop)
    if not start_server(server, "the embedded engine" if args.embedded else "SGLang", args.startup_timeout_s,
                        "record_sglang_moe"):  # fmt: skip
        return list(cases)
    manifest["version"] = manifest.get("version") or engine_version(url)
    manifest["commands"].append(server.cmd[1:])
    failed = []
    for name, (description, run) in cases.items():
        ctx = Ctx(long_new_tokens=NEW_TOKENS)
        record_case(
            out, manifest, name, description, run, server=server, request_timeout_s=args.request_timeout_s, ctx=ctx,
            extra={"server_flags": [FLAG] if capture else []}, width=34,
        )  # fmt: skip
        if ctx.problems:
            failed.append(name)
    server.stop()
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (one JSON file per case)")
    parser.add_argument("--python", default="python3", help="the interpreter that has sglang (default python3)")
    parser.add_argument("--startup-timeout-s", type=float, default=240.0, help="wait for /health (default 240)")
    parser.add_argument("--request-timeout-s", type=float, default=120.0, help="per request (default 120)")
    parser.add_argument("--embedded", action="store_true", help="record hpcrl's embedded engine instead (CPU)")
    parser.add_argument("--no-second-server", action="store_true", help=f"skip the server without {FLAG}")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model_dir = make_moe_model(args.out / "model")
    manifest = new_manifest(embedded=args.embedded, version=None, commands=[])
    failed = record(args, model_dir, True, CAPTURE_CASES, manifest)
    if not args.no_second_server and not args.embedded:  # the embedded engine always captures
        failed += record(args, model_dir, False, PLAIN_CASES, manifest)
    write_manifest(args.out, manifest, failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
