"""Multi-turn episodes as the trainer's Groups: one Sample per training sequence, its loss mask carried along.

A sequence's prompt is what comes before its first trained token (the system and user messages of turn 1 and the
template); everything after is the response, with loss only on the sampled tokens. A branching episode gives one
Sample per leaf, all with the episode's reward.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hpcrl.engine.client import EngineClient
from hpcrl.engine.fleet import EngineFleet, FleetError
from hpcrl.model.moe import decode_routes
from hpcrl.rollout.config import RolloutConfig
from hpcrl.rollout.generate import support_stats
from hpcrl.samples.sample import Example, Group, Sample, sample_seed
from hpcrl.samples.support import TokenSupports
from hpcrl.sessions.config import SessionServerConfig
from hpcrl.sessions.environment import Environment, EpisodeResult, episode_metrics, load_environment, run_episode
from hpcrl.sessions.server import SessionServer

__all__ = ["EpisodeRollout", "group_from_episodes", "rollout_groups"]

# Episodes in flight at once: enough to fill an engine's batch, few enough that the threads stay cheap.
MAX_CONCURRENT_EPISODES = 64
# Rounds of re-running the episodes a dead engine cut, each after the fleet restarts it (engine.max_restarts bounds
# the restarts themselves); past them the step stops the run.
MAX_EPISODE_RERUNS = 3


def group_from_episodes(example: Example, results: Sequence[EpisodeResult]) -> Group:
    """The Group of one dataset row's episodes; an episode without a sampled token trains nothing and is left out."""
    group = Group(example=example)
    for result in results:
        for seq in result.sequences:
            mask = seq["loss_mask"]
            start = next((i for i, m in enumerate(mask) if m), None)
            if start is None:
                continue
            group.samples.append(
                Sample(
                    prompt_ids=seq["token_ids"][:start],
                    output_ids=seq["token_ids"][start:],
                    logprobs=seq["logprobs"][start:],
                    text=str(result.messages[-1].get("content") or ""),
                    finish=seq["finish_reason"],
                    weight_versions=seq["weight_versions"][start:],
                    reward=result.reward,
                    reward_error=result.reward_error,
                    loss_mask=mask[start:],
                    supports=TokenSupports.from_lists(seq["supports"][start:]) if "supports" in seq else None,
                    routed_experts=_routes(seq),
                )
            )
    return group


def _routes(seq: dict[str, Any]) -> Any:
    """The sequence's routed experts [tokens - 1, layers, top-k] (the session server's, per turn), None without."""
    if "routed_experts" not in seq:
        return None
    _, layers, top_k = seq["routes_shape"]
    return decode_routes(seq["routed_experts"], layers, top_k)


def rollout_groups(
    env: Environment,
    examples: Sequence[Example],
    server_url: str,
    *,
    num_samples: int,
    step: int,
    seed: int,
    sampling: dict[str, Any] | None = None,
    limits: dict[str, int] | None = None,
    max_concurrency: int = 16,
) -> tuple[list[Group], dict[str, float]]:
    """`num_samples` episodes per example, run concurrently; their Groups and the rollout/* episode metrics.

    Episode seeds depend only on (seed, step, example, sample), as single-turn samples' do, so a step repeats."""
    results = run_episodes(
        env, examples, server_url, num_samples=num_samples, step=step, seed=seed, sampling=sampling, limits=limits,
        max_concurrency=max_concurrency,
    )  # fmt: skip
    return groups_by_example(examples, results, num_samples), episode_metrics(results)


def groups_by_example(examples: Sequence[Example], results: Sequence[EpisodeResult], num_samples: int) -> list[Group]:
    """One Group per example from `run_episodes`' (example, sample)-ordered results."""
    return [
        group_from_episodes(example, results[p * num_samples : (p + 1) * num_samples])
        for p, example in enumerate(examples)
    ]


def run_episodes(
    env: Environment,
    examples: Sequence[Example],
    server_url: str,
    *,
    num_samples: int,
    step: int,
    seed: int,
    sampling: dict[str, Any] | None = None,
    limits: dict[str, int] | None = None,
    max_concurrency: int = 16,
    api_key: str | None = None,
    jobs: Sequence[tuple[int, int]] | None = None,
) -> list[EpisodeResult]:
    """The episodes of a step in (example, sample) order, each seeded by (seed, step, example, sample); `jobs`: only
    these (example, sample) pairs, in their order (episodes run again after an engine failed them)."""
    if jobs is None:
        jobs = [(p, s) for p in range(len(examples)) for s in range(num_samples)]

    def one(job: tuple[int, int]) -> EpisodeResult:
        p, s = job
        row = {"prompt": examples[p].prompt, "answer": examples[p].answer}
        episode_seed = sample_seed(seed, step, p, s) % 2**31
        return run_episode(env, row, server_url, sampling=sampling, limits=limits, seed=episode_seed, api_key=api_key)

    with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(jobs)))) as pool:
        return list(pool.map(one, jobs))


class EpisodeRollout:
    """rollout.kind=multi_turn: a step's episodes through a session server in front of the run's engines.

    The same interface as the single-turn `Rollout` (`generate(step, examples) -> groups`, `pop_metrics`, `close`).
    Each group holds one Sample per episode (linear sessions: one training sequence each) with the environment's
    reward already set and a loss mask over its sampled tokens. Episode seeds depend only on (seed, step, prompt,
    sample), so a step re-run after a resume draws the same episodes: nothing duplicated, nothing lost.
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        fleet: EngineFleet,
        *,
        model_dir: Path,
        tokenizer: Any,
        seed: int,
        recover: Callable[[], None] | None = None,
        routes_shape: tuple[int, int] | None = None,
    ) -> None:
        """`recover`: restart the fleet's dead engines and give them the served weights (the publisher's
        restore_engines); None: an episode that no engine could finish stops the run. `routes_shape`: (layers,
        top-k) of a mixture-of-experts model whose routes the trainer replays (each turn's are kept)."""
        assert cfg.model_family is not None  # RolloutConfig refuses multi_turn without it
        self.cfg, self.seed, self.fleet, self.recover = cfg, seed, fleet, recover
        engines = [slot.client for slot in fleet.slots]
        self.env = load_environment(cfg.environment or "calculator")
        limits = cfg.episode_limits
        # The server drives the run's engines with their keys: only this rollout may open sessions on it.
        self._key = secrets.token_hex(16)
        server_cfg = SessionServerConfig(
            model_family=cfg.model_family, model=str(model_dir), engine_urls=tuple(e.url for e in engines),
            request_timeout_s=cfg.request_timeout_s, max_turns=limits.max_turns,
            max_tokens_per_turn=limits.max_tokens_per_turn, max_episode_tokens=limits.max_episode_tokens,
            api_key=self._key,
        )  # fmt: skip
        # The slots' clients as they are now: a restarted engine is a new process behind a new client.
        self.server = SessionServer(
            server_cfg, tokenizer=tokenizer, engines=self._engines, routes_shape=routes_shape
        ).start()
        self._metrics: dict[str, float] = {}

    def _engines(self) -> list[EngineClient]:
        return [slot.client for slot in self.fleet.slots]

    def generate(self, step: int, examples: Sequence[Example]) -> list[Group]:
        n = self.cfg.n_samples_per_prompt
        jobs = [(p, s) for p in range(len(examples)) for s in range(n)]
        results = self._episodes(step, examples, jobs)
        for _ in range(MAX_EPISODE_RERUNS):
            failed = [k for k, r in enumerate(results) if r.end_reason == "engine_failed"]
            if not failed or self.recover is None:
                break
            # An episode cut by a dead engine is not the policy's doing, and a Group must hold all n samples (GRPO
            # compares siblings): once the fleet has restarted the dead engines (with the served weights), those
            # episodes run again from their start, with the same seeds, as the sync rollout re-issues requests.
            self.fleet.probe_all()  # who died; restore_engines restarts them
            self.recover()
            self.fleet.num_reissued += len(failed)
            again = self._episodes(step, examples, [jobs[k] for k in failed])
            for k, result in zip(failed, again, strict=True):
                results[k] = result
        cut = [r for r in results if r.end_reason == "engine_failed"]
        if cut:
            # The resume re-runs this step's episodes with the same seeds.
            tries = f" in {MAX_EPISODE_RERUNS + 1} tries (the fleet restarting dead engines between them)"
            tried = tries if self.recover is not None else ""
            raise FleetError(
                f"{len(cut)} of {len(results)} episodes of step {step + 1} ended because every engine failed a "
                f"turn{tried}; fix the engines and rerun to resume the step"
            )
        groups = groups_by_example(examples, results, n)
        short = [p for p, g in enumerate(groups) if len(g.samples) != n]
        if short:
            raise RuntimeError(
                f"step {step + 1}: the episodes of prompt {short[0] + 1} produced {len(groups[short[0]].samples)} "
                f"training sequences for {n} episodes (an episode with no sampled token, e.g. a prompt over "
                "rollout.max_episode_tokens); raise rollout.max_episode_tokens"
            )
        samples = [s for g in groups for s in g.samples]
        trained = sum(sum(s.loss_mask or ()) for s in samples)
        response = sum(len(s.output_ids) for s in samples)
        ends = [r.end_reason for r in results]
        self._metrics = (
            episode_metrics(results)
            | support_stats(samples, sampled_only=True)
            | {
                # Below 1: the response holds tool and template tokens that the loss mask keeps out of training.
                "rollout/trained_token_share": trained / response if response else float("nan"),
                "rollout/answered_share": ends.count("answered") / len(ends),
            }
        )
        return groups

    def _episodes(self, step: int, examples: Sequence[Example], jobs: Sequence[tuple[int, int]]) -> list[EpisodeResult]:
        return run_episodes(
            self.env, examples, self.server.url, num_samples=self.cfg.n_samples_per_prompt, step=step, seed=self.seed,
            sampling=self._sampling(), max_concurrency=MAX_CONCURRENT_EPISODES, api_key=self._key, jobs=jobs,
        )  # fmt: skip

    def _sampling(self) -> dict[str, Any]:
        """What each turn's request asks: the temperature, and top-k/top-p when they are set (replayed in training:
        the session server records each sampled token's support)."""
        out: dict[str, Any] = {"temperature": self.cfg.temperature}
        if self.cfg.replays_support:
            out |= {"top_k": self.cfg.top_k, "top_p": self.cfg.top_p}
        return out

    def pop_metrics(self) -> dict[str, float]:
        """The last step's episode figures (rollout/turns_mean, tool_calls_mean, tool_error_share, ...)."""
        out, self._metrics = self._metrics, {}
        return out

    def close(self) -> None:
        self.server.stop()
