"""The sandboxed calculator: every escape attempt ends as a clear tool error, arithmetic works, through the fork
server and through a fresh interpreter alike; calls stay apart from each other."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from hpcrl.sessions import sandbox_server
from hpcrl.sessions.environment import CalculatorEnvironment, Environment, Episode, load_environment
from hpcrl.sessions.sandbox import (
    SandboxLimits,
    ToolResult,
    _result,
    calculator,
    output_cap,
    run_in_new_process,
    run_python,
)

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


def _fresh_interpreter(code: str, limits: SandboxLimits) -> ToolResult:
    """The path a call takes when the fork server cannot serve it."""
    return _result(*run_in_new_process(code, limits, output_cap(limits)), limits)


PATHS = {"fork server": run_python, "fresh interpreter": _fresh_interpreter}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(ATTEMPTS))
def test_escape_attempts_are_tool_errors(name: str, path: str) -> None:
    code, expected = ATTEMPTS[name]
    result = PATHS[path](code, LIMITS)
    assert result.error and result.content.startswith("error: ") and expected in result.content, result.content


def test_a_child_that_blocks_without_cpu_is_killed_at_the_wall_clock_limit() -> None:
    # os.read on a pipe of its own: no audited event, no CPU spent, so only the wall-clock bound (5 s here) ends it.
    t0 = time.monotonic()
    result = run_python(f"{_OS_GLOBALS}['read']({_OS_GLOBALS}['pipe']()[0], 1)", LIMITS)
    assert result.content == "error: the wall-clock limit (5 s) was exceeded"
    assert time.monotonic() - t0 < 15
    # A child that closes its answer pipe and spins is ended by its CPU limit.
    spun = run_python(f"{_OS_GLOBALS}['close'](1)\nwhile True:\n    pass", LIMITS)
    assert spun.content == "error: the CPU time limit (1 s) was exceeded"
    assert run_python("6*7", LIMITS).content == "42"  # and the server serves on


def test_calls_are_separate_processes_and_concurrent_calls_get_their_own_answers() -> None:
    assert run_python("math.pi = 3\nmath.pi", LIMITS).content == "3"
    assert run_python("math.pi", LIMITS).content == "3.141592653589793"  # the change died with its child
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(lambda i: run_python(f"{i}*{i}", LIMITS).content, range(64)))
    assert answers == [str(i * i) for i in range(64)]


def test_a_killed_server_is_replaced_and_the_call_still_answers() -> None:
    assert run_python("1+1", LIMITS).content == "2"
    server = sandbox_server._server
    assert server is not None
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    assert run_python("2+2", LIMITS).content == "4"
    assert sandbox_server._server is not None and sandbox_server._server.proc.pid != server.proc.pid


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
    with pytest.raises(ValueError) as info:
        load_environment("no_such_pkg_hpcrl:Env")
    assert str(info.value) == (
        "rollout.environment: cannot import 'no_such_pkg_hpcrl:Env': no module named 'no_such_pkg_hpcrl' (check the "
        "spelling, and that it is on PYTHONPATH); give a built-in (calculator), a dotted path module:Class or a file "
        "path file.py:Class"
    )
