"""One session's turns, as an append-only tree, and the training sequences it yields.

Every generated assistant turn is a node: the tokens appended before it was sampled (the whole rendered prompt for
a root; the splice and the tail's ids otherwise) and the tokens it sampled, with their log-probs and weight
versions. A node's tokens are never changed after it is committed.

Linear sessions accept only requests that extend the latest turn's history (else HTTP 400 saying where it
diverged) and yield one training sequence. Branching sessions attach a request to the deepest turn whose history it
extends (none: a new root), and yield one sequence per leaf; a turn shared by several leaves is trained in the
first leaf only, so a shared prefix counts once.

Routed experts (a mixture-of-experts model under routing replay) are kept per turn, for the tokens that turn's
request ran first: a later turn's request runs the whole history again (a re-prefill, maybe on other weights or in
another batch), but a token's routes stay those of the forward that sampled the tokens after it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcrl.model.moe import encode_routes
from hpcrl.sessions.config import EpisodeLimits
from hpcrl.sessions.messages import Message, same_message


class SessionError(Exception):
    """A request the session refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(eq=False)
class Turn:
    seq: int
    parent: Turn | None
    messages: list[Message]
    """The history through this turn: the request's messages and the generated assistant message."""
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int | None]
    finish_reason: str
    message: Message
    call_ids: list[str]
    tools: tuple[dict[str, Any], ...] = ()
    parse_errors: tuple[str, ...] = ()
    seed: int | None = None
    supports: list[list[int]] | None = None
    """Per output token, the ids top-k let the engine draw from (top-k requests only); `logprobs` are then
    renormalised over them."""
    routes: np.ndarray | None = None
    """[tokens, layers, top-k] int32 routed experts of the tokens this turn's request ran first: from the last token
    of the history (a turn's last sampled token is run by the next turn's request only) through the last but one
    sampled; a root's from its first token. None when the engine was not asked for routes."""
    children: list[Turn] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return 1 if self.parent is None else self.parent.depth + 1

    def path(self) -> list[Turn]:
        out: list[Turn] = []
        node: Turn | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def token_ids(self) -> list[int]:
        return [t for turn in self.path() for t in (*turn.prompt_ids, *turn.output_ids)]

    def record(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "parent": None if self.parent is None else self.parent.seq,
            "num_prompt_tokens": len(self.prompt_ids),
            "output_ids": self.output_ids,
            "logprobs": self.logprobs,
            "weight_versions": self.weight_versions,
            "finish_reason": self.finish_reason,
            "message": self.message.to_openai(call_ids=self.call_ids),
            "parse_errors": list(self.parse_errors),
            "seed": self.seed,
        }


@dataclass(frozen=True)
class TrainingSequence:
    """One leaf's tokens; loss_mask is 1 on sampled tokens only, logprobs are 0.0 and weight versions None elsewhere.
    `supports` (when every turn sampled with top-k): each token's sampling support, a singleton for the tokens the
    model did not sample (prompt, tool results, template tokens)."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int | None]
    turns: list[int]
    finish_reason: str
    supports: list[list[int]] | None = None
    routed_experts: np.ndarray | None = None
    """[len(token_ids) - 1, layers, top-k] int32 (when every turn has routes): each token's routed experts, from the
    request that ran it first, so every sampled token is scored with the routes it was sampled with."""

    @property
    def prompt_length(self) -> int:
        """Tokens before the first trained one."""
        return next((i for i, m in enumerate(self.loss_mask) if m), len(self.loss_mask))

    def to_dict(self) -> dict[str, Any]:
        return (
            {
                "token_ids": self.token_ids,
                "loss_mask": self.loss_mask,
                "logprobs": self.logprobs,
                "weight_versions": self.weight_versions,
                "turns": self.turns,
                "finish_reason": self.finish_reason,
            }
            | ({"supports": self.supports} if self.supports is not None else {})
            | self._routes_dict()
        )

    def _routes_dict(self) -> dict[str, Any]:
        if self.routed_experts is None:
            return {}
        # SGLang's wire encoding, with the shape that decode_routes needs.
        return {"routed_experts": encode_routes(self.routed_experts), "routes_shape": list(self.routed_experts.shape)}


class Session:
    def __init__(self, session_id: str, *, mode: str, limits: EpisodeLimits, engine_index: int) -> None:
        self.id = session_id
        self.mode = mode
        self.limits = limits
        self.engine_index = engine_index
        self.turns: list[Turn] = []
        self.end_reason: str | None = None
        # Held for a whole chat request, generation included: a turn is attached, sampled and committed as one step,
        # so two requests can never both extend the same linear history.
        self.lock = threading.Lock()
        self.closed = False

    # ------------------------------------------------------------------------------------------------ attaching

    def attach(self, messages: list[Message], tools: tuple[dict[str, Any], ...]) -> tuple[Turn | None, list[Message]]:
        """The turn this request extends (None: a new root) and the messages it appends."""
        if messages[-1].role == "assistant":
            raise SessionError(
                400,
                "the last message is an assistant message; a session generates the next "
                "assistant turn after a user, tool or system message",
            )
        if not self.turns:
            return None, messages
        if self.mode == "linear":
            leaf = self.turns[-1]
            problem = self._divergence(leaf, messages, tools)
            if problem is not None:
                raise SessionError(
                    400,
                    f"the request does not extend this linear session's history: {problem}; "
                    "send the history exactly as the session returned it, or create the session "
                    "with mode 'branching' to branch",
                )
            return leaf, messages[len(leaf.messages) :]
        best: Turn | None = None
        for turn in self.turns:
            if self._divergence(turn, messages, tools) is None and (best is None or turn.depth >= best.depth):
                best = turn
        if best is None:
            return None, messages
        return best, messages[len(best.messages) :]

    def _divergence(self, turn: Turn, messages: list[Message], tools: tuple[dict[str, Any], ...]) -> str | None:
        if tools != turn.tools:
            return "its tools differ from the history's (tools are rendered into message 0)"
        stored = turn.messages
        for i, (old, new) in enumerate(zip(stored, messages, strict=False)):
            why = same_message(old, new)
            if why is not None:
                return f"message {i} diverges ({why})"
        if len(messages) <= len(stored):
            return (
                f"it has {len(messages)} messages and the history {len(stored)}; it must carry the whole history "
                "plus new messages"
            )
        return None

    # ----------------------------------------------------------------------------------------------- committing

    def commit(self, turn: Turn) -> None:
        if turn.parent is not None:
            turn.parent.children.append(turn)
        self.turns.append(turn)

    def end(self, reason: str) -> None:
        if self.end_reason is None:
            self.end_reason = reason

    # ------------------------------------------------------------------------------------------------- training

    def leaves(self) -> list[Turn]:
        return [t for t in self.turns if not t.children]

    def sequences(self) -> list[TrainingSequence]:
        trained: set[int] = set()
        out = []
        for leaf in self.leaves():
            ids: list[int] = []
            mask: list[int] = []
            logprobs: list[float] = []
            versions: list[int | None] = []
            path = leaf.path()
            replayed = all(turn.supports is not None for turn in path)
            supports: list[list[int]] = []
            for turn in path:
                n_prompt, n_out = len(turn.prompt_ids), len(turn.output_ids)
                train = turn.seq not in trained
                trained.add(turn.seq)
                ids += turn.prompt_ids + turn.output_ids
                mask += [0] * n_prompt + [1 if train else 0] * n_out
                logprobs += [0.0] * n_prompt + turn.logprobs
                versions += [None] * n_prompt + turn.weight_versions
                if replayed:
                    supports += [[t] for t in turn.prompt_ids] + list(turn.supports or [])
            turns = [t.seq for t in path]
            routes = None
            if all(turn.routes is not None for turn in path):
                routes = np.concatenate([turn.routes for turn in path if turn.routes is not None])
            out.append(
                TrainingSequence(
                    ids, mask, logprobs, versions, turns, leaf.finish_reason, supports=supports if replayed else None,
                    routed_experts=routes,
                )
            )  # fmt: skip
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "mode": self.mode,
            "end_reason": self.end_reason,
            "limits": {
                "max_turns": self.limits.max_turns,
                "max_tokens_per_turn": self.limits.max_tokens_per_turn,
                "max_episode_tokens": self.limits.max_episode_tokens,
            },
            "num_turns": len(self.turns),
            "turns": [t.record() for t in self.turns],
            "sequences": [s.to_dict() for s in self.sequences()],
        }
