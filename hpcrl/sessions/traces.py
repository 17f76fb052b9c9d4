"""Synthetic calculator traces for the multi-turn warm start, as the token ids the session server would record.

A trace is one episode of the calculator environment written out: its system and user messages, an assistant turn
calling `calculator` with the product's operands, the tool's answer, and a final assistant turn giving the number.
It is tokenized the way the session server tokenizes an episode (turn 1 rendered with the family's template, then
the splice and the appended tool message, hpcrl/sessions/tokens.py), so SFT teaches exactly the ids that GRPO later
samples and trains on; the loss is on the assistant turns' tokens only.

Some traces are deliberately imperfect, so that GRPO has something left to learn: with `wrong_operand_share` the
call has one operand digit changed (the tool's answer and the final answer follow the wrong product), with
`no_tool_share` the model answers at once with a guess near the product.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from hpcrl.samples.sample import DataError, Example
from hpcrl.sessions.environment import CalculatorEnvironment
from hpcrl.sessions.families import get_family
from hpcrl.sessions.messages import Message, ToolCall, parse_messages, parse_tools
from hpcrl.sessions.tokens import Renderer
from hpcrl.trainer.batch import TrainBatch

__all__ = ["ToolTraces", "TracedEpisode"]

_PRODUCT = re.compile(r"^\s*(\d+)\s*\*\s*(\d+)\s*=?\s*$")


class TracedEpisode:
    """One trace's ids: `prompt_ids` (turn 1's rendered prompt) and the rest, `response_ids`, with its loss mask."""

    def __init__(self, prompt_ids: list[int], response_ids: list[int], loss_mask: list[int]) -> None:
        self.prompt_ids, self.response_ids, self.loss_mask = prompt_ids, response_ids, loss_mask


class ToolTraces:
    """SFT batches of calculator traces over `examples` ("a*b=" prompts): batch(step) depends only on (seed, step)."""

    def __init__(
        self,
        examples: Sequence[Example],
        *,
        family: str,
        tokenizer: Any,
        batch_size: int,
        seed: int,
        wrong_operand_share: float = 0.0,
        no_tool_share: float = 0.0,
    ) -> None:
        self.operands = [_operands(e, i) for i, e in enumerate(examples)]
        self.renderer = Renderer(get_family(family), tokenizer)
        self.env = CalculatorEnvironment()
        self.batch_size, self.seed = batch_size, seed
        self.wrong_operand_share, self.no_tool_share = wrong_operand_share, no_tool_share

    def batch(self, step: int) -> TrainBatch:
        rng = random.Random(f"{self.seed}/sft/{step}")
        episodes = [self.trace(self.operands[rng.randrange(len(self.operands))], rng) for _ in range(self.batch_size)]
        return TrainBatch.from_sequences(
            [e.prompt_ids for e in episodes],
            [e.response_ids for e in episodes],
            response_masks=[e.loss_mask for e in episodes],
        )

    def trace(self, operands: tuple[int, int], rng: random.Random) -> TracedEpisode:
        a, b = operands
        start = self.env.start({"prompt": f"{a}*{b}=", "answer": str(a * b)})
        messages, tools = parse_messages(start.messages), parse_tools(start.tools)
        r = self.renderer
        prompt = r.prompt_ids(messages, tools)
        draw = rng.random()
        if draw < self.no_tool_share:
            guess = max(0, a * b + rng.choice([-1, 1]) * rng.randint(1, 999))
            answer = self._turn(Message(role="assistant", content=str(guess)))
            return TracedEpisode(prompt, answer, [1] * len(answer))
        if draw < self.no_tool_share + self.wrong_operand_share:
            a, b = _perturbed(a, b, rng)
        call = Message(
            role="assistant",
            content="",
            tool_calls=(ToolCall(name="calculator", arguments={"expression": f"{a}*{b}"}),),
        )
        first = self._turn(call)
        # What the server appends after a sampled turn: the splice, then the tool message rendered as a tail.
        between = r.close_ids(first) + r.tail_ids([Message(role="tool", content=str(a * b))])
        final = self._turn(Message(role="assistant", content=str(a * b)))
        return TracedEpisode(prompt, first + between + final, [1] * len(first) + [0] * len(between) + [1] * len(final))

    def _turn(self, message: Message) -> list[int]:
        """A sampled turn's ids: the assistant body and the end-of-turn token the model stops with."""
        return self.renderer.encode(self.renderer.family.assistant_body(message)) + [self.renderer.end_of_turn_id]


def _operands(example: Example, index: int) -> tuple[int, int]:
    match = _PRODUCT.match(example.prompt)
    if match is None:
        raise DataError(
            f"example {index + 1}'s prompt {example.prompt!r} is not a product 'a*b=': the calculator traces of the "
            "multi-turn warm start need data.source=product"
        )
    return int(match.group(1)), int(match.group(2))


def _perturbed(a: int, b: int, rng: random.Random) -> tuple[int, int]:
    """One digit of one operand changed (the leading digit never to 0, so the operand keeps its length)."""
    which = rng.randrange(2)
    digits = list(str(a if which == 0 else b))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and (i > 0 or d != "0")]
    digits[i] = rng.choice(choices)
    value = int("".join(digits))
    return (value, b) if which == 0 else (a, value)
