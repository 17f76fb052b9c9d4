"""Environments (start an episode from a dataset row, answer tool calls, reward at the end) and the episode loop.

An environment is chosen by dotted path (`package.module:Class`) or a built-in name (`calculator`). The loop is the
harness: it speaks OpenAI chat completions to a session of the session server, so the tokens trained on are the
server's, never re-tokenized here.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import httpx

from hpcrl.loader import LoadError, load_object
from hpcrl.sessions.sandbox import CALCULATOR_SCHEMA, SandboxLimits, ToolResult, calculator

__all__ = ["CalculatorEnvironment", "Environment", "Episode", "EpisodeResult", "load_environment", "run_episode"]


@dataclass
class Episode:
    row: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One instance serves many episodes; per-episode data lives in the Episode."""

    @abstractmethod
    def start(self, row: dict[str, Any]) -> Episode:
        """The first messages (and tools) of an episode for one dataset row."""

    def call_tool(self, episode: Episode, name: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(
            f"error: no tool named {name!r}; tools: {[t['function']['name'] for t in episode.tools]}", error=True
        )

    @abstractmethod
    def reward(self, episode: Episode) -> float:
        """The episode's reward, read from episode.messages once the loop has ended."""


class CalculatorEnvironment(Environment):
    """Arithmetic with a calculator: rows {"prompt", "answer"}; reward 1 when the final answer's last number is it."""

    system_prompt = "Use the calculator tool for arithmetic, then answer with the number."

    def __init__(self, limits: SandboxLimits = SandboxLimits()) -> None:
        self.limits = limits

    def start(self, row: dict[str, Any]) -> Episode:
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": str(row["prompt"])}]
        return Episode(row=row, messages=messages, tools=[CALCULATOR_SCHEMA])

    def call_tool(self, episode: Episode, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name != "calculator":
            return super().call_tool(episode, name, arguments)
        return calculator(arguments, self.limits)

    def reward(self, episode: Episode) -> float:
        final = episode.messages[-1]
        if final.get("role") != "assistant" or final.get("tool_calls"):
            return 0.0
        numbers = re.findall(r"-?\d+(?:\.\d+)?", final.get("content") or "")
        return 1.0 if numbers and numbers[-1] == str(episode.row["answer"]).strip() else 0.0


BUILTIN_ENVIRONMENTS = {"calculator": CalculatorEnvironment}


def load_environment(path: str) -> Environment:
    """A built-in name or a path to an `Environment` subclass (hpcrl/loader.py), instantiated without arguments."""
    return environment_class(path)()


def environment_class(path: str) -> type[Environment]:
    """The class `load_environment` instantiates; a path that names none is refused before anything starts."""
    if path in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[path]
    builtins = ", ".join(BUILTIN_ENVIRONMENTS)
    cls = load_object(path, key="rollout.environment", what="Class", builtins=builtins)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise LoadError(
            "rollout.environment", path, "it is not a subclass of hpcrl.sessions.environment.Environment",
            what="Class", builtins=builtins,
        )  # fmt: skip
    return cls


@dataclass
class EpisodeResult:
    reward: float
    end_reason: str
    """answered (no tool call), truncated (the last turn was cut by its max_tokens), engine_failed, or a session
    limit's name (max_turns, max_tokens_per_turn, max_episode_tokens)."""
    num_turns: int
    num_tool_calls: int
    num_tool_errors: int
    sequences: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    reward_error: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s["token_ids"]) for s in self.sequences)


class SessionServerError(RuntimeError):
    """The session server refused what an episode needs (a new session): the rollout cannot go on."""


def run_episode(
    env: Environment,
    row: dict[str, Any],
    server_url: str,
    *,
    sampling: dict[str, Any] | None = None,
    limits: dict[str, int] | None = None,
    seed: int | None = None,
    timeout_s: float = 600.0,
    api_key: str | None = None,
) -> EpisodeResult:
    """One episode in a linear session: generate, answer tool calls, repeat until an answer or a limit.

    With `seed`, turn k samples with seed + k: an episode repeats exactly on the same weights. `api_key`: the
    session server's key (a run's own server has one)."""
    episode = env.start(row)
    calls = errors = 0
    end_reason = ""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=server_url, timeout=timeout_s, trust_env=False, headers=headers) as http:
        created = http.post("/sessions", json={"mode": "linear", "limits": limits or {}})
        if created.status_code != 200:
            raise SessionServerError(
                f"the session server at {server_url} refused a new session: HTTP {created.status_code}: "
                f"{created.text[:500]}"
            )
        sid = created.json()["session_id"]
        try:
            while True:
                body = {"messages": episode.messages, **(sampling or {})}
                if seed is not None:
                    body["seed"] = seed + sum(m.get("role") == "assistant" for m in episode.messages)
                if episode.tools:
                    body["tools"] = episode.tools
                r = http.post(f"/sessions/{sid}/v1/chat/completions", json=body)
                if r.status_code == 409:
                    end_reason = http.get(f"/sessions/{sid}").json()["end_reason"] or "ended"
                    break
                if r.status_code == 502:
                    # Every engine failed this turn (the server already tried them all with the same ids and seed).
                    end_reason = "engine_failed"
                    break
                if r.status_code != 200:
                    raise RuntimeError(f"session {sid}: chat failed with HTTP {r.status_code}: {r.text[:500]}")
                choice = r.json()["choices"][0]
                message = choice["message"]
                episode.messages.append(message)
                if not message.get("tool_calls"):
                    end_reason = "truncated" if choice["finish_reason"] == "length" else "answered"
                    break
                for call in message["tool_calls"]:
                    calls += 1
                    result = _call(env, episode, call)
                    errors += result.error
                    episode.messages.append(result.message(call.get("id")))
            state = http.get(f"/sessions/{sid}").json()
        finally:
            http.delete(f"/sessions/{sid}")
    end_reason = state["end_reason"] or end_reason
    reward, reward_error = 0.0, None
    try:
        reward = float(env.reward(episode))
    except Exception as exc:  # a user's reward: the episode is kept, marked failed
        reward_error = f"{type(exc).__name__}: {exc}"
    return EpisodeResult(
        reward=reward,
        end_reason=end_reason,
        num_turns=state["num_turns"],
        num_tool_calls=calls,
        num_tool_errors=errors,
        sequences=state["sequences"],
        messages=episode.messages,
        reward_error=reward_error,
    )


def _call(env: Environment, episode: Episode, call: dict[str, Any]) -> ToolResult:
    fn = call.get("function") or {}
    try:
        arguments = json.loads(fn.get("arguments") or "{}")
        return env.call_tool(episode, str(fn.get("name")), arguments)
    except Exception as exc:  # a tool that raises is the model's problem to read, not the run's
        return ToolResult(f"error: {type(exc).__name__}: {exc}", error=True)


def episode_metrics(results: list[EpisodeResult]) -> dict[str, float]:
    n = max(len(results), 1)
    num_calls = sum(r.num_tool_calls for r in results)
    return {
        "rollout/turns_mean": sum(r.num_turns for r in results) / n,
        "rollout/tool_calls_mean": num_calls / n,
        "rollout/tool_error_share": sum(r.num_tool_errors for r in results) / num_calls if num_calls else 0.0,
        "rollout/episode_tokens_mean": sum(r.num_tokens for r in results) / n,
    }
