"""The calculator's fork server: one long-lived `python -I -S -B` forks a fresh child per tool call.

A tool call used to start an interpreter and import the allowed modules (fractions pulls in re and enum,
statistics random): about 40-60 ms of CPU per call on this project's 2-core machine, i.e. seconds per GRPO step
when 128 episodes each call the tool at once. The server pays those imports once; a call is then a fork of it.

Each child is still its own process, made for one call: it moves to its own process group, keeps no descriptor
but /dev/null and its answer pipe (so it cannot read other calls' requests or forge their answers), sets the
call's resource limits, installs the audit hook and runs `sandbox.CHILD_BODY`, exactly as a fresh interpreter
does. The server enforces the wall-clock bound and the output cap, and kills the child's process group. What a
child can see that a fresh interpreter could not: the server's memory (the allowed modules, and possibly the
code of earlier calls of the same process, which are the same run's model outputs). A child's changes (say
`math.pi = 3`) die with it.

One server per hpcrl process (re-made after a fork of that process or if it dies); calls from many threads share
it. Requests and answers are one line each, `repr` of a tuple, read with `ast.literal_eval`.
"""

from __future__ import annotations

import ast
import atexit
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any

from hpcrl.sessions.sandbox import ALLOWED_MODULES, CHILD_BODY, SandboxLimits

__all__ = ["ServerUnavailable", "run", "shutdown"]


class ServerUnavailable(RuntimeError):
    """The server could not take or finish a call (it could not start, or died); the caller runs it elsewhere."""


class _ServerGone(ServerUnavailable):
    """The request could not even be sent: the server had died; a new one may take the call."""


_SERVER = r"""
import ast, os, select, signal, sys, time
import resource, _ast, builtins, io
allowed = tuple(sys.argv[1].split(","))
for name in allowed:
    __import__(name)
body = compile(sys.argv[2], "<calculator>", "exec")
max_fd = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024
replies = sys.stdout.buffer
calls = {}  # pid -> dict(req, fd, deadline, chunks, size, cap, problem, eof)
by_fd = {}
poller = select.poll()  # not select.select: that stops at descriptor 1024, and calls come in hundreds at once
poller.register(0, select.POLLIN)

def reply(call, status):
    replies.write(repr((call["req"], status, b"".join(call["chunks"]), call["problem"])).encode() + b"\n")
    replies.flush()

def start(req_id, cpu_s, memory_b, max_out, cap, wall_s, code):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(w, 1)
            os.dup2(null, 2)
            os.closerange(3, max_fd)
            exec(body, {"__name__": "__calc__", "cpu_s": cpu_s, "memory_b": memory_b, "max_out": max_out,
                        "allowed": allowed, "code": code})
        except BaseException:
            pass
        finally:
            os._exit(0)
    os.close(w)
    try:
        os.setpgid(pid, pid)  # also here: a kill must find the group even if the child has not made it yet
    except OSError:
        pass
    call = dict(req=req_id, fd=r, pid=pid, deadline=time.monotonic() + wall_s, wall=wall_s, chunks=[], size=0,
                cap=cap, problem=None, eof=False)
    calls[pid] = call
    by_fd[r] = call
    poller.register(r, select.POLLIN)

def kill(call, problem):
    if call["problem"] is None:
        call["problem"] = problem
        call["chunks"] = []
    try:
        os.killpg(call["pid"], signal.SIGKILL)
    except ProcessLookupError:
        pass
    close(call)

def close(call):
    if not call["eof"]:
        call["eof"] = True
        by_fd.pop(call["fd"], None)
        poller.unregister(call["fd"])
        os.close(call["fd"])

pending = b""
while True:
    now = time.monotonic()
    waiting = any(c["eof"] for c in calls.values())
    # A child past its EOF is exiting: poll its exit briefly rather than block on it (it could spin on, fd closed).
    timeout = 0.001 if waiting else min([c["deadline"] - now for c in calls.values()] + [1.0])
    for fd, _ in poller.poll(max(0.0, timeout) * 1000):
        if fd == 0:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the parent is gone: so are its calls
                for c in list(calls.values()):
                    kill(c, "the calculator server stopped")
                os._exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                start(*ast.literal_eval(line.decode()))
            continue
        call = by_fd.get(fd)
        if call is None:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            close(call)
            continue
        call["size"] += len(chunk)
        call["chunks"].append(chunk)
        if call["size"] > call["cap"]:
            kill(call, f"the output exceeded {call['cap']} bytes")
    now = time.monotonic()
    for pid, call in list(calls.items()):
        if now > call["deadline"] and call["problem"] is None:
            kill(call, f"the wall-clock limit ({call['wall']:.0f} s) was exceeded")
        if not call["eof"]:
            continue
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            del calls[pid]
            reply(call, -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


class _Server:
    """The parent's side: a writer lock for requests, a reader thread that hands each answer to its caller."""

    def __init__(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="hpcrl-calc-")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", "-c", _SERVER, ",".join(ALLOWED_MODULES), CHILD_BODY],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=self.workdir,
            env={},
            start_new_session=True,
            close_fds=True,
        )
        self.pid = os.getpid()
        self.ids = itertools.count()
        self.write_lock = threading.Lock()
        self.waiting: dict[int, tuple[threading.Event, list[Any]]] = {}
        self.alive = True
        self.reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True, name="calc-server")
        self.reader.start()

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            try:
                req_id, status, data, problem = ast.literal_eval(line.decode())
            except (ValueError, SyntaxError, UnicodeDecodeError):
                continue
            slot = self.waiting.pop(req_id, None)
            if slot is not None:
                slot[1].append((int(status), bytes(data), problem))
                slot[0].set()
        self.alive = False
        for event, _ in list(self.waiting.values()):
            event.set()  # their callers find no answer and run the call elsewhere

    def call(self, code: str, limits: SandboxLimits, cap: int) -> tuple[int, bytes, str | None]:
        req_id = next(self.ids)
        event = threading.Event()
        box: list[tuple[int, bytes, str | None]] = []
        self.waiting[req_id] = (event, box)
        request = (req_id, limits.cpu_s, limits.memory_mb * 2**20, limits.max_output_bytes, cap, limits.wall_s, code)
        try:
            with self.write_lock:
                assert self.proc.stdin is not None
                self.proc.stdin.write(repr(request).encode() + b"\n")
                self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            self.waiting.pop(req_id, None)
            self.alive = False
            raise _ServerGone(f"the calculator server is gone ({exc})") from exc
        # The server answers every call by its wall-clock bound; the margin covers a busy machine.
        if not event.wait(limits.wall_s + 30.0) or not box:
            self.waiting.pop(req_id, None)
            if self.alive:  # a server that stops answering is replaced
                self.close()
            raise ServerUnavailable("the calculator server did not answer")
        returncode, data, problem = box[0]
        return returncode, data, problem

    def close(self) -> None:
        self.alive = False
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)


_lock = threading.Lock()
_server: _Server | None = None


def _current() -> _Server:
    global _server
    with _lock:
        if _server is not None and (_server.pid != os.getpid() or not _server.alive or _server.proc.poll() is not None):
            if _server.pid == os.getpid():
                _server.close()
            _server = None  # a forked hpcrl process does not share its parent's pipes
        if _server is None:
            try:
                _server = _Server()
            except OSError as exc:
                raise ServerUnavailable(f"the calculator server could not start ({exc})") from exc
        return _server


def run(code: str, limits: SandboxLimits, cap: int) -> tuple[int, bytes, str | None]:
    """One call through the server: (the child's return code, its output, the server's complaint or None). A server
    found dead when the request is sent is replaced once; ServerUnavailable otherwise."""
    try:
        return _current().call(code, limits, cap)
    except _ServerGone:
        return _current().call(code, limits, cap)


def shutdown() -> None:
    """Stop this process's server (the next call starts another)."""
    global _server
    with _lock:
        if _server is not None and _server.pid == os.getpid():
            _server.close()
        _server = None


atexit.register(shutdown)
