"""`hpcrl family check NAME --model DIR`: is a family's rendering append-only, turn after turn, on this tokenizer?

For every conversation of a battery (tool calls, several calls in one turn, tool errors, reasoning, system prompts)
and every assistant turn in it, the check asserts what a session relies on:
1. the generation prompt's tokens are a prefix of the tokens with the assistant turn rendered (the model writes
   the turn after the prompt);
2. the tokens up to that assistant turn are a prefix of the tokens of the next generation prompt (appending never
   changes the history);
3. the tokens the session server builds (turn-1 ids, the sampled turn, the splice, the tail ids) equal the tokens
   of rendering the whole conversation at once;
4. the family's parsers read each rendered assistant turn back to the same message (reasoning, content, calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcrl.sessions.families import ModelFamily
from hpcrl.sessions.messages import Message, ToolCall
from hpcrl.sessions.tokens import Renderer

CALC_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate a Python arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}


def _u(text: str) -> Message:
    return Message(role="user", content=text)


def _s(text: str) -> Message:
    return Message(role="system", content=text)


def _a(text: str = "", *calls: tuple[str, dict[str, Any]], reasoning: str | None = None) -> Message:
    return Message(
        role="assistant", content=text, reasoning=reasoning, tool_calls=tuple(ToolCall(n, a) for n, a in calls)
    )


def _t(text: str) -> Message:
    return Message(role="tool", content=text)


def _calc(expr: str) -> tuple[str, dict[str, Any]]:
    return ("calculator", {"expression": expr})


# name -> (tools, messages); every conversation ends with an assistant turn.
BATTERY: dict[str, tuple[tuple[dict[str, Any], ...], list[Message]]] = {
    "plain multi-turn": ((), [_u("Hi"), _a("Hello!"), _u("2+2?"), _a("4")]),
    "system prompt": ((), [_s("You are terse."), _u("Hi"), _a("Hi."), _u("Bye"), _a("Bye.")]),
    "one tool call": (
        (CALC_TOOL,),
        [_u("What is 123*45?"), _a("", _calc("123*45")), _t("5535"), _a("It is 5535.")],
    ),
    "text before a call": (
        (CALC_TOOL,),
        [_s("Use tools."), _u("12*12?"), _a("Let me compute.", _calc("12*12")), _t("144"), _a("144")],
    ),
    "several calls in one turn": (
        (CALC_TOOL, SEARCH_TOOL),
        [_u("3*4 and 5*6?"), _a("", _calc("3*4"), _calc("5*6")), _t("12"), _t("30"), _a("12 and 30")],
    ),
    "tool error": (
        (CALC_TOOL,),
        [_u("1/0?"), _a("", _calc("1/0")), _t("error: ZeroDivisionError: division by zero"), _a("Undefined.")],
    ),
    "long tool chain": (
        (CALC_TOOL,),
        [
            _u("((2*3)*4)*5?"),
            _a("", _calc("2*3")),
            _t("6"),
            _a("", _calc("6*4")),
            _t("24"),
            _a("", _calc("24*5")),
            _t("120"),
            _a("120"),
        ],
    ),
    "reasoning": (
        (CALC_TOOL,),
        [
            _u("17*19?"),
            _a("", _calc("17*19"), reasoning="Multiply with the tool."),
            _t("323"),
            _a("323", reasoning="The tool said 323."),
            _u("And +1?"),
            _a("324", reasoning="323+1."),
        ],
    ),
    "system prompt mid-conversation": (
        (CALC_TOOL,),
        [_s("Be brief."), _u("Hi"), _a("Hi"), _s("Now answer in French."), _u("Bye"), _a("Au revoir")],
    ),
    "user after tool results": (
        (CALC_TOOL,),
        [_u("2*21?"), _a("", _calc("2*21")), _t("42"), _u("Explain too."), _a("2*21 is 42.")],
    ),
    "injected assistant turn": ((), [_u("Hi"), _a("Hello"), _u("Go on"), _a("I will."), _u("Done?"), _a("Yes")]),
}


@dataclass(frozen=True)
class Problem:
    conversation: str
    turn: int
    what: str

    def __str__(self) -> str:
        return f"{self.conversation!r}, assistant turn {self.turn}: {self.what}"


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_conversation(
    renderer: Renderer, name: str, tools: tuple[dict[str, Any], ...], messages: list[Message]
) -> list[Problem]:
    family = renderer.family
    problems: list[Problem] = []
    turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    server_ids: list[int] = []
    prev_end = 0  # messages already in server_ids
    prev_full: list[int] | None = None
    for turn, a in enumerate(turns, start=1):
        prompt = renderer.encode(family.render(messages[:a], tools, add_generation_prompt=True))
        full = renderer.encode(family.render(messages[: a + 1], tools, add_generation_prompt=False))
        if full[: len(prompt)] != prompt:
            problems.append(
                Problem(
                    name,
                    turn,
                    f"the generation prompt is not a prefix of the rendered turn "
                    f"(first difference at token {_first_difference(prompt, full)})",
                )
            )
        if prev_full is not None and prompt[: len(prev_full)] != prev_full:
            problems.append(
                Problem(
                    name,
                    turn,
                    "appending changed the history: the previous turn's tokens are not a "
                    f"prefix (first difference at token {_first_difference(prev_full, prompt)})",
                )
            )
        # The session server's path: turn-1 render, then splice + tail after each sampled turn.
        if turn == 1:
            server_ids = renderer.prompt_ids(messages[:a], tools)
        else:
            tail = messages[prev_end:a]
            if any(m.role not in family.allowed_append_roles for m in tail):
                continue
            server_ids = server_ids + renderer.close_ids(server_ids) + renderer.tail_ids(tail)
        if server_ids != prompt:
            problems.append(
                Problem(
                    name,
                    turn,
                    "the session server's incremental ids differ from the full render "
                    f"(first difference at token {_first_difference(server_ids, prompt)})",
                )
            )
            server_ids = prompt
        body = family.assistant_body(messages[a])
        sampled = renderer.encode(body + family.end_of_turn)
        server_ids = server_ids + sampled
        parsed = family.parse_assistant(renderer.assistant_text(sampled))
        expected = messages[a]
        if parsed.parse_errors or parsed.message != expected:
            problems.append(
                Problem(
                    name,
                    turn,
                    f"the parsers read the rendered turn {body!r} back as "
                    f"{parsed.message} (errors {list(parsed.parse_errors)})",
                )
            )
        prev_end = a + 1
        prev_full = full
    return problems


def check_family(family: ModelFamily, tokenizer: Any) -> tuple[int, list[Problem]]:
    """(number of assistant turns checked, problems) over the whole battery."""
    renderer = Renderer(family, tokenizer)
    problems: list[Problem] = []
    num_turns = 0
    for name, (tools, messages) in BATTERY.items():
        num_turns += sum(m.role == "assistant" for m in messages)
        problems += check_conversation(renderer, name, tools, messages)
    return num_turns, problems
