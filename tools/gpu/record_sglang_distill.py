#!/usr/bin/env python3
"""Record what a real SGLang server answers to the distillation teacher's scoring requests, one JSON file per case.

    python3 tools/gpu/record_sglang_distill.py --out /tmp/sglang-distill             # SGLang on a tiny model (GPU)
    python3 tools/gpu/record_sglang_distill.py --out /tmp/embedded-distill --embedded  # hpcrl's embedded engine (CPU)

A teacher scores the student's tokens with a /generate of `max_new_tokens: 0`, `return_logprob: true`,
`logprob_start_len` at the prompt's last token (its entry is null) and, with distill.top_k, `top_logprobs_num`; the
answer's `meta_info.input_token_logprobs` and `meta_info.input_top_logprobs` hold the teacher's log-probs. The cases are
exactly the requests hpcrl.rollout.teacher builds. Copy the *.json files (manifest.json included) to
tests/golden/sglang-0.5.16/distill/, where a replay test can read them through hpcrl's
client and parsers (same format as tools/gpu/record_sglang.py's, described in tests/golden/sglang-0.5.16/README.md).

The server runs with `--mem-fraction-static 0.9 --max-total-tokens 65536` (other recorders may share the GPU);
start-up takes 130-150 s on an H100, the cases a few seconds: under 4 minutes in all.
"""

from __future__ import annotations

import argparse
import atexit
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from record_sglang import (  # noqa: E402 - the sibling recorder, found through the path above
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

# "12+3=45<|im_end|>" in the tiny model's character tokenizer: a prompt of 6 tokens and a response of 3.
SEQUENCES = [[1, 20, 21, 14, 22, 32, 23, 24, 2], [1, 20, 14, 21, 32, 22, 23, 2]]
PROMPT_LEN = 6
TOP_K = 4
SGLANG_ARGS = (
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
    "--skip-server-warmup", "--mem-fraction-static", "0.9", "--max-total-tokens", "65536",
)  # fmt: skip


def _scoring(top_k: int, start: int = PROMPT_LEN) -> dict[str, Any]:
    """The teacher's request (hpcrl.rollout.teacher._requests): one logprob_start_len for a batch."""
    return GenerateRequest(
        input_ids=[list(s) for s in SEQUENCES],
        sampling_params=SamplingParams(max_new_tokens=0),
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=top_k,
    ).to_dict()


def _results(response: dict[str, Any]) -> list[dict[str, Any]]:
    body = response.get("body")
    return body if isinstance(body, list) else []


def case_distill_scoring(rec: Recorder, ctx: Ctx) -> None:
    # hpcrl.rollout.teacher's start: the prompt's last token, whose entry is null, then one per response token.
    answer = rec.send("teacher scoring, no top-k", "POST", "/generate", _scoring(0, PROMPT_LEN - 1))
    ctx.expect(answer["status"] == 200, f"generate answered {answer['status']}")
    for seq, result in zip(SEQUENCES, _results(answer), strict=False):
        lps = result.get("meta_info", {}).get("input_token_logprobs") or []
        ctx.expect(len(lps) == len(seq) - PROMPT_LEN + 1, f"{len(lps)} input_token_logprobs entries")
        ctx.expect(bool(lps) and lps[0][0] is None, "the first entry is not null")
        ctx.expect(all(isinstance(e[0], float) for e in lps[1:]), "a response token without a log-prob")
        ctx.expect(result.get("output_ids") == [], "output_ids not empty with max_new_tokens=0")
    # From the response's first token the first response token gets null: why the teacher starts one earlier.
    late = rec.send("teacher scoring from the response's first token", "POST", "/generate", _scoring(0))
    ctx.notes["first_entry_from_response_start"] = [
        (r.get("meta_info", {}).get("input_token_logprobs") or [[None]])[0][0] for r in _results(late)
    ]


def case_distill_scoring_top_k(rec: Recorder, ctx: Ctx) -> None:
    answer = rec.send("teacher scoring with top_logprobs_num", "POST", "/generate", _scoring(TOP_K, PROMPT_LEN - 1))
    ctx.expect(answer["status"] == 200, f"generate answered {answer['status']}")
    for seq, result in zip(SEQUENCES, _results(answer), strict=False):
        top = result.get("meta_info", {}).get("input_top_logprobs") or []
        ctx.expect(len(top) == len(seq) - PROMPT_LEN + 1, f"{len(top)} input_top_logprobs entries")
        ctx.expect(bool(top) and top[0] is None, "the first entry is not null")
        ctx.expect(all(isinstance(e, list) and len(e) == TOP_K for e in top[1:]), "an entry without top_k pairs")
    whole = rec.send("top_logprobs_num from the prompt's first token", "POST", "/generate", _scoring(TOP_K, 0))
    ctx.expect(whole["status"] == 200, f"generate answered {whole['status']}")
    first = [r.get("meta_info", {}).get("input_top_logprobs", [None])[0] for r in _results(whole)]
    ctx.notes["first_entry_from_0"] = first


CASES = {
    "distill_scoring": ("a teacher's scoring: max_new_tokens=0 from the prompt's last token", case_distill_scoring),
    "distill_scoring_top_k": ("the same with top_logprobs_num (distill.top_k)", case_distill_scoring_top_k),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (one JSON file per case)")
    parser.add_argument("--model", type=Path, help="model directory (default: a tiny model made under --out)")
    parser.add_argument("--python", default="python3", help="the interpreter that has sglang (default python3)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="wait for /health (default 300)")
    parser.add_argument("--request-timeout-s", type=float, default=60.0, help="per request (default 60)")
    parser.add_argument("--embedded", action="store_true", help="record hpcrl's embedded engine instead (CPU)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model or make_model(out / "model", max_position_embeddings=1024)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if args.embedded:
        cmd = [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model_dir), "--port", str(port)]
    else:
        cmd = [args.python, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), *SGLANG_ARGS]  # fmt: skip
    server = Server(cmd, url, out / "server.log")
    atexit.register(server.stop)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    what = "the embedded engine" if args.embedded else "SGLang"
    if not start_server(server, what, args.startup_timeout_s, "record_sglang_distill"):
        return 1
    manifest = new_manifest(embedded=args.embedded, version=engine_version(url), command=cmd[1:])
    failed = []
    for name, (description, run) in CASES.items():
        ctx = Ctx(long_new_tokens=0)
        record_case(
            out, manifest, name, description, run, server=server, request_timeout_s=args.request_timeout_s, ctx=ctx,
            width=28,
        )  # fmt: skip
        if ctx.problems:
            failed.append(name)
    write_manifest(out, manifest, failed)
    server.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
