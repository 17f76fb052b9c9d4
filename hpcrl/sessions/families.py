"""Model families by name: chat template, stop tokens, tool-call parser, reasoning parser.

A family is chosen by name (`model_family`), never guessed from a checkpoint: a template that is not append-only
(Qwen3's stock template deletes earlier reasoning once a new user turn arrives) silently changes the tokens of a
history between turns, and that is the mismatch sessions exist to remove. Each family here renders in Python, so
the rendering is the family's own and cannot drift with a checkpoint's bundled Jinja; `hpcrl family check` proves
it append-only over a battery of conversations.

    qwen3  Qwen3's ChatML with tools in the system message, <tool_call> JSON blocks, tool results grouped in a user
           turn as <tool_response> blocks and <think> reasoning kept in every turn (the stock template's
           "keep thinking" fix). SGLang parsers: reasoning `qwen3`, tool calls `qwen25`.
    tiny   hpcrl's tiny character-level model (hpcrl/model/tiny.py): the tokenizer's own ChatML for plain
           messages, plus a compact tool line, compact <tool_call> JSON and a `tool` role turn, short enough
           for a 1024-position model.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from hpcrl.sessions.messages import Message, ToolCall

__all__ = ["FAMILIES", "ModelFamily", "ParsedTurn", "get_family"]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedTurn:
    """A sampled assistant turn parsed into an OpenAI message; `parse_errors` name tool calls that did not parse."""

    message: Message
    parse_errors: tuple[str, ...] = ()


class ModelFamily(ABC):
    """The base: ChatML turns `<|im_start|>role\\n...<|im_end|>\\n`; subclasses set how tools and reasoning look."""

    name: str = ""
    stop_tokens: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
    end_of_turn: str = "<|im_end|>"
    # What the template writes after a message; a model stops at end_of_turn, so the rest ("\n") is inserted,
    # loss-masked, before the next appended message (the splice point).
    turn_close: str = "<|im_end|>\n"
    generation_prompt: str = "<|im_start|>assistant\n"
    allowed_append_roles: tuple[str, ...] = ("system", "user", "assistant", "tool")
    reasoning_parser: str = "qwen3"
    tool_call_parser: str = "qwen25"
    compact_json: bool = False

    # ---------------------------------------------------------------------------------------------------- render

    def render(
        self, messages: list[Message], tools: tuple[dict[str, Any], ...] = (), *, add_generation_prompt: bool
    ) -> str:
        out = []
        start = 0
        first = messages[0] if messages else None
        if tools or (first is not None and first.role == "system"):
            system = first.content if first is not None and first.role == "system" else None
            out.append(self.render_system(system, tools))
            start = 1 if system is not None else 0
        for i in range(start, len(messages)):
            prev = messages[i - 1] if i > 0 else None
            nxt = messages[i + 1] if i + 1 < len(messages) else None
            out.append(self.render_message(messages[i], prev, nxt))
        if add_generation_prompt:
            out.append(self.generation_prompt)
        return "".join(out)

    @abstractmethod
    def render_system(self, content: str | None, tools: tuple[dict[str, Any], ...]) -> str:
        raise NotImplementedError

    def render_message(self, m: Message, prev: Message | None, nxt: Message | None) -> str:
        if m.role == "assistant":
            return self.generation_prompt + self.assistant_body(m) + self.turn_close
        if m.role == "tool":
            return self.render_tool(m, prev, nxt)
        return f"<|im_start|>{m.role}\n{m.content}{self.turn_close}"

    @abstractmethod
    def render_tool(self, m: Message, prev: Message | None, nxt: Message | None) -> str:
        raise NotImplementedError

    @abstractmethod
    def assistant_body(self, m: Message) -> str:
        """What the model writes after the generation prompt, up to (not including) end_of_turn."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------------------------- parse

    def parse_assistant(self, text: str) -> ParsedTurn:
        """The inverse of assistant_body: reasoning parser, then tool-call parser."""
        reasoning, rest = self.split_reasoning(text)
        errors: list[str] = []
        calls: list[ToolCall] = []
        first = _CALL.search(rest)
        if first is None:
            return ParsedTurn(Message(role="assistant", content=rest, reasoning=reasoning))
        content = self.strip_call_separator(rest[: first.start()])
        leftover = []
        position = first.start()
        for match in _CALL.finditer(rest, first.start()):
            between = rest[position : match.start()]
            if between.strip():
                leftover.append(between)
            position = match.end()
            call, error = self.parse_call(match.group(1))
            if call is None:
                errors.append(error)
                leftover.append(match.group(0))
            else:
                calls.append(call)
        if rest[position:].strip():
            leftover.append(rest[position:])
        if leftover:
            content = content + "".join(leftover)
        return ParsedTurn(
            Message(role="assistant", content=content, reasoning=reasoning, tool_calls=tuple(calls)), tuple(errors)
        )

    @abstractmethod
    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        raise NotImplementedError

    def strip_call_separator(self, content: str) -> str:
        return content

    @staticmethod
    def parse_call(body: str) -> tuple[ToolCall | None, str]:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            return None, f"tool call {body.strip()[:80]!r} is not JSON ({exc.msg})"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, f"tool call {body.strip()[:80]!r} has no string 'name'"
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None, f"tool call {obj['name']!r}: arguments are a string that is not JSON"
        if not isinstance(args, dict):
            return None, f"tool call {obj['name']!r}: arguments must be a JSON object"
        return ToolCall(name=obj["name"], arguments=args), ""

    def call_json(self, call: ToolCall) -> str:
        if self.compact_json:
            return json.dumps(
                {"name": call.name, "arguments": call.arguments}, ensure_ascii=False, separators=(",", ":")
            )
        return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)


class Qwen3Family(ModelFamily):
    name = "qwen3"

    def render_system(self, content: str | None, tools: tuple[dict[str, Any], ...]) -> str:
        if not tools:
            return f"<|im_start|>system\n{content}<|im_end|>\n"
        head = f"{content}\n\n" if content else ""
        listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            f"<|im_start|>system\n{head}# Tools\n\nYou may call one or more functions to assist with the user query."
            f"\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>{listed}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call><|im_end|>\n"
        )

    def render_tool(self, m: Message, prev: Message | None, nxt: Message | None) -> str:
        # Consecutive tool results share one user turn: the template is append-only only at assistant boundaries,
        # which is where a session appends (a request carries all of one turn's results).
        opening = "<|im_start|>user" if prev is None or prev.role != "tool" else ""
        closing = "<|im_end|>\n" if nxt is None or nxt.role != "tool" else ""
        return f"{opening}\n<tool_response>\n{m.content}\n</tool_response>{closing}"

    def assistant_body(self, m: Message) -> str:
        out = ""
        if m.reasoning:
            out += "<think>\n" + m.reasoning.strip("\n") + "\n</think>\n\n"
        out += m.content
        for i, call in enumerate(m.tool_calls):
            if i > 0 or m.content:
                out += "\n"
            out += "<tool_call>\n" + self.call_json(call) + "\n</tool_call>"
        return out

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        if not text.startswith("<think>"):
            return None, text
        end = text.find("</think>")
        if end < 0:  # cut off while thinking: all of it is reasoning
            return text[len("<think>") :].strip("\n"), ""
        return text[len("<think>") : end].strip("\n"), text[end + len("</think>") :].lstrip("\n")

    def strip_call_separator(self, content: str) -> str:
        return content[:-1] if content.endswith("\n") else content


class TinyFamily(ModelFamily):
    name = "tiny"
    compact_json = True

    def render_system(self, content: str | None, tools: tuple[dict[str, Any], ...]) -> str:
        lines = [content] if content else []
        if tools:
            sigs = []
            for t in tools:
                fn = t["function"]
                params = (fn.get("parameters") or {}).get("properties") or {}
                sigs.append(f"{fn['name']}({','.join(params)})")
            lines.append("tools: " + " ".join(sigs))
        return "<|im_start|>system\n" + "\n".join(lines) + "<|im_end|>\n"

    def render_tool(self, m: Message, prev: Message | None, nxt: Message | None) -> str:
        return f"<|im_start|>tool\n{m.content}<|im_end|>\n"

    def assistant_body(self, m: Message) -> str:
        out = f"<think>{m.reasoning}</think>" if m.reasoning else ""
        out += m.content
        for call in m.tool_calls:
            out += "<tool_call>" + self.call_json(call) + "</tool_call>"
        return out

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        if not text.startswith("<think>"):
            return None, text
        end = text.find("</think>")
        if end < 0:
            return text[len("<think>") :], ""
        return text[len("<think>") : end], text[end + len("</think>") :]


FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (Qwen3Family(), TinyFamily())}


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(
            f"model_family {name!r} is not a registered family; choose one of {sorted(FAMILIES)} "
            "(families are named, never detected from the checkpoint)"
        )
    return FAMILIES[name]
