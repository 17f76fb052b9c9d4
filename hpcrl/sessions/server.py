"""The session server: OpenAI chat completions per session, engines driven with token ids.

    hpcrl sessions serve --engine http://127.0.0.1:30000 --model DIR --family tiny [--port 30100]

Routes (the session id is in the path, so any OpenAI client with base_url=http://HOST:PORT/sessions/ID/v1 is a
harness):
    GET    /health
    POST   /sessions                              {"mode": "linear"|"branching", "limits": {...}} -> {"session_id"}
    GET    /sessions/ID                           turns (ids, log-probs, weight versions, finish) and sequences
    DELETE /sessions/ID                           204
    POST   /sessions/ID/v1/chat/completions       OpenAI body: messages, tools, max_tokens, temperature, top_p, seed

Tokenization is the server's: turn 1 is rendered with the family's template; later turns reuse the stored ids and
tokenize only the appended messages. Token fields a client sends are ignored. Sessions live in memory.
Errors are OpenAI-shaped ({"error": {"message", "type", "code"}}): 400 bad request or diverged history, 404 no such
session, 409 episode ended (its reason), 429 too many sessions, 502 the engine failed (nothing recorded: retry).
With `api_key` set (a run's own server always has one), every route but /health answers 401 without
`Authorization: Bearer <key>`.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from hpcrl.engine.client import EngineClient
from hpcrl.engine.errors import EngineBusyError, EngineError, EngineRequestError, EngineUnreachableError
from hpcrl.engine.portcheck import bind_error, check_port_free
from hpcrl.engine.protocol.answers import GenerateResult
from hpcrl.engine.protocol.requests import SamplingParams
from hpcrl.engine.supports import checked_supports
from hpcrl.engine.versions import token_weight_versions
from hpcrl.model.moe import decode_routes
from hpcrl.sessions.config import MODES, EpisodeLimits, SessionServerConfig
from hpcrl.sessions.families import get_family
from hpcrl.sessions.messages import Message, MessageError, parse_messages, parse_tools
from hpcrl.sessions.session import Session, SessionError, Turn
from hpcrl.sessions.tokens import Renderer, TemplateError, first_unencodable

log = logging.getLogger("hpcrl.sessions")

# Token fields a client may send (a TITO-aware harness, a retry echoing a response): tokenization is the server's,
# so they are dropped, never trusted.
IGNORED_TOKEN_FIELDS = frozenset(
    {
        "input_ids",
        "prompt_token_ids",
        "token_ids",
        "prompt_ids",
        "output_ids",
        "completion_token_ids",
        "return_token_ids",
        "logprob_start_len",
    }
)
CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "tools",
        "tool_choice",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "n",
        "stream",
        "logprobs",
        "top_logprobs",
        "user",
        "parallel_tool_calls",
    }
)
_MAX_BODY_BYTES = 64 * 1024 * 1024


def _number(body: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise SessionError(400, f"{key} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    return kind(value)


# The engines a server drives: fixed clients, or a function giving the current ones (one per engine, in order).
Engines = list[EngineClient] | Callable[[], Sequence[EngineClient]]


def _check_encodable(tokenizer: Any, messages: list[Message], tools: tuple[dict[str, Any], ...]) -> None:
    """A character the tokenizer cannot encode would reach the model as its unknown token: refused, as a run refuses
    it in its data."""
    fields = _chat_fields(messages, tools)
    bad = first_unencodable(tokenizer, [text for _, text in fields])
    if bad is not None:
        raise SessionError(
            400, f"{fields[bad.index][0]} holds {bad.describe()}; remove or replace it, or serve a model whose "
            "tokenizer covers it",
        )  # fmt: skip


def _turn_routes(
    routes_shape: tuple[int, int], url: str, result: GenerateResult, num_input: int, *, first: int
) -> np.ndarray:
    """The routes of the tokens a turn's request ran first (from `first`), checked to cover every token it ran:
    [input + output - 1, layers, top-k] in the engine's answer."""
    text = result.meta_info.get("routed_experts")
    if not isinstance(text, str):
        raise SessionError(
            502, f"the engine at {url} answered no meta_info.routed_experts, which routing replay needs: start "
            "SGLang with --enable-return-routed-experts (or set train.routing_replay: off); nothing was recorded",
        )  # fmt: skip
    try:
        routes = decode_routes(text, *routes_shape)
    except ValueError as exc:
        raise SessionError(502, f"the engine at {url}: {exc}; nothing was recorded") from None
    want = (num_input + len(result.output_ids) - 1, *routes_shape)
    if routes.shape != want:
        raise SessionError(
            502, f"the engine at {url} answered routed experts of shape {routes.shape}, but this turn's "
            f"{want[0] + 1} tokens on this model need {want}; nothing was recorded",
        )  # fmt: skip
    return routes[first:]


class SessionService:
    """The HTTP-agnostic core: sessions in memory, each pinned to one engine."""

    def __init__(
        self, cfg: SessionServerConfig, tokenizer: Any, engines: Engines, routes_shape: tuple[int, int] | None = None
    ) -> None:
        """`routes_shape`: (decoder layers, top-k) of a mixture-of-experts model whose routes the trainer replays:
        every turn asks its engine for the routed experts and keeps those of the tokens it ran first."""
        self.cfg = cfg
        self.routes_shape = routes_shape
        self.renderer = Renderer(get_family(cfg.model_family), tokenizer)
        self._engines = engines
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._next_engine = 0

    @property
    def engines(self) -> list[EngineClient]:
        """The engines now: a run's fleet gives a restarted engine's new client here (the same count, each at its
        index)."""
        return list(self._engines()) if callable(self._engines) else self._engines

    # ---------------------------------------------------------------------------------------------- lifecycle

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(body) - {"mode", "limits"})
        if unknown:
            raise SessionError(400, f"unknown field(s) {unknown} in POST /sessions; valid: ['limits', 'mode']")
        mode = body.get("mode", "linear")
        if mode not in MODES:
            raise SessionError(400, f"mode must be one of {list(MODES)}, got {mode!r}")
        limits_body = body.get("limits") or {}
        if not isinstance(limits_body, dict):
            raise SessionError(400, "limits must be an object, e.g. {'max_turns': 4}")
        try:
            limits = self.cfg.limits.replace(limits_body)
        except ValueError as exc:
            raise SessionError(400, str(exc)) from None
        with self._lock:
            if len(self.sessions) >= self.cfg.max_sessions:
                raise SessionError(429, f"{len(self.sessions)} sessions are open (max_sessions); delete finished ones")
            session_id = secrets.token_hex(16)
            self.sessions[session_id] = Session(session_id, mode=mode, limits=limits, engine_index=self._next_engine)
            self._next_engine = (self._next_engine + 1) % len(self.engines)
        return {"session_id": session_id, "mode": mode}

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(404, f"no session {session_id!r} (never created, or deleted)")
        return session

    def delete(self, session_id: str) -> None:
        session = self.get(session_id)
        with session.lock:  # a turn in flight finishes first
            session.closed = True
            with self._lock:
                self.sessions.pop(session_id, None)

    # ------------------------------------------------------------------------------------------------------ chat

    def chat(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        session = self.get(session_id)
        request = self._parse_chat(body)
        with session.lock:
            if session.closed:
                raise SessionError(404, f"session {session_id!r} was deleted")
            if session.end_reason is not None:
                raise SessionError(409, f"the episode has ended ({session.end_reason}); start a new session")
            return self._turn(session, **request)

    def _parse_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(body) - CHAT_FIELDS - IGNORED_TOKEN_FIELDS)
        if unknown:
            raise SessionError(400, f"unknown field(s) {unknown} in the chat request; valid: {sorted(CHAT_FIELDS)}")
        if body.get("stream"):
            raise SessionError(400, "stream=true is not supported by sessions; send stream=false")
        if body.get("n", 1) != 1:
            raise SessionError(400, "n must be 1: a session extends one history per request")
        if body.get("tool_choice") not in (None, "auto"):
            raise SessionError(400, f"tool_choice {body['tool_choice']!r} is not supported; use 'auto' or omit it")
        if body.get("top_logprobs"):
            raise SessionError(400, "top_logprobs is not supported; logprobs=true returns each sampled token's")
        try:
            messages = parse_messages(body.get("messages"))
            tools = parse_tools(body.get("tools"))
        except MessageError as exc:
            raise SessionError(400, str(exc)) from None
        _check_encodable(self.renderer.tokenizer, messages, tools)
        stop = body.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        max_tokens = _number(body, "max_completion_tokens", int, None) or _number(body, "max_tokens", int, None)
        if max_tokens is not None and max_tokens < 1:
            raise SessionError(400, f"max_tokens must be >= 1, got {max_tokens}")
        try:
            params = SamplingParams(
                temperature=_number(body, "temperature", float, 1.0),
                top_p=_number(body, "top_p", float, 1.0),
                top_k=_number(body, "top_k", int, -1),
                sampling_seed=_number(body, "seed", int, None),
                stop=tuple(stop),
            )
        except ValueError as exc:
            raise SessionError(400, str(exc)) from None
        return {
            "messages": messages,
            "tools": tools,
            "params": params,
            "max_tokens": max_tokens,
            "want_logprobs": bool(body.get("logprobs")),
        }

    def _turn(
        self,
        session: Session,
        *,
        messages: list,
        tools: tuple,
        params: SamplingParams,
        max_tokens: int | None,
        want_logprobs: bool,
    ) -> dict[str, Any]:
        parent, tail = session.attach(messages, tools)
        family = self.renderer.family
        if parent is not None:
            bad = [m.role for m in tail if m.role not in family.allowed_append_roles]
            if bad:
                raise SessionError(400, f"family {family.name} cannot append role(s) {bad}")
        try:
            if parent is None:
                prompt_ids = self.renderer.prompt_ids(messages, tools)
                history: list[int] = []
            else:
                history = parent.token_ids()
                prompt_ids = self.renderer.close_ids(parent.output_ids) + self.renderer.tail_ids(tail)
        except TemplateError as exc:
            raise SessionError(500, str(exc)) from None
        limits = session.limits
        depth = 1 if parent is None else parent.depth + 1
        if depth > limits.max_turns:
            session.end("max_turns")
            raise SessionError(409, f"the episode has ended (max_turns: {limits.max_turns} turns were generated)")
        total = len(history) + len(prompt_ids)
        room = limits.max_episode_tokens - total
        if room < 1:
            session.end("max_episode_tokens")
            raise SessionError(
                409,
                f"the episode has ended (max_episode_tokens: the prompt has {total} tokens, the "
                f"budget is {limits.max_episode_tokens})",
            )
        # Which bound cuts the turn decides whether a cut ends the episode: the client's own max_tokens does not.
        caps = {"max_tokens_per_turn": limits.max_tokens_per_turn, "max_episode_tokens": room}
        if max_tokens is not None:
            caps = {"request": max_tokens, **caps}
        cap_name = min(caps, key=lambda k: caps[k])
        params = SamplingParams(
            max_new_tokens=caps[cap_name],
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            sampling_seed=params.sampling_seed,
            stop=params.stop,
            stop_token_ids=self.renderer.stop_token_ids,
        )
        seq = len(session.turns)
        # A top-k filter bounds each token's support: the turn records it, so training replays it (top-p alone
        # could keep most of the vocabulary; hpcrl's runs refuse that, and SGLang 0.5.16 will not return it).
        replay = params.top_k > 0
        result = self._generate(session, history + prompt_ids, params, rid=f"{session.id}-{seq}", replay=replay)
        routes = None
        if self.routes_shape is not None:
            url, num_input = self.engines[session.engine_index].url, len(history) + len(prompt_ids)
            routes = _turn_routes(self.routes_shape, url, result, num_input, first=max(len(history) - 1, 0))
        if result.aborted or result.output_token_logprobs is None:
            why = "aborted the request" if result.aborted else "returned no log-probs"
            raise SessionError(502, f"the engine {why}; nothing was recorded, the request may be retried")
        supports = None
        logprobs = list(result.output_token_logprobs)
        if replay:
            try:
                checked_supports(result, self.engines[session.engine_index].url)
            except EngineRequestError as exc:
                raise SessionError(502, f"{exc}; nothing was recorded") from None
            supports = [list(ids) for ids in result.sampling_mask or []]
            # The behaviour policy's log-prob is the one renormalised over the support, as in single-turn replay.
            logprobs = list(result.support_logprobs or [])
        try:
            versions = token_weight_versions(result, self.engines[session.engine_index].url)
        except ValueError as exc:
            raise SessionError(502, f"{exc}; nothing was recorded") from None
        finish = result.finish_reason.type if result.finish_reason is not None else "length"
        parsed = family.parse_assistant(self.renderer.assistant_text(result.output_ids))
        turn = Turn(
            seq=seq,
            parent=parent,
            messages=[*messages, parsed.message],
            prompt_ids=prompt_ids,
            output_ids=list(result.output_ids),
            logprobs=logprobs,
            supports=supports,
            routes=routes,
            weight_versions=versions,
            finish_reason=finish,
            message=parsed.message,
            call_ids=[f"call_{seq}_{i}" for i in range(len(parsed.message.tool_calls))],
            tools=tools,
            parse_errors=parsed.parse_errors,
            seed=params.sampling_seed,
        )
        session.commit(turn)
        if finish == "length" and cap_name != "request":
            session.end(cap_name)
        return self._completion(session, turn, want_logprobs)

    def _generate(
        self, session: Session, ids: list[int], params: SamplingParams, *, rid: str, replay: bool = False
    ) -> GenerateResult:
        """The session's engine, else the others in turn: a dead or unready engine must not end an episode that any
        engine can continue, since the request is the whole token history and the same seed.

        A dropped connection to an engine that still answers /health is the connection's fault, not the engine's
        (seen twice on the H200 with SGLang mid-run): the turn is sent to it once more, under a fresh request id,
        and samples the same tokens (same ids, same seed); nothing of the lost answer was recorded."""
        engines = self.engines
        order = [session.engine_index, *(i for i in range(len(engines)) if i != session.engine_index)]
        failures = []
        for index in order:
            engine = engines[index]
            for attempt in range(2):
                try:
                    result = engine.generate(
                        ids, params, rid=rid if attempt == 0 else f"{rid}-resend", return_sampling_mask=replay,
                        return_routed_experts=self.routes_shape is not None, timeout_s=self.cfg.request_timeout_s,
                    )  # fmt: skip
                except EngineUnreachableError as exc:
                    if attempt == 0 and _answers_health(engine):
                        log.warning(
                            "session %s: %s; the engine answers /health: sending the turn again", session.id, exc
                        )
                        continue
                    log.warning("session %s: engine %s failed (%s); trying the next one", session.id, exc.url, exc)
                    failures.append(str(exc))
                    break
                except EngineBusyError as exc:
                    log.warning("session %s: engine %s failed (%s); trying the next one", session.id, exc.url, exc)
                    failures.append(str(exc))
                    break
                except EngineRequestError as exc:
                    if exc.status_code != 400:
                        raise SessionError(502, f"the engine failed; nothing was recorded: {exc}") from None
                    # The engine's 400 is about this request (e.g. the history outgrew the context): not worth a retry.
                    raise SessionError(400, f"the engine refused the turn; nothing was recorded: {exc}") from None
                except EngineError as exc:
                    raise SessionError(
                        502, f"the engine failed; nothing was recorded, it may be retried: {exc}"
                    ) from None
                assert not isinstance(result, list)
                session.engine_index = index
                return result
        raise SessionError(502, f"every engine failed; nothing was recorded, it may be retried: {'; '.join(failures)}")

    def _completion(self, session: Session, turn: Turn, want_logprobs: bool) -> dict[str, Any]:
        finish = "length" if turn.finish_reason == "length" else "tool_calls" if turn.message.tool_calls else "stop"
        choice: dict[str, Any] = {
            "index": 0,
            "message": turn.message.to_openai(call_ids=turn.call_ids),
            "finish_reason": finish,
            "logprobs": None,
        }
        if want_logprobs:
            choice["logprobs"] = {
                "content": [
                    {"token": self.renderer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(turn.output_ids, turn.logprobs, strict=True)
                ]
            }
        num_prompt = len(turn.token_ids()) - len(turn.output_ids)
        return {
            "id": f"chatcmpl-{session.id}-{turn.seq}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.cfg.model_family,
            "choices": [choice],
            "usage": {
                "prompt_tokens": num_prompt,
                "completion_tokens": len(turn.output_ids),
                "total_tokens": num_prompt + len(turn.output_ids),
            },
            "session": {"id": session.id, "turn": turn.seq, "end_reason": session.end_reason},
        }


_ROUTES = [
    ("GET", re.compile(r"^/health$"), "health"),
    ("POST", re.compile(r"^/sessions$"), "create"),
    ("GET", re.compile(r"^/sessions/(?P<sid>[0-9a-f]+)$"), "read"),
    ("DELETE", re.compile(r"^/sessions/(?P<sid>[0-9a-f]+)$"), "delete"),
    ("POST", re.compile(r"^/sessions/(?P<sid>[0-9a-f]+)/v1/chat/completions$"), "chat"),
]


# A JSON escape of a surrogate; only then can the parsed body hold a lone one, which no tokenizer can encode.
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _chat_fields(messages: list[Message], tools: tuple[dict[str, Any], ...]) -> list[tuple[str, str]]:
    """Every text of a chat request that reaches the tokenizer, with the JSON path a 400 names it by."""
    fields: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        fields += [(f"messages[{i}].content", m.content), (f"messages[{i}].reasoning_content", m.reasoning or "")]
        fields += [
            (f"messages[{i}].tool_calls[{j}].function", f"{c.name} {c.arguments_json()}")
            for j, c in enumerate(m.tool_calls)
        ]
    fields += [(f"tools[{k}]", json.dumps(t, ensure_ascii=False)) for k, t in enumerate(tools)]
    return fields


def _holds_lone_surrogate(body: Any) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


HEAD_TIMEOUT_S = 10.0
"""A connection whose request line and headers have not arrived this long after it opened (or after its last
answer) is closed: each connection holds a server thread, so a client that never finishes its head would hold one
for ever. hpcrl's episode client reuses an idle connection for at most 5 s (httpx's keep-alive expiry)."""


class _Handler(BaseHTTPRequestHandler):
    service: SessionService  # set on the subclass made per server
    _raw = b""
    protocol_version = "HTTP/1.1"
    _head_timer: threading.Timer | None = None

    def handle_one_request(self) -> None:
        self._head_timer = threading.Timer(HEAD_TIMEOUT_S, self._drop_connection)
        self._head_timer.daemon = True
        self._head_timer.start()
        try:
            super().handle_one_request()
        finally:
            self._head_timer.cancel()

    def _drop_connection(self) -> None:
        # The handler's thread is blocked reading the head: shutting the socket down ends that read with EOF.
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _dispatch(self, method: str) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()  # the head is in: the request may take as long as a turn takes
        path = self.path.split("?", 1)[0]
        try:
            # Read the body before routing: one left unread on a kept-alive connection would be parsed as the next
            # request.
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY_BYTES:
                self.close_connection = True
                raise SessionError(413, f"request body of {length} bytes is over {_MAX_BODY_BYTES}")
            self._raw = self.rfile.read(length) if length else b""
            self._check_key(path)
            for route_method, pattern, name in _ROUTES:
                match = pattern.match(path)
                if match and route_method == method:
                    self._answer(200, getattr(self, "_" + name)(**match.groupdict()))
                    return
            if any(p.match(path) for _, p, _ in _ROUTES):
                raise SessionError(405, f"{method} is not allowed on {path}")
            raise SessionError(404, f"no route {method} {path}; see the routes in hpcrl/sessions/server.py")
        except SessionError as exc:
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            self._answer(exc.status, {"error": {"message": exc.message, "type": kind, "code": exc.status}})
        except Exception as exc:  # a bug: answer, keep serving
            log.exception("session server: %s %s failed", method, path)
            self._answer(
                500, {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "code": 500}}
            )

    def _check_key(self, path: str) -> None:
        key = self.service.cfg.api_key
        if key is None or path == "/health":
            return
        given = self.headers.get("Authorization") or ""
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise SessionError(401, "this session server needs its key: send Authorization: Bearer <key>")

    def _body(self) -> dict[str, Any]:
        raw = self._raw
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SessionError(400, f"the request body is not JSON ({exc})") from None
        except RecursionError:
            raise SessionError(400, "the request body nests JSON too deeply; send a flat JSON object") from None
        if not isinstance(body, dict):
            raise SessionError(400, "the request body must be a JSON object")
        if _SURROGATE.search(raw.decode("utf-8", errors="replace")) and _holds_lone_surrogate(body):
            raise SessionError(
                400, "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text"
            )
        return body

    def _answer(self, status: int, body: Any) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        code = 204 if body is None and status == 200 else status
        self.send_response(code, HTTPStatus(code).phrase)
        if code != 204:
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if code != 204:
            self.wfile.write(data)

    def _health(self) -> dict[str, Any]:
        return {"status": "ok", "model_family": self.service.cfg.model_family}

    def _create(self) -> dict[str, Any]:
        return self.service.create(self._body())

    def _read(self, sid: str) -> dict[str, Any]:
        self._body()
        session = self.service.get(sid)
        with session.lock:
            return session.summary()

    def _delete(self, sid: str) -> None:
        self._body()
        self.service.delete(sid)

    def _chat(self, sid: str) -> dict[str, Any]:
        return self.service.chat(sid, self._body())

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")


class _HTTPServer(ThreadingHTTPServer):
    # socketserver's default listen backlog is 5: a run's dozens of concurrent episodes connecting at once would
    # find their connections reset.
    request_queue_size = 1024
    daemon_threads = True


class SessionServer:
    """The HTTP server on a thread; `url` is where it listens (port 0 picks a free one)."""

    def __init__(
        self,
        cfg: SessionServerConfig,
        *,
        tokenizer: Any | None = None,
        engines: Engines | None = None,
        routes_shape: tuple[int, int] | None = None,
    ) -> None:
        """`engines`: clients the caller owns (a run's, with their keys) instead of ones made from cfg.engine_urls,
        or a function giving them as they are at each turn (a run's fleet, which restarts dead engines).
        `routes_shape`: see SessionService."""
        from hpcrl.sessions.cli import load_tokenizer

        check_port_free(cfg.host, cfg.port, what="the session server")  # before the tokenizer loads
        self._owns_engines = engines is None
        if engines is None:
            engines = [
                EngineClient(u, api_key=cfg.engine_api_key, timeout_s=cfg.request_timeout_s) for u in cfg.engine_urls
            ]
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
        self.service = SessionService(cfg, tokenizer, engines, routes_shape)
        handler = type("Handler", (_Handler,), {"service": self.service})
        try:
            self.httpd = _HTTPServer((cfg.host, cfg.port), handler)
        except OSError as exc:
            raise bind_error(exc, cfg.host, cfg.port, what="the session server") from None
        self.url = f"http://{cfg.host}:{self.httpd.server_address[1]}"
        self._thread: threading.Thread | None = None

    def start(self) -> SessionServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hpcrl-sessions", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._owns_engines:
            for engine in self.service.engines:
                engine.close()

    def __enter__(self) -> SessionServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(cfg: SessionServerConfig) -> None:
    server = SessionServer(cfg)
    print(
        f"hpcrl sessions: family {cfg.model_family}, {len(cfg.engine_urls)} engine(s), serving on {server.url}",
        flush=True,
    )
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


__all__ = ["EpisodeLimits", "SessionServer", "SessionService", "serve"]


def _answers_health(engine: EngineClient) -> bool:
    try:
        return engine.health(timeout_s=5.0)
    except EngineError:
        return False
