"""The built-in calculator tool: Python run in a sandboxed subprocess, failures returned as tool errors.

The model's code runs in a fresh process: a fork of the calculator server (`sandbox_server`: one `python -I -S
-B` with an empty environment, in an empty temporary directory, that has imported what a call needs), or a fresh
interpreter of that kind when the server cannot serve. Under these layers (each alone is escapable; together they
bound what a tool call can do):
- resource limits set in the child before any model code runs: RLIMIT_CPU (CPU seconds, then SIGXCPU/SIGKILL),
  RLIMIT_AS (address space: a memory bomb gets MemoryError), RLIMIT_FSIZE 0 (no file written), RLIMIT_CORE 0;
- builtins without open/input/breakpoint/exec/eval/compile, and an __import__ that allows only math-like modules
  (so `import os`, `import socket`, `import subprocess` fail with a clear message);
- an audit hook (PEP 578, cannot be removed from Python code) that refuses every audited event once model code
  starts except running the code itself: new imports, sockets (no network), process spawns (os.system, fork,
  exec, subprocess), file opens, ctypes;
- at most `output_cap` bytes are read and a wall-clock bound holds, then the child's process group is killed.
It is not a container: no network namespace or seccomp filter. Run untrusted agents' other tools in a real
sandbox; this one is for arithmetic.
"""

from __future__ import annotations

import ast
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["CALCULATOR_SCHEMA", "SandboxLimits", "ToolResult", "calculator", "run_python"]

ALLOWED_MODULES = ("math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools", "operator")

CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate Python arithmetic (math, fractions, decimal allowed); returns the last expression's "
        "value and anything printed.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 123*45 or math.sqrt(2)"}},
            "required": ["expression"],
        },
    },
}


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    cpu_s: int = 2
    memory_mb: int = 256
    max_output_bytes: int = 4096
    max_code_bytes: int = 16384

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_mb", "max_output_bytes", "max_code_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def wall_s(self) -> float:
        # CPU time is the real bound; wall time catches a child that blocks without spending CPU.
        return 2.0 * self.cpu_s + 3.0


@dataclass(frozen=True)
class ToolResult:
    content: str
    error: bool = False

    def message(self, tool_call_id: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "tool", "content": self.content}
        if tool_call_id is not None:
            out["tool_call_id"] = tool_call_id
        return out


# Runs in the child: a fork of the calculator server (sandbox_server.py), which passes cpu_s, memory_b, max_out,
# allowed and code as globals, or a fresh interpreter (_SPAWNED_CHILD). Limits first, then the audit hook, then the
# model's code; one line, repr((ok, text)), is the answer.
CHILD_BODY = r"""
import sys, resource
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory_b, memory_b))
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
import _ast, builtins, io
for name in allowed:
    __import__(name)
if code is None:
    code = sys.stdin.read()
out = sys.stdout
state = {"running": False}

def hook(event, args):
    if state["running"] and event not in ("exec", "compile"):
        raise PermissionError(f"{event} is not allowed in the calculator (no files, network, processes or imports)")

class Capped(io.StringIO):
    def write(self, s):
        if self.tell() + len(s) > max_out:
            raise OverflowError(f"output exceeded {max_out} bytes")
        return super().write(s)

def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level or name.split(".")[0] not in allowed:
        raise ImportError(f"import of {name!r} is not allowed in the calculator; allowed: {', '.join(allowed)}")
    return __import__(name, globals, locals, fromlist, level)

safe = {k: getattr(builtins, k) for k in dir(builtins)
        if k not in ("open", "input", "breakpoint", "exec", "eval", "compile", "__import__", "help", "exit", "quit")}
safe["__import__"] = guarded_import
env = {"__builtins__": safe, "__name__": "__calc__"}
for name in allowed:
    env[name] = sys.modules[name]
printed = Capped()

def answer(ok, text):
    out.write(repr((ok, text)) + "\n")
    out.flush()

try:
    tree = compile(code, "<calculator>", "exec", _ast.PyCF_ONLY_AST)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
    body = compile(tree, "<calculator>", "exec")
    tail = compile(_ast.Expression(last.value), "<calculator>", "eval") if last is not None else None
except SyntaxError as exc:
    answer(False, f"SyntaxError: {exc.msg} (line {exc.lineno})")
    sys.exit(0)
sys.stdout = sys.stderr = printed
sys.addaudithook(hook)
try:
    state["running"] = True
    exec(body, env)
    value = eval(tail, env) if tail is not None else None
    state["running"] = False
    text = printed.getvalue() + ("" if value is None else repr(value))
    if len(text) > max_out:
        raise OverflowError(f"output exceeded {max_out} bytes")
    answer(True, text)
except MemoryError:
    state["running"] = False
    answer(False, f"MemoryError: the memory limit ({memory_b // 2**20} MB) was exceeded")
except BaseException as exc:
    state["running"] = False
    answer(False, f"{type(exc).__name__}: {exc}")
"""

_SPAWNED_CHILD = (
    "import sys\n"
    "cpu_s, memory_b, max_out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])\n"
    "allowed = tuple(sys.argv[4].split(','))\n"
    "code = None\n" + CHILD_BODY
)


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> ToolResult:
    """Run `code` in the sandbox; the value of its last expression (and what it printed) is the result.

    The child is a fork of the calculator server (`sandbox_server`), or a fresh interpreter when the server cannot
    serve; both run the same program under the same limits."""
    if not isinstance(code, str):
        return ToolResult(f"error: the code must be a string, got {type(code).__name__}", error=True)
    if len(code.encode()) > limits.max_code_bytes:
        return ToolResult(f"error: the code is over {limits.max_code_bytes} bytes", error=True)
    from hpcrl.sessions import sandbox_server  # imports this module: here, not at the top

    cap = output_cap(limits)
    try:
        returncode, data, problem = sandbox_server.run(code, limits, cap)
    except sandbox_server.ServerUnavailable:
        returncode, data, problem = run_in_new_process(code, limits, cap)
    return _result(returncode, data, problem, limits)


def output_cap(limits: SandboxLimits) -> int:
    """Bytes read from a child at most: room for repr's escapes of a full answer (\\U0001xxxx: 10 per char)."""
    return 10 * limits.max_output_bytes + 256


def run_in_new_process(code: str, limits: SandboxLimits, cap: int) -> tuple[int, bytes, str | None]:
    """The child in a fresh `python -I -S -B` (return code, output, the parent's complaint or None)."""
    with tempfile.TemporaryDirectory(prefix="hpcrl-calc-") as cwd:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-B",
                "-c",
                _SPAWNED_CHILD,
                str(limits.cpu_s),
                str(limits.memory_mb * 2**20),
                str(limits.max_output_bytes),
                ",".join(ALLOWED_MODULES),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=cwd,
            env={},
            start_new_session=True,
            close_fds=True,
        )
        try:
            data, problem = _collect(proc, code.encode(), cap, limits.wall_s)
        finally:
            _kill(proc)
    return proc.returncode if proc.returncode is not None else -signal.SIGKILL, data, problem


def _result(returncode: int, data: bytes, problem: str | None, limits: SandboxLimits) -> ToolResult:
    if problem is not None:
        return ToolResult(f"error: {problem}", error=True)
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) or (returncode and not data):
        if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return ToolResult(f"error: the CPU time limit ({limits.cpu_s} s) was exceeded", error=True)
        return ToolResult(f"error: the calculator process failed (exit {returncode})", error=True)
    try:
        ok, text = ast.literal_eval(data.decode().strip().splitlines()[-1])  # the child's repr((ok, text))
        if not isinstance(ok, bool) or not isinstance(text, str):
            raise ValueError("not an answer")
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, IndexError, UnicodeDecodeError):
        return ToolResult("error: the calculator gave no answer", error=True)
    return ToolResult(text if ok else f"error: {text}", error=not ok)


def _collect(proc: subprocess.Popen[bytes], stdin: bytes, cap: int, wall_s: float) -> tuple[bytes, str | None]:
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + wall_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"", f"the wall-clock limit ({wall_s:.0f} s) was exceeded"
            if not sel.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            size += len(chunk)
            if size > cap:
                return b"", f"the output exceeded {cap} bytes"
            chunks.append(chunk)
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return b"", f"the wall-clock limit ({wall_s:.0f} s) was exceeded"
    return b"".join(chunks), None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def calculator(arguments: dict[str, Any], limits: SandboxLimits = SandboxLimits()) -> ToolResult:
    """The `calculator` tool: arguments {"expression": "..."}."""
    expression = arguments.get("expression")
    if not isinstance(expression, str) or not expression.strip():
        return ToolResult("error: calculator needs {'expression': '<python arithmetic>'}", error=True)
    return run_python(expression, limits)
