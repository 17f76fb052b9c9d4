"""`hpcrl family check NAME --model DIR` and `hpcrl sessions serve ...`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str) -> Any:
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"--model {model_dir}: no tokenizer.json or tokenizer_config.json there")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _family_check(ns: argparse.Namespace) -> int:
    from hpcrl.sessions.check import check_family
    from hpcrl.sessions.families import get_family

    family = get_family(ns.name)
    num_turns, problems = check_family(family, load_tokenizer(ns.model))
    for problem in problems:
        print(f"FAIL {problem}")
    verdict = "append-only" if not problems else f"NOT append-only ({len(problems)} problem(s))"
    print(f"family {family.name}: {num_turns} assistant turns checked with the tokenizer of {ns.model}: {verdict}")
    return 0 if not problems else 1


def _engine_key(path: str | None) -> str | None:
    """The engines' key from --engine-api-key-file (mode 0600), else HPCRL_ENGINE_API_KEY, else none."""
    from hpcrl.engine.embedded.server_config import read_key_file

    if path is None:
        return os.environ.pop("HPCRL_ENGINE_API_KEY", None) or None
    return read_key_file(path, "--engine-api-key-file")


def _sessions_serve(ns: argparse.Namespace) -> int:
    from hpcrl.sessions.config import SessionServerConfig
    from hpcrl.sessions.server import serve

    cfg = SessionServerConfig(
        model_family=ns.family,
        model=ns.model,
        engine_urls=tuple(ns.engine),
        engine_api_key=_engine_key(ns.engine_api_key_file),
        host=ns.host,
        port=ns.port,
        max_turns=ns.max_turns,
        max_tokens_per_turn=ns.max_tokens_per_turn,
        max_episode_tokens=ns.max_episode_tokens,
    )
    serve(cfg)
    return 0


def add_session_commands(sub: argparse._SubParsersAction) -> None:
    family = sub.add_parser("family", help="model families for multi-turn sessions")
    cmds = family.add_subparsers(dest="family_cmd", required=True)
    p = cmds.add_parser(
        "check",
        help="check that a family renders append-only turn after turn with a tokenizer (CPU)",
        description="Render a battery of conversations (tool calls, several calls in one turn, tool errors, "
        "reasoning, system prompts) with the family's template and check that every turn's tokens extend the "
        "previous turn's, that the session server's incremental ids equal a full render, and that the parsers "
        "read each rendered turn back. Exit 0 when append-only, 1 otherwise.",
        epilog="example: hpcrl family check tiny --model runs/models/tiny-qwen3",
    )
    p.add_argument("name", help="a registered family: qwen3, tiny")
    p.add_argument("--model", required=True, help="model directory holding the tokenizer")
    p.set_defaults(func=_family_check)

    sessions = sub.add_parser("sessions", help="the multi-turn session server")
    scmds = sessions.add_subparsers(dest="sessions_cmd", required=True)
    s = scmds.add_parser(
        "serve",
        help="serve OpenAI chat completions per session, driving engines with token ids",
        description="Start the session server: POST /sessions, then POST /sessions/ID/v1/chat/completions with any "
        "OpenAI client (base_url=http://HOST:PORT/sessions/ID/v1); GET /sessions/ID shows the turns and training "
        "sequences; DELETE /sessions/ID ends it. Tokenization is the server's, with the named family.",
    )
    s.add_argument("--engine", action="append", required=True, help="engine URL (repeat for several engines)")
    s.add_argument("--model", required=True, help="model directory holding the tokenizer")
    s.add_argument("--family", required=True, help="model family: qwen3, tiny (never detected)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback only)")
    s.add_argument("--port", type=int, default=30100)
    s.add_argument(
        "--engine-api-key-file",
        help="file (mode 0600) holding the engines' API key; without it, HPCRL_ENGINE_API_KEY if set",
    )
    s.add_argument("--max-turns", type=int, default=8)
    s.add_argument("--max-tokens-per-turn", type=int, default=256)
    s.add_argument("--max-episode-tokens", type=int, default=4096)
    s.set_defaults(func=_sessions_serve)
