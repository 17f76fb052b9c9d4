"""The sandboxed calculator: every escape attempt ends as a clear tool error, arithmetic works."""

from __future__ import annotations

from typing import Any

import pytest

from hpcrl.sessions.environment import CalculatorEnvironment, Environment, Episode, load_environment
from hpcrl.sessions.sandbox import SandboxLimits, calculator, run_python

LIMITS = SandboxLimits(cpu_s=1, memory_mb=128, max_output_bytes=1000)
# Reaches os.system without importing anything, through the classes that Python's start-up already loaded.
_OS_GLOBALS = (
    "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0].__init__.__globals__"
)

ATTEMPTS = {
    "infinite loop": ("while True:\n    pass", "the CPU time limit (1 s) was exceeded"),
    "memory bomb": ("x = bytearray(10**10)", "MemoryError: the memory limit (128 MB) was exceeded"),
    "network": ("import socket\nsocket.create_connection(('10.0.0.1', 80))", "import of 'socket' is not allowed"),
    "network past the import guard": (
        f"{_OS_GLOBALS}['__builtins__']['__import__']('socket')",
        "PermissionError: import is not allowed in the calculator",
    ),
    "import os": ("import os\nos.listdir('/')", "import of 'os' is not allowed"),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])", "import of 'subprocess' is not allowed"),
    "spawn past the import guard": (
        f"{_OS_GLOBALS}['system']('touch /tmp/hpcrl-pwned')",
        "PermissionError: os.system is not allowed in the calculator",
    ),
    "output flood": ("print('x' * 100000)", "output exceeded 1000 bytes"),
    "reading a file": ("open('/etc/passwd').read()", "NameError: name 'open' is not defined"),
}


@pytest.mark.parametrize("name", list(ATTEMPTS))
def test_escape_attempts_are_tool_errors(name: str) -> None:
    code, expected = ATTEMPTS[name]
    result = run_python(code, LIMITS)
    assert result.error and result.content.startswith("error: ") and expected in result.content, result.content


def test_arithmetic_and_printing_work() -> None:
    assert calculator({"expression": "123*45"}, LIMITS).content == "5535"
    assert run_python("print('n:')\nmath.factorial(10)", LIMITS).content == "n:\n3628800"
    assert run_python("from fractions import Fraction\nFraction(1, 3) + Fraction(1, 6)", LIMITS).content == (
        "Fraction(1, 2)"
    )
    bad = calculator({"expr": "1"}, LIMITS)
    assert bad.error and "calculator needs {'expression'" in bad.content


def test_calculator_environment_rewards_the_final_number() -> None:
    env = load_environment("calculator")
    assert isinstance(env, CalculatorEnvironment)
    episode = env.start({"prompt": "What is 123*45?", "answer": 5535})
    assert episode.tools[0]["function"]["name"] == "calculator"
    episode.messages.append({"role": "assistant", "content": "123*45 = 5535"})
    assert env.reward(episode) == 1.0
    episode.messages[-1] = {"role": "assistant", "content": "5536"}
    assert env.reward(episode) == 0.0
    with pytest.raises(ValueError, match="is not a subclass of hpcrl.sessions.environment.Environment"):
        load_environment("hpcrl.sessions.sandbox:SandboxLimits")


class EchoEnvironment(Environment):
    """A user environment, loaded by dotted path as a run config would name it."""

    def start(self, row: dict[str, Any]) -> Episode:
        return Episode(row=row, messages=[{"role": "user", "content": row["prompt"]}])

    def reward(self, episode: Episode) -> float:
        return 1.0


def test_environments_load_by_dotted_path_with_clear_errors() -> None:
    env = load_environment("tests.unit.test_sessions_sandbox:EchoEnvironment")
    episode = env.start({"prompt": "hi"})
    assert isinstance(env, EchoEnvironment) and episode.messages[0]["content"] == "hi"
    unknown = env.call_tool(episode, "search", {})
    assert unknown.error and "no tool named 'search'" in unknown.content
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg_hpcrl'"):
        load_environment("no_such_pkg_hpcrl:Env")
