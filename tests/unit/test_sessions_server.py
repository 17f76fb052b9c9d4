"""The session server driven by the `openai` client against a real embedded engine on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from hpcrl.sessions.cli import load_tokenizer
from hpcrl.sessions.config import SessionServerConfig
from hpcrl.sessions.families import get_family
from hpcrl.sessions.messages import parse_messages, parse_tools
from hpcrl.sessions.server import HEAD_TIMEOUT_S, SessionServer
from tests.support import assert_unfinished_heads_are_dropped

CALC = {
    "type": "function",
    "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {}}}},
}


@pytest.fixture(scope="module")
def server(shared_engine: Any, tiny_model_dir: Path) -> Iterator[SessionServer]:
    cfg = SessionServerConfig(model_family="tiny", model=str(tiny_model_dir), engine_urls=(shared_engine.url,))
    with SessionServer(cfg) as srv:
        yield srv


def new_session(server: SessionServer, **body: Any) -> tuple[str, openai.OpenAI]:
    r = httpx.post(f"{server.url}/sessions", json=body, trust_env=False)
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    return sid, openai.OpenAI(base_url=f"{server.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)


def read(server: SessionServer, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/sessions/{sid}", trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def as_dict(message: Any) -> dict[str, Any]:
    return message.model_dump(exclude_none=True)


def two_turns(server: SessionServer, **create: Any) -> tuple[str, openai.OpenAI, list[dict[str, Any]], Any]:
    sid, client = new_session(server, **create)
    first = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "12*34?"}]
    r1 = client.chat.completions.create(model="tiny", messages=first, tools=[CALC], max_tokens=6, seed=1)
    history = [*first, as_dict(r1.choices[0].message), {"role": "user", "content": "And 5*6?"}]
    r2 = client.chat.completions.create(
        model="tiny", messages=history, tools=[CALC], max_tokens=6, seed=2, logprobs=True
    )
    return sid, client, [*history, as_dict(r2.choices[0].message)], r2


def test_two_turns_record_sampled_tokens_and_mask_everything_else(server: SessionServer, tiny_model_dir: Path) -> None:
    sid, _, history, r2 = two_turns(server)
    state = read(server, sid)
    assert state["num_turns"] == 2 and len(state["sequences"]) == 1
    t1, t2 = state["turns"]
    seq = state["sequences"][0]
    for turn in (t1, t2):
        n = len(turn["output_ids"])
        assert 1 <= n <= 6 and len(turn["logprobs"]) == n and all(lp <= 0 for lp in turn["logprobs"])
        # An int per token: the engine, started without --weight-version, reports SGLang's "default" (version 0).
        assert turn["weight_versions"] == [0] * n and turn["finish_reason"] in ("stop", "length")
    # The client saw exactly the recorded log-probs of turn 2.
    assert [c.logprob for c in r2.choices[0].logprobs.content] == pytest.approx(t2["logprobs"])
    # Token ids: turn-1 prompt, sampled turn 1, splice + appended user message, sampled turn 2; only sampled train.
    n1, o1, n2, o2 = t1["num_prompt_tokens"], t1["output_ids"], t2["num_prompt_tokens"], t2["output_ids"]
    ids = seq["token_ids"]
    assert len(ids) == n1 + len(o1) + n2 + len(o2)
    assert ids[n1 : n1 + len(o1)] == o1 and ids[-len(o2) :] == o2
    assert seq["loss_mask"] == [0] * n1 + [1] * len(o1) + [0] * n2 + [1] * len(o2)
    assert seq["logprobs"] == [0.0] * n1 + t1["logprobs"] + [0.0] * n2 + t2["logprobs"]
    tok = load_tokenizer(str(tiny_model_dir))
    family = get_family("tiny")
    messages = parse_messages(history)
    assert tok.decode(ids[:n1]) == family.render(messages[:2], parse_tools([CALC]), add_generation_prompt=True)
    spliced = tok.decode(ids[n1 + len(o1) : n1 + len(o1) + n2])
    closing = "\n" if o1[-1] == tok.convert_tokens_to_ids("<|im_end|>") else "<|im_end|>\n"
    assert spliced == closing + "<|im_start|>user\nAnd 5*6?<|im_end|>\n<|im_start|>assistant\n"


def test_token_fields_a_client_sends_are_ignored(server: SessionServer, tiny_model_dir: Path) -> None:
    sid, client = new_session(server)
    messages = [{"role": "user", "content": "Hi"}]
    client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, extra_body={"input_ids": [5, 6, 7], "prompt_token_ids": [1]}
    )
    turn = read(server, sid)["turns"][0]
    tok = load_tokenizer(str(tiny_model_dir))
    prompt = read(server, sid)["sequences"][0]["token_ids"][: turn["num_prompt_tokens"]]
    assert tok.decode(prompt) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_linear_session_refuses_a_diverged_history_with_400(server: SessionServer) -> None:
    sid, client, history, _ = two_turns(server)
    edited = [*history[:3], {"role": "user", "content": "And 7*8?"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=edited, tools=[CALC], max_tokens=4)
    message = str(err.value)
    assert "message 3 diverges (content: stored 'And 5*6?', sent 'And 7*8?')" in message
    assert "mode 'branching'" in message
    assert read(server, sid)["num_turns"] == 2, "a refused request records nothing"


def test_branching_session_starts_a_branch_and_trains_the_shared_turn_once(server: SessionServer) -> None:
    sid, client, history, _ = two_turns(server, mode="branching")
    edited = [*history[:3], {"role": "user", "content": "And 7*8?"}]
    client.chat.completions.create(model="tiny", messages=edited, tools=[CALC], max_tokens=4, seed=3)
    state = read(server, sid)
    t1, t2, t3 = state["turns"]
    assert (t2["parent"], t3["parent"]) == (0, 0), "the edited request branches from turn 0"
    a, b = state["sequences"]
    assert (a["turns"], b["turns"]) == ([0, 1], [0, 2])
    n1, o1 = t1["num_prompt_tokens"], len(t1["output_ids"])
    assert a["token_ids"][: n1 + o1] == b["token_ids"][: n1 + o1], "the branches share turn 0's tokens"
    assert a["loss_mask"][n1 : n1 + o1] == [1] * o1 and b["loss_mask"][n1 : n1 + o1] == [0] * o1
    assert sum(b["loss_mask"]) == len(t3["output_ids"])


def test_episode_limits_end_the_session_with_a_recorded_reason(server: SessionServer) -> None:
    sid, client = new_session(server, limits={"max_turns": 1})
    first = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="tiny", messages=first, max_tokens=3)
    with pytest.raises(openai.ConflictError, match=r"episode has ended \(max_turns"):
        client.chat.completions.create(
            model="tiny", messages=[*first, as_dict(r.choices[0].message), {"role": "user", "content": "more"}]
        )
    assert read(server, sid)["end_reason"] == "max_turns"

    sid, client = new_session(server, limits={"max_tokens_per_turn": 2})
    r = client.chat.completions.create(model="tiny", messages=first, max_tokens=50, temperature=1.0, seed=0)
    turn = read(server, sid)["turns"][0]
    # The random model stops within 2 tokens only by sampling a stop token; either way the record says which.
    expected = "max_tokens_per_turn" if turn["finish_reason"] == "length" else None
    assert len(turn["output_ids"]) <= 2 and read(server, sid)["end_reason"] == expected
    assert r.session["end_reason"] == expected  # type: ignore[attr-defined]

    sid, client = new_session(server, limits={"max_episode_tokens": 10})
    with pytest.raises(openai.ConflictError, match=r"max_episode_tokens: the prompt has 21 tokens, the budget is 10"):
        client.chat.completions.create(model="tiny", messages=first)
    assert read(server, sid)["end_reason"] == "max_episode_tokens"


def test_bad_requests_are_clear_errors_and_delete_ends_a_session(server: SessionServer) -> None:
    sid, client = new_session(server)
    with pytest.raises(openai.BadRequestError, match=r"unknown field\(s\) \['frobnicate'\]"):
        client.chat.completions.create(
            model="t", messages=[{"role": "user", "content": "x"}], extra_body={"frobnicate": 1}
        )
    with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
        client.chat.completions.create(model="t", messages=[{"role": "user", "content": "x"}], stream=True)
    r = httpx.post(f"{server.url}/sessions", json={"mode": "tree"}, trust_env=False)
    assert r.status_code == 400 and "mode must be one of ['linear', 'branching']" in r.text
    with httpx.Client(base_url=server.url, trust_env=False) as http:  # one kept-alive connection
        wrong = http.post("/sessions/nope/v2/chat", json={"messages": ["x" * 1000]})
        assert wrong.status_code == 404 and "no route POST /sessions/nope/v2/chat" in wrong.text
        assert http.get("/health").json()["status"] == "ok", "the unread body must not leak into the next request"
    assert httpx.delete(f"{server.url}/sessions/{sid}", trust_env=False).status_code == 204
    with pytest.raises(openai.NotFoundError, match="no session"):
        client.chat.completions.create(model="t", messages=[{"role": "user", "content": "x"}])


def test_a_character_the_tokenizer_cannot_encode_is_refused_with_400_naming_it(server: SessionServer) -> None:
    """The run refuses such a character in its data (it would train as the unknown token); a request is no
    different: HTTP 400 naming the field, the character and its position, and nothing recorded."""
    sid, _ = new_session(server)
    url = f"{server.url}/sessions/{sid}/v1/chat/completions"
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "12*34 café?"}]
    r = httpx.post(url, json={"messages": messages, "max_tokens": 2}, trust_env=False)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "messages[1].content holds the character 'é' (U+00E9) at character 9" in message, message
    assert "cannot encode" in message and read(server, sid)["num_turns"] == 0
    tool = {"type": "function", "function": {"name": "calculator", "description": "naïve"}}
    r = httpx.post(url, json={"messages": messages[:1] + [{"role": "user", "content": "1*2?"}], "tools": [tool]},
                   trust_env=False)  # fmt: skip
    assert r.status_code == 400 and "tools[0] holds the character 'ï' (U+00EF)" in r.json()["error"]["message"]
    # The same session then serves a clean request.
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "12*34?"}], "max_tokens": 2}, trust_env=False)
    assert r.status_code == 200, r.text


def test_tool_errors_go_back_to_the_model_and_the_server_keeps_serving(server: SessionServer) -> None:
    from hpcrl.sessions.environment import CalculatorEnvironment
    from hpcrl.sessions.sandbox import SandboxLimits

    env = CalculatorEnvironment(SandboxLimits(cpu_s=1, memory_mb=128))
    episode = env.start({"prompt": "12*12?", "answer": 144})
    for i, code in enumerate(["while True: pass", "x = bytearray(10**10)", "import os", "import socket", "12*12"]):
        sid, client = new_session(server)
        r = client.chat.completions.create(model="t", messages=episode.messages, tools=episode.tools, max_tokens=3)
        # A client-injected assistant turn calling the tool (rendered, masked), then the tool's answer.
        call = {"type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": code})}}
        result = env.call_tool(episode, "calculator", {"expression": code})
        assert result.error == (code != "12*12"), result.content
        history = [*episode.messages, as_dict(r.choices[0].message)]
        history += [
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", **call}]},
            result.message(f"c{i}"),
        ]
        r = client.chat.completions.create(model="t", messages=history, tools=episode.tools, max_tokens=3)
        assert r.choices[0].message.role == "assistant"
        state = read(server, sid)
        assert state["num_turns"] == 2
        spliced = state["sequences"][0]["loss_mask"]
        assert sum(spliced) == sum(len(t["output_ids"]) for t in state["turns"]), "injected turns do not train"


def test_top_k_turns_record_their_supports_and_other_tokens_train_on_singletons(server: SessionServer) -> None:
    """With top_k a turn records each sampled token's support and the log-prob renormalised over it; the training
    sequence gives the tokens the model did not sample (prompt, splice, the appended message) singleton supports."""
    sid, client = new_session(server)
    first = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "12*34?"}]
    body = {"top_k": 5, "top_p": 0.9}
    r1 = client.chat.completions.create(
        model="tiny", messages=first, tools=[CALC], max_tokens=6, seed=1, extra_body=body
    )
    history = [*first, as_dict(r1.choices[0].message), {"role": "user", "content": "And 5*6?"}]
    client.chat.completions.create(model="tiny", messages=history, tools=[CALC], max_tokens=6, seed=2, extra_body=body)
    state = read(server, sid)
    seq = state["sequences"][0]
    ids, mask, lps, supports = seq["token_ids"], seq["loss_mask"], seq["logprobs"], seq["supports"]
    assert len(supports) == len(ids)
    sampled = [i for i, m in enumerate(mask) if m]
    assert sampled and all(ids[i] in supports[i] and 1 <= len(supports[i]) <= 5 for i in sampled)
    assert all(supports[i] == [ids[i]] for i, m in enumerate(mask) if not m)
    assert any(len(supports[i]) > 1 for i in sampled)  # a real filter, not only singletons
    # The recorded log-probs are the support-renormalised ones: a token alone in its support has log-prob 0.
    assert all(lps[i] <= 0 for i in sampled)
    assert all(lps[i] == pytest.approx(0.0, abs=1e-6) for i in sampled if len(supports[i]) == 1)
    # Without top_k nothing is recorded (and the sequence carries no supports).
    sid2, _, _, _ = two_turns(server)
    assert "supports" not in read(server, sid2)["sequences"][0]


def test_run_episode_drives_a_session_and_reports_its_accounting(server: SessionServer) -> None:
    from hpcrl.sessions.environment import episode_metrics, load_environment, run_episode

    result = run_episode(
        load_environment("calculator"),
        {"prompt": "2*3?", "answer": 6},
        server.url,
        sampling={"max_tokens": 4, "seed": 0},
    )
    assert result.num_turns >= 1 and len(result.sequences) == 1
    assert result.end_reason in ("answered", "truncated", "max_turns", "max_tokens_per_turn", "max_episode_tokens")
    assert result.reward in (0.0, 1.0) and result.reward_error is None
    metrics = episode_metrics([result])
    assert metrics["rollout/turns_mean"] == result.num_turns
    assert metrics["rollout/episode_tokens_mean"] == len(result.sequences[0]["token_ids"])
    r = httpx.get(f"{server.url}/sessions", trust_env=False)
    assert r.status_code == 405, "GET /sessions is not a route; POST is"


def test_rollout_groups_make_trainable_groups_from_episodes(server: SessionServer) -> None:
    from hpcrl.rollout.episodes import rollout_groups
    from hpcrl.samples.sample import Example
    from hpcrl.sessions.environment import load_environment
    from hpcrl.trainer.advantage import batch_from_groups

    examples = [Example(prompt="2*3?", answer="6"), Example(prompt="4*5?", answer="20")]
    env = load_environment("calculator")
    # One episode at a time: the same seed then meets the same batch, so the repeat is bit-identical.
    kwargs: dict[str, Any] = {
        "num_samples": 2,
        "step": 0,
        "seed": 1,
        "sampling": {"max_tokens": 3},
        "max_concurrency": 1,
    }
    groups, metrics = rollout_groups(env, examples, server.url, **kwargs)
    again, _ = rollout_groups(env, examples, server.url, **kwargs)
    assert [len(g.samples) for g in groups] == [2, 2]
    assert [s.output_ids for g in groups for s in g.samples] == [s.output_ids for g in again for s in g.samples]
    assert metrics["rollout/turns_mean"] >= 1
    batch = batch_from_groups(groups, normalize_std=True)
    assert batch.num_response_tokens == sum(sum(s.loss_mask or []) for g in groups for s in g.samples)


def test_a_dead_engine_fails_over_and_no_engine_ends_the_episode(shared_engine: Any, tiny_model_dir: Path) -> None:
    from hpcrl.sessions.environment import load_environment, run_episode
    from tests.support import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = SessionServerConfig(model_family="tiny", model=str(tiny_model_dir), engine_urls=(dead, shared_engine.url))
    with SessionServer(cfg) as srv:
        sid, client = new_session(srv)  # the first session is pinned to the first engine: the dead one
        r = client.chat.completions.create(model="t", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert r.choices[0].message.role == "assistant" and read(srv, sid)["num_turns"] == 1
    only_dead = SessionServerConfig(model_family="tiny", model=str(tiny_model_dir), engine_urls=(dead,))
    with SessionServer(only_dead) as srv:
        result = run_episode(load_environment("calculator"), {"prompt": "2*3?", "answer": 6}, srv.url)
        assert (result.end_reason, result.num_turns, result.sequences) == ("engine_failed", 0, [])


def test_a_dropped_connection_to_a_live_engine_resends_the_turn_with_the_same_tokens(
    shared_engine: Any, tiny_model_dir: Path
) -> None:
    """The H200 runs lost a turn to a connection that closed under a live SGLang server. Here a proxy in front of a
    real engine closes the first /generate's connection unanswered: the turn is sent again (the engine answers
    /health) and samples what a direct session with the same seed samples, and the episode goes on."""
    import socket
    import threading

    from tests.support import tcp_server

    upstream = httpx.URL(shared_engine.url)
    dropped: list[bytes] = []

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        with src, dst:
            while chunk := src.recv(65536):
                dst.sendall(chunk)

    def handle(conn: socket.socket) -> None:
        up = socket.create_connection((upstream.host, upstream.port))
        threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
        with conn, up:
            # A client sends its next request on a kept-alive connection only after the last answer, so each
            # request starts a chunk. The first /generate need not be its connection's first request: the engine
            # client asks /server_info (which log-prob wire) before it, on the same connection.
            while chunk := conn.recv(65536):
                if chunk.startswith(b"POST /generate") and not dropped:
                    dropped.append(chunk.split(b"\r\n")[0])
                    up.shutdown(socket.SHUT_RDWR)
                    return  # the connection closes: this /generate gets no answer at all
                up.sendall(chunk)

    listener = tcp_server(handle)
    proxied = f"http://127.0.0.1:{listener.getsockname()[1]}"
    messages = [{"role": "user", "content": "12*34?"}]
    outputs = []
    try:
        for url in (shared_engine.url, proxied):
            cfg = SessionServerConfig(model_family="tiny", model=str(tiny_model_dir), engine_urls=(url,))
            with SessionServer(cfg) as srv:
                sid, client = new_session(srv)
                r = client.chat.completions.create(model="t", messages=messages, max_tokens=6, seed=7)
                assert r.choices[0].message.role == "assistant"
                turns = read(srv, sid)["turns"]
                outputs.append([(t["output_ids"], t["logprobs"]) for t in turns])
    finally:
        listener.close()
    assert dropped == [b"POST /generate HTTP/1.1"]
    assert len(outputs[1]) == 1 and outputs[1] == outputs[0]


def test_a_connection_that_never_finishes_its_request_head_is_dropped(server: SessionServer) -> None:
    # Each connection holds one of the server's threads: a silent or dribbling client must not hold it for ever.
    assert_unfinished_heads_are_dropped(server.url, HEAD_TIMEOUT_S)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
