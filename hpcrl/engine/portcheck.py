"""Who listens on an engine's port: the engine the run started, or someone else.

A local user can listen on a run's engine port first (or a foreign engine may hold it): the launcher must
not send that process the run's API key or the weight-group rendezvous. Before the first request to a
starting engine the launcher finds the socket listening on the port in /proc/net/tcp{,6} and checks that
one of the engine's own processes (the launched process or one of its descendants) holds it. Another
user's socket cannot be bound next to ours (Linux shares a port between listeners only for the same uid
with SO_REUSEPORT), so a port proven ours stays ours while the engine lives.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")
_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    address: str  # "0.0.0.0", "::", "127.0.0.1", ...
    port: int
    inode: int

    def describe(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


def _decode_address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listeners(port: int) -> list[Listener] | None:
    """Sockets listening on TCP `port` in this network namespace; None when /proc cannot tell (not Linux)."""
    found: list[Listener] = []
    readable = False
    for table in ("tcp", "tcp6"):
        try:
            lines = (_PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            hex_addr, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port:
                found.append(Listener(_decode_address(hex_addr), port, int(fields[9])))
    return found if readable else None


def _overlaps(listener_address: str, addresses: set[str]) -> bool:
    """Whether a connection to one of `addresses` (or a bind to them) can meet a socket bound to `listener_address`."""
    addr = ipaddress.ip_address(listener_address)
    if addr.is_unspecified or any(ipaddress.ip_address(a).is_unspecified for a in addresses):
        return True
    mapped = getattr(addr, "ipv4_mapped", None)
    return str(addr) in addresses or (mapped is not None and str(mapped) in addresses)


def resolve(host: str, port: int) -> set[str]:
    """The IP addresses `host` stands for ("" and "0.0.0.0": every address)."""
    if host in ("", "0.0.0.0", "::", "*"):
        return {"0.0.0.0"}
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return {host}
    return {str(ipaddress.ip_address(str(info[4][0]).split("%")[0])) for info in infos}


def listeners_for(host: str, port: int) -> list[Listener] | None:
    """The listeners a connection to (or a bind of) host:port would meet; None when /proc cannot tell."""
    found = listeners(port)
    if found is None:
        return None
    addresses = resolve(host, port)
    return [item for item in found if _overlaps(item.address, addresses)]


def _process_tree(root_pid: int) -> list[int]:
    """`root_pid` and its live descendants among this user's processes."""
    uid = os.getuid()
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def socket_inodes(root_pid: int) -> set[int]:
    """Inodes of the sockets held open by `root_pid` and its descendants."""
    inodes: set[int] = set()
    for pid in _process_tree(root_pid):
        fd_dir = _PROC / str(pid) / "fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for name in names:
            try:
                target = os.readlink(fd_dir / name)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


@dataclass(frozen=True)
class PortHolder:
    """Who listens where an engine should: `ours` (its own process), `foreign`, or `nobody`; `unknown` without /proc."""

    state: str
    where: str = ""


def port_holder(host: str, port: int, pid: int) -> PortHolder:
    found = listeners_for(host, port)
    if found is None:
        return PortHolder("unknown")
    if not found:
        return PortHolder("nobody")
    ours = socket_inodes(pid)
    foreign = [item for item in found if item.inode not in ours]
    if foreign:
        return PortHolder("foreign", ", ".join(item.describe() for item in foreign))
    return PortHolder("ours", ", ".join(item.describe() for item in found))


def port_in_use(host: str, port: int) -> str | None:
    """Where something already listens that a bind of host:port would collide with, None if the port is free."""
    found = listeners_for(host, port)
    if found is None:  # no /proc: try the bind itself
        try:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
        except OSError:
            return f"{host}:{port}"
        return None
    return ", ".join(item.describe() for item in found) or None


class PortInUseError(RuntimeError):
    """A server cannot listen where it was asked to: another process holds the port."""


def check_port_free(host: str, port: int, *, what: str, option: str = "--port") -> None:
    """Raise PortInUseError when `host:port` is taken; called before a server's slow start-up (a model load)."""
    if port == 0:
        return
    held = port_in_use(host, port)
    if held is not None:
        raise PortInUseError(
            f"{what} cannot listen on {host}:{port}: another process already listens on {held}; stop it, or pass "
            f"another {option}"
        )


def bind_error(exc: OSError, host: str, port: int, *, what: str, option: str = "--port") -> PortInUseError:
    """The error of a bind that failed after the check (the port was taken meanwhile), naming the fix."""
    return PortInUseError(f"{what} cannot listen on {host}:{port}: {exc.strerror or exc}; pass another {option}")
