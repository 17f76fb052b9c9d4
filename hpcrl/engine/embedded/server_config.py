"""One engine process's settings (`ServerConfig`) and its API key: where the key comes from, and the checks that
keep an engine reachable from other machines from running without one."""

from __future__ import annotations

import ipaddress
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from hpcrl.config import to_dict
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.kernels_config import Override


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """One engine process: the engine section whole (declared, defaulted and checked once, by EngineConfig), and
    where this process serves it."""

    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    kernel_overrides: tuple[Override, ...] = ()
    """The engine.kernels knobs an HPCRL_ENGINE_* variable set (engine.kernels already holds their values)."""
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    random_seed: int = 0
    weight_version: str = "default"
    ignore_sigterm: bool = False

    def __post_init__(self) -> None:
        # Checked before the model loads: a bad flag must not cost a model load.
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port; use 1..65535")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty; put the key in the --api-key-file or HPCRL_ENGINE_API_KEY")
        if not self.api_key and not is_loopback(self.host):
            raise ValueError(
                f"--host {self.host} is reachable from other machines, and this engine has no API key, so anyone "
                f"could drive it: give it a key with --api-key-file FILE (mode 0600) or the environment variable "
                f"{API_KEY_ENV}, or bind to loopback (--host 127.0.0.1)"
            )

    def info(self) -> dict[str, Any]:
        """What /server_info reports of the settings: the engine section whole, and this process's place."""
        return {
            **to_dict(self.engine),
            "model": self.model,
            "host": self.host,
            "port": self.port,
            "random_seed": self.random_seed,
            "weight_version": self.weight_version,
            "kernel_overrides": [str(o) for o in self.kernel_overrides],
        }


API_KEY_ENV = "HPCRL_ENGINE_API_KEY"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def resolve_api_key(*, api_key: str | None, api_key_file: str | None) -> str | None:
    """The engine's key from --api-key, --api-key-file or HPCRL_ENGINE_API_KEY (first given wins).

    The variable is removed from this process's environment, so the engine's own children do not inherit it.
    """
    from_env = os.environ.pop(API_KEY_ENV, None)
    if api_key is not None and api_key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if api_key is not None:
        return api_key
    if api_key_file is not None:
        return read_key_file(api_key_file)
    return from_env if from_env else None


def read_key_file(path: str, flag: str = "--api-key-file") -> str:
    """The one key in the file `path` (given as `flag`), which must be a regular file only its owner can read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot open it ({exc.strerror})") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{flag} {path} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(
                f"{flag} {path} has mode {stat.S_IMODE(st.st_mode):o}: others can read the key; run `chmod 600 {path}`"
            )
        raw = f.read(4097)
    if len(raw) > 4096:
        raise ValueError(f"{flag} {path} is over 4 KiB; it holds one key on one line")
    try:
        key = raw.decode().strip()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag} {path} is not UTF-8 text") from exc
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"{flag} {path} must hold one key (no spaces) on one line")
    return key
