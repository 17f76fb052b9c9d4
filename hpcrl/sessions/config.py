"""Settings of the session server and of one episode's budget."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, fields
from typing import Any

MODES = ("linear", "branching")


@dataclass(kw_only=True, frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    """Generated assistant turns per session; a request for one more ends the episode (reason `max_turns`)."""
    max_tokens_per_turn: int = 256
    """Tokens one turn may sample; a turn cut there ends the episode (reason `max_tokens_per_turn`)."""
    max_episode_tokens: int = 4096
    """Tokens of the whole sequence (prompt, tool results, sampled turns); reaching it ends the episode."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")

    def replace(self, overrides: dict[str, Any]) -> EpisodeLimits:
        valid = [f.name for f in fields(self)]
        unknown = sorted(set(overrides) - set(valid))
        if unknown:
            raise ValueError(f"unknown episode limit(s) {unknown}; valid: {valid}")
        for key, value in overrides.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{key} must be an integer, got {value!r}")
        return EpisodeLimits(**{**{k: getattr(self, k) for k in valid}, **overrides})


@dataclass(kw_only=True, frozen=True)
class SessionServerConfig:
    model_family: str
    """A registered family (qwen3, tiny); never detected from the checkpoint."""
    model: str
    """The model directory whose tokenizer the server uses (the engines serve the same model)."""
    engine_urls: tuple[str, ...]
    """Engines speaking the SGLang contract; a session stays on one engine (its prefix cache)."""
    host: str = "127.0.0.1"
    port: int = 0
    """0: any free port (the server reports the one it took)."""
    engine_api_key: str | None = None
    request_timeout_s: float = 600.0
    max_turns: int = 8
    max_tokens_per_turn: int = 256
    max_episode_tokens: int = 4096
    max_sessions: int = 4096
    """Open sessions at once; creating one more is refused (HTTP 429) rather than growing memory without bound."""
    api_key: str | None = None
    """When set, every route but /health requires `Authorization: Bearer <api_key>` (HTTP 401 otherwise): a run's
    own session server drives the run's engines with their keys, so no other local user may open sessions on it."""

    def __post_init__(self) -> None:
        from hpcrl.sessions.families import get_family

        get_family(self.model_family)
        if not self.engine_urls:
            raise ValueError("engine_urls is empty; give at least one engine URL (--engine http://127.0.0.1:30000)")
        if not _is_loopback(self.host):
            raise ValueError(
                f"host {self.host} is reachable from other machines and the session server has no authentication; "
                "bind it to loopback (127.0.0.1) and run the harness on the same node"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not a TCP port; use 0 (any free port) or 1..65535")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        _ = self.limits  # validates the three limits

    @property
    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(
            max_turns=self.max_turns,
            max_tokens_per_turn=self.max_tokens_per_turn,
            max_episode_tokens=self.max_episode_tokens,
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
