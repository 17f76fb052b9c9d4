"""Model families: append-only rendering per family (`hpcrl family check`), parsers, templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.cli import main
from hpcrl.sessions.check import check_family
from hpcrl.sessions.cli import load_tokenizer
from hpcrl.sessions.families import Qwen3Family, get_family
from hpcrl.sessions.messages import Message


@pytest.mark.parametrize("name", ["tiny", "qwen3"])
def test_family_check_passes_for_each_family(
    name: str, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # No Qwen3 tokenizer can be had offline: the qwen3 template logic is checked with the tiny tokenizer, which has
    # the same ChatML special tokens.
    assert main(["family", "check", name, "--model", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert f"family {name}: 26 assistant turns checked" in out and out.rstrip().endswith("append-only")


class StockQwen3(Qwen3Family):
    """Qwen3's stock template: reasoning is shown only after the last user message, so history changes."""

    name = "stock-qwen3"

    def render(self, messages, tools=(), *, add_generation_prompt):  # type: ignore[no-untyped-def]
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        cut = [
            Message(role=m.role, content=m.content, tool_calls=m.tool_calls) if i < last_user else m
            for i, m in enumerate(messages)
        ]
        return super().render(cut, tools, add_generation_prompt=add_generation_prompt)


def test_family_check_fails_a_template_that_drops_earlier_reasoning(tiny_model_dir: Path) -> None:
    num_turns, problems = check_family(StockQwen3(), load_tokenizer(str(tiny_model_dir)))
    assert num_turns == 26
    assert problems, "a template that rewrites history must fail the check"
    assert {p.conversation for p in problems} == {"reasoning"}
    assert any("appending changed the history" in p.what for p in problems)


def test_tiny_family_matches_the_tiny_tokenizers_own_template_on_plain_messages(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    raw = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\n\nthere"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+2?"},
    ]
    ours = get_family("tiny").render([Message(**m) for m in raw], add_generation_prompt=True)
    assert ours == tokenizer.apply_chat_template(raw, tokenize=False, add_generation_prompt=True)


def test_tool_call_parser_keeps_a_call_that_is_not_json_as_text() -> None:
    family = get_family("qwen3")
    text = 'Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n<tool_call>\n{oops}\n</tool_call>'  # noqa: E501
    parsed = family.parse_assistant(text)
    assert [c.name for c in parsed.message.tool_calls] == ["calculator"]
    assert parsed.message.tool_calls[0].arguments == {"expression": "2*3"}
    assert parsed.message.content.startswith("Sure.") and "{oops}" in parsed.message.content
    assert len(parsed.parse_errors) == 1 and "not JSON" in parsed.parse_errors[0]


def test_reasoning_parser_splits_think_blocks_in_both_families() -> None:
    q = get_family("qwen3").parse_assistant("<think>\nhmm\n</think>\n\n42").message
    t = get_family("tiny").parse_assistant("<think>hmm</think>42").message
    assert (q.reasoning, q.content) == ("hmm", "42") == (t.reasoning, t.content)


def test_unknown_family_is_an_error_naming_the_families(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["family", "check", "llama", "--model", str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err
    assert "hpcrl: error: model_family 'llama' is not a registered family" in err and "['qwen3', 'tiny']" in err
