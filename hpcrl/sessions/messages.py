"""Chat messages as the session server compares and renders them.

A client's OpenAI message carries wire-only fields (tool-call ids and indexes, refusal, annotations, token ids); only
what a chat template renders decides whether two histories are the same: role, content, reasoning and the tool calls'
names and arguments. Arguments compare as parsed JSON, so a harness that re-serialises them (other spacing, other
key order) still matches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class MessageError(ValueError):
    """A request's messages or tools are malformed; the server answers HTTP 400 with this text."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def arguments_json(self, *, compact: bool = False) -> str:
        separators = (",", ":") if compact else (", ", ": ")
        return json.dumps(self.arguments, ensure_ascii=False, separators=separators)


@dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    # None: the client did not send it (harnesses often drop reasoning); the stored history stays authoritative.
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    # Wire-only: kept to answer the client, never compared nor rendered by the families here.
    tool_call_id: str | None = field(default=None, compare=False)

    def to_openai(self, *, call_ids: list[str] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": self.role,
            "content": self.content if self.content or not self.tool_calls else None,
        }
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            ids = call_ids or [f"call_{i}" for i in range(len(self.tool_calls))]
            out["tool_calls"] = [
                {"id": ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments_json()}}
                for i, c in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _text(where: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise MessageError(
                    f"{where}.content[{i}] is not a text part ({{'type': 'text', 'text': ...}}); "
                    "sessions carry text only"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise MessageError(f"{where}.content must be a string, a list of text parts or null, got {type(content).__name__}")


def _tool_call(where: str, raw: Any) -> ToolCall:
    if not isinstance(raw, dict):
        raise MessageError(f"{where} must be an object")
    fn = raw.get("function", raw)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise MessageError(f"{where}.function.name must be a non-empty string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise MessageError(f"{where}.function.arguments is not valid JSON ({exc})") from None
    if not isinstance(args, dict):
        raise MessageError(f"{where}.function.arguments must be a JSON object")
    return ToolCall(name=fn["name"], arguments=args)


def parse_message(index: int, raw: Any) -> Message:
    """One OpenAI chat message; fields a template does not render (ids, refusal, token ids) are ignored."""
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise MessageError(f"{where} must be an object with a role, got {type(raw).__name__}")
    role = raw.get("role")
    if role not in ROLES:
        raise MessageError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
    reasoning = raw.get("reasoning_content", raw.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise MessageError(f"{where}.reasoning_content must be a string")
    calls = raw.get("tool_calls") or []
    if not isinstance(calls, list):
        raise MessageError(f"{where}.tool_calls must be a list")
    if calls and role != "assistant":
        raise MessageError(f"{where} has tool_calls but role {role!r}; only assistant messages call tools")
    tool_call_id = raw.get("tool_call_id")
    return Message(
        role=role,
        content=_text(where, raw.get("content")),
        reasoning=reasoning if role == "assistant" else None,
        tool_calls=tuple(_tool_call(f"{where}.tool_calls[{i}]", c) for i, c in enumerate(calls)),
        tool_call_id=tool_call_id if isinstance(tool_call_id, str) else None,
    )


def parse_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise MessageError("messages must be a non-empty list of chat messages")
    return [parse_message(i, m) for i, m in enumerate(raw)]


def parse_tools(raw: Any) -> tuple[dict[str, Any], ...]:
    """OpenAI tool schemas ({"type": "function", "function": {"name", "description", "parameters"}})."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise MessageError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    tools = []
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(fn, dict)):
            raise MessageError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise MessageError(f"tools[{i}].function.name must be a non-empty string")
        tools.append({"type": "function", "function": fn})
    return tuple(tools)


def same_message(stored: Message, sent: Message) -> str | None:
    """None when `sent` is the same message as `stored` for a template; else which field differs."""
    if stored.role != sent.role:
        return f"role: stored {stored.role!r}, sent {sent.role!r}"
    if stored.content != sent.content:
        return f"content: stored {_clip(stored.content)}, sent {_clip(sent.content)}"
    if sent.reasoning is not None and (stored.reasoning or "") != sent.reasoning:
        return f"reasoning_content: stored {_clip(stored.reasoning or '')}, sent {_clip(sent.reasoning)}"
    if stored.tool_calls != sent.tool_calls:
        return f"tool_calls: stored {_calls(stored)}, sent {_calls(sent)}"
    return None


def _calls(m: Message) -> str:
    return "[" + ", ".join(f"{c.name}({c.arguments_json(compact=True)})" for c in m.tool_calls) + "]"


def _clip(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
