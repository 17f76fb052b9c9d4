"""The family check against a live engine: the battery's conversations played through a real session server.

    PYTHONPATH=. python3 tools/gpu/family_check_live.py --engine http://127.0.0.1:30000 --model DIR --family qwen3

The model writes every assistant turn (the battery's user, system and tool messages are sent in between), so the
sampled tokens are real ones. For each turn it reports:
- hard: an HTTP error from the server, or a segment the server appended that differs from the same segment in a
  canonical re-render of the whole history (a TITO bug or a family that is not append-only);
- soft: a sampled turn whose parsed message does not render back to the sampled text (the model wrote something
  the template would spell differently; expected now and then, it does not change the trained tokens).
PASS when there is no hard problem. Works with the embedded engine on a CPU and with SGLang on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hpcrl.sessions.check import BATTERY  # noqa: E402
from hpcrl.sessions.config import SessionServerConfig  # noqa: E402
from hpcrl.sessions.messages import Message, parse_message  # noqa: E402
from hpcrl.sessions.server import SessionServer  # noqa: E402


def _wire(m: Message) -> dict:
    return m.to_openai()


def play(server: SessionServer, name: str, tools: tuple, battery: list[Message], max_tokens: int) -> dict:
    renderer = server.service.renderer
    family = renderer.family
    hard: list[str] = []
    soft = 0
    http = httpx.Client(base_url=server.url, timeout=600, trust_env=False)
    sid = http.post("/sessions", json={"limits": {"max_turns": 64, "max_episode_tokens": 10**6}}).json()["session_id"]
    sent: list[dict] = []
    turns = 0
    for m in battery:
        if m.role != "assistant":
            sent.append(_wire(m))
            continue
        r = http.post(
            f"/sessions/{sid}/v1/chat/completions",
            json={"messages": sent, "tools": list(tools), "max_tokens": max_tokens, "seed": turns},
        )
        if r.status_code != 200:
            hard.append(f"turn {turns + 1}: HTTP {r.status_code}: {r.text[:300]}")
            break
        sent.append(r.json()["choices"][0]["message"])
        turns += 1
    state = http.get(f"/sessions/{sid}").json()
    http.delete(f"/sessions/{sid}")
    messages = [parse_message(i, m) for i, m in enumerate(sent)]
    ends = [i for i, m in enumerate(messages) if m.role == "assistant"]
    for k, turn in enumerate(state["turns"]):
        sampled = renderer.assistant_text(turn["output_ids"])
        if family.assistant_body(messages[ends[k]]) != sampled:
            soft += 1
        if k == 0:
            canonical = renderer.encode(family.render(messages[: ends[0]], tools, add_generation_prompt=True))
        else:
            before = family.render(messages[: ends[k - 1] + 1], tools, add_generation_prompt=False)
            after = family.render(messages[: ends[k]], tools, add_generation_prompt=True)
            if not after.startswith(before):
                hard.append(f"turn {k + 1}: the canonical render is not append-only here")
                continue
            splice = renderer.close_ids(state["turns"][k - 1]["output_ids"])
            canonical = splice + renderer.encode(after[len(before) :])
        seq = state["sequences"][0]["token_ids"]
        start = sum(t["num_prompt_tokens"] + len(t["output_ids"]) for t in state["turns"][:k])
        appended = seq[start : start + turn["num_prompt_tokens"]]
        if appended != canonical:
            hard.append(f"turn {k + 1}: the appended segment differs from the canonical re-render")
    return {"conversation": name, "turns": turns, "hard": hard, "soft_assistant_text_mismatches": soft}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--model", required=True, help="model directory (its tokenizer)")
    ap.add_argument("--family", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    ns = ap.parse_args()
    cfg = SessionServerConfig(model_family=ns.family, model=ns.model, engine_urls=(ns.engine,))
    with SessionServer(cfg) as server:
        reports = [play(server, name, tools, msgs, ns.max_tokens) for name, (tools, msgs) in BATTERY.items()]
    num_turns = sum(r["turns"] for r in reports)
    hard = [f"{r['conversation']}: {h}" for r in reports for h in r["hard"]]
    soft = sum(r["soft_assistant_text_mismatches"] for r in reports)
    for line in hard:
        print("FAIL", line)
    verdict = "PASS" if not hard else "FAIL"
    print(
        f"{verdict}: family {ns.family}, {num_turns} live turns, {len(hard)} hard problems, "
        f"{soft} sampled turns that render back differently (soft)"
    )
    if ns.out:
        Path(ns.out).write_text(json.dumps(reports, indent=1))
    return 0 if not hard else 1


if __name__ == "__main__":
    sys.exit(main())
