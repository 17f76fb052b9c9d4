"""rollout.mode=async: the producer, the group buffer and the ledger against real embedded engines on loopback."""

from __future__ import annotations

import json
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hpcrl.config import ConfigError
from hpcrl.engine.client import EngineClient
from hpcrl.engine.config import EngineConfig
from hpcrl.engine.fleet import EngineFleet
from hpcrl.engine.protocol.answers import FinishReason, GenerateResult, WeightVersionSpan
from hpcrl.rollout.buffer import BufferedGroup
from hpcrl.rollout.config import BufferConfig, DataConfig, RewardConfig, RolloutConfig
from hpcrl.rollout.data import PromptSource, make_addition_task
from hpcrl.rollout.generate import PromptFormatter
from hpcrl.rollout.ledger import ledger_problems
from hpcrl.rollout.producer import AsyncRollout, earliest_step, oldest_version
from hpcrl.rollout.scoring import RewardScorer
from hpcrl.run_config import load_run_config, run_config_yaml
from hpcrl.samples.sample import Group
from hpcrl.samples.versions import stored_version
from hpcrl.store import load_metrics
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.publisher import WeightPublisher
from hpcrl.sync.push import WeightSync
from tests.conftest import EngineProcess, start_engine
from tests.support import REPO, SMALL, hpcrl, signal_at_step

ENGINE_ARGS = ("--weight-version", "0", "--max-running-requests", "512")


class Parts:
    """An AsyncRollout over real engines, with a real publisher (same-host tensor handover)."""

    def __init__(self, model_dir: Path, urls: list[str]) -> None:
        from transformers import AutoTokenizer

        self.model_dir = model_dir
        self.clients = [EngineClient(u) for u in urls]
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.fleet = EngineFleet(EngineConfig(health_interval_s=0.2), self.clients, launcher=None, on_event=self._event)
        self.formatter = PromptFormatter(AutoTokenizer.from_pretrained(model_dir), DataConfig())
        self.data = PromptSource(make_addition_task(500, 2, 0), batch_size=2, seed=0)
        self.sync = WeightSync(SyncConfig(transport="tensor"), self.clients, device=torch.device("cpu"))
        weights = list(load_file(str(model_dir / "model.safetensors")).items())
        self.publisher = WeightPublisher(
            EngineConfig(), self.fleet, self.sync, lambda: weights, on_event=self._event, every_steps=1, num_steps=0
        )
        self.made: list[AsyncRollout] = []

    def _event(self, kind: str, detail: dict[str, Any]) -> None:
        self.events.append((kind, detail))

    def make(
        self, *, n: int = 4, prompts_per_step: int = 2, inflight: int = 2, capacity: int = 4, max_new_tokens: int = 6,
        reward: str = "arithmetic_answer", sampling: dict[str, Any] | None = None, num_steps: int | None = None,
        **buffer: Any,
    ) -> AsyncRollout:  # fmt: skip
        self.data.batch_size = prompts_per_step
        scorer = RewardScorer(RewardConfig(fn=reward), interrupted=lambda: False, on_stop=lambda s, d: None)
        rollout = AsyncRollout(
            RolloutConfig(mode="async", n_samples_per_prompt=n, max_new_tokens=max_new_tokens, **(sampling or {})),
            BufferConfig(**buffer), self.fleet, self.formatter, self.data, scorer, self.publisher,
            seed=0, prompts_per_step=prompts_per_step, max_inflight_groups=inflight, capacity_groups=capacity,
            num_steps=num_steps,
        )  # fmt: skip
        self.made.append(rollout)
        return rollout

    def close(self) -> None:
        for r in self.made:
            r.close()
        self.sync.close()
        self.fleet.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    eng = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine"), *ENGINE_ARGS, timeout_s=180)
    yield eng
    eng.stop()


@pytest.fixture
def parts(tiny_model_dir: Path, engine: EngineProcess) -> Iterator[Parts]:
    p = Parts(tiny_model_dir, [engine.url])
    p.publisher.publish(0)  # a test before may have pushed other versions (always the same weights)
    yield p
    p.close()


def until(condition: Any, what: str, limit_s: float = 60.0) -> None:
    """Wait for `condition` (a deadlock guard, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {what} within {limit_s:.0f} s")
        time.sleep(0.01)


def never_interrupted() -> bool:
    return False


def trained_positions(rollout: AsyncRollout) -> dict[int, int]:
    return {p: e.step for p, e in rollout.ledger.entries.items() if e.status == "trained"}  # type: ignore[misc]


def test_a_full_buffer_stops_submission_and_drops_nothing(parts: Parts) -> None:
    rollout = parts.make(inflight=2, capacity=2)
    rollout.start()
    until(lambda: rollout.buffer.blocked_s > 0 and len(rollout.buffer) == 2, "the producer blocked on a full buffer")
    drawn = rollout.next_position
    # Full: the producer holds at most one finished group per in-flight slot and draws nothing new.
    assert drawn <= 2 + 2
    for step in range(4):
        groups = rollout.collect(step, interrupted=never_interrupted)
        assert groups is not None and len(groups) == 2
        rollout.commit(step)
    metrics = rollout.pop_metrics()
    assert (
        metrics["buffer/dropped_aborted"] == metrics["buffer/dropped_filtered"] == metrics["buffer/dropped_stale"] == 0
    )
    assert metrics["buffer/producer_blocked_s"] > 0
    rollout.stop()
    counts = rollout.ledger.counts()
    assert counts["trained"] == 8 and counts["dropped"] == 0
    assert len(rollout.ledger.entries) == rollout.next_position  # every drawn position is accounted for


def test_the_producer_draws_no_prompt_the_steps_left_cannot_train(parts: Parts) -> None:
    """With room for 1000 groups in flight and 3 steps of 2 prompts, the producer draws the 6 prompts the run
    trains and no more: at the end nothing drawn is left untrained."""
    rollout = parts.make(inflight=1000, capacity=1000, num_steps=3)
    rollout.start()
    until(lambda: len(rollout.buffer) == 6, "the run's 6 groups")
    time.sleep(0.5)  # what an unbounded producer would spend drawing hundreds more
    assert rollout.next_position == 6, "it drew more than the 3 steps can train"
    for step in range(3):
        groups = rollout.collect(step, interrupted=never_interrupted)
        assert groups is not None and len(groups) == 2
        rollout.commit(step)
    ledger = rollout.finish()
    counts = rollout.ledger.counts()
    assert counts["trained"] == 6 and counts["dropped"] == 0, counts
    assert "run_ended" not in {e.reason for e in rollout.ledger.entries.values()}
    # The data cursor is the number of prompts consumed: a run continued from here would miss none.
    assert ledger["next_position"] == 6
    assert ledger_problems(ledger, num_drawn=ledger["next_position"], prompts_per_step=2) == []


def test_each_drop_reason_is_counted_and_retry_regenerates(parts: Parts) -> None:
    # aborted: abort every request in flight (long answers keep them in flight)
    rollout = parts.make(inflight=2, capacity=8, max_new_tokens=200)
    rollout.start()
    until(lambda: len(rollout._calls) == 2, "two groups in flight")

    def aborted_after_abort_all() -> bool:
        # A call counts as in flight before its request reaches the engine's queue, so one abort can land on an
        # empty engine (CI saw it): abort again until a group comes back aborted.
        parts.clients[0].abort_request(abort_all=True)
        time.sleep(0.1)
        return rollout._counts["aborted"] >= 1

    until(aborted_after_abort_all, "an aborted group")
    rollout.stop()
    assert any(e.reason == "aborted" for e in rollout.ledger.entries.values())
    assert rollout.pop_metrics()["buffer/dropped_aborted"] >= 1

    # filtered: the untrained tiny model never answers right, so every group has all rewards 0
    rollout = parts.make(filter="zero_std")
    rollout.start()
    until(lambda: rollout._counts["filtered"] >= 3, "three filtered groups")
    rollout.stop()
    assert len(rollout.buffer) == 0 and rollout.pop_metrics()["buffer/dropped_filtered"] >= 3
    assert {e.reason for e in rollout.ledger.entries.values() if e.status == "dropped"} == {"filtered"}

    # stale, with retry: groups of version 0 are too old for step 1 with max_staleness 0. The producer submits
    # only step 0's two (more would be too stale for it to submit); the trainer then skips to step 1.
    rollout = parts.make(max_staleness=0, on_drop="retry", capacity=4)
    rollout.start()
    until(lambda: len(rollout.buffer) == 2, "step 0's version-0 groups")
    rollout.publish(1)
    groups = rollout.collect(1, interrupted=never_interrupted)
    assert groups is not None
    metrics = rollout.pop_metrics()
    assert metrics["buffer/dropped_stale"] >= 2 and metrics["buffer/staleness_max"] == 0
    assert all(v == 1 for g in groups for s in g.samples for v in s.weight_versions)
    rollout.commit(1)
    rollout.publish(2)  # (without it, step 2 could train no group the producer submits)
    # The stale prompts go again, from scratch, under the new weights (step 1 may already have trained them).
    until(lambda: any(e.drops == ["stale"] and e.status in ("buffered", "trained")
                      for e in rollout.ledger.entries.values()), "a stale prompt regenerated")  # fmt: skip
    rollout.stop()
    retried = [e for e in rollout.ledger.entries.values() if e.drops == ["stale"]]
    assert retried and all(e.attempts == 2 for e in retried)


def test_dynamic_sampling_drops_equal_groups_and_stops_a_step_past_its_cap(parts: Parts) -> None:
    from hpcrl.rollout.dynamic import DynamicSamplingError

    # The untrained tiny model never answers right: every group's rewards are all 0, so every group is dropped,
    # and step 0 stops once more than (2 - 1) x 2 prompts were drawn for it in vain.
    rollout = parts.make(sampling={"dynamic_sampling": True, "dynamic_sampling_max_batches": 2})
    rollout.start()
    with pytest.raises(DynamicSamplingError, match="drew 2 x 2 prompts for step 0 and found only 0 groups"):
        rollout.collect(0, interrupted=never_interrupted)
    rollout.stop()
    assert rollout.pop_metrics()["rollout/dynamic_dropped_groups"] >= 3
    assert {e.reason for e in rollout.ledger.entries.values() if e.status == "dropped"} == {"equal_rewards"}


def train_slowly(rollout: AsyncRollout, steps: int, train_s: float, limit_s: float = 60.0) -> dict[str, float]:
    """The driver's loop with a trainer slower than generation; the buffer figures summed over the steps (the
    staleness of the trained groups: its largest)."""
    totals: dict[str, float] = {}
    for step in range(steps):
        deadline = time.monotonic() + limit_s  # a deadlock guard: collect() gives up (None) past it
        groups = rollout.collect(step, interrupted=lambda: time.monotonic() > deadline)  # noqa: B023 - used at once
        assert groups is not None, f"step {step} was never collected: deadlock"
        time.sleep(train_s)
        rollout.commit(step)
        rollout.publish(step + 1)
        for key, value in rollout.pop_metrics().items():
            totals[key] = (
                max(totals.get(key, 0.0), value) if key == "buffer/staleness_max" else totals.get(key, 0.0) + value
            )
    return totals


def test_a_group_that_would_be_too_stale_is_not_submitted(parts: Parts, monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 groups buffered and 4 in flight are 4 steps of 2 groups ahead of the trainer: with the producer
    # submitting whenever it has room, groups wait 3-4 steps and max_staleness 1 drops most of them.
    def run(hold: bool) -> tuple[dict[str, float], dict[str, Any]]:
        rollout = parts.make(inflight=4, capacity=4, max_staleness=1)
        if not hold:  # the rule switched off on this object only: the behaviour before it, for comparison
            monkeypatch.setattr(rollout, "_held_for_staleness", lambda: False)
        rollout.start()
        totals = train_slowly(rollout, steps=8, train_s=0.3)
        ledger = rollout.finish()
        assert ledger_problems(ledger, num_drawn=ledger["next_position"], prompts_per_step=2) == []
        assert sorted(trained_positions(rollout).values()) == sorted(2 * list(range(8)))
        return totals, ledger

    before, _ = run(hold=False)
    after, ledger = run(hold=True)
    print("dropped stale without the rule, with it:", before["buffer/dropped_stale"], after["buffer/dropped_stale"])
    assert before["buffer/dropped_stale"] >= 4 and before["buffer/producer_stale_wait_s"] == 0
    assert after["buffer/dropped_stale"] < before["buffer/dropped_stale"] / 4
    assert after["buffer/staleness_max"] == 1 and after["buffer/producer_stale_wait_s"] > 0
    # Every drawn prompt was trained once or dropped with a reason; run_ended only for what was left at the end.
    reasons = {r for r, status in zip(ledger["reason"], ledger["status"], strict=True) if status == "dropped"}
    assert reasons <= {"stale", "run_ended"}


def test_max_staleness_0_with_a_one_step_buffer_never_deadlocks(parts: Parts) -> None:
    # The tightest setting: the producer may submit only what the step collecting now can take, and only
    # under the weights that step trains. It holds between a step's commit and its push, and never longer.
    rollout = parts.make(inflight=4, capacity=2, max_staleness=0)
    rollout.start()
    totals = train_slowly(rollout, steps=10, train_s=0.05, limit_s=30.0)
    ledger = rollout.finish()
    assert totals["buffer/dropped_stale"] == 0 and totals["buffer/staleness_max"] == 0
    assert totals["buffer/producer_stale_wait_s"] > 0
    assert ledger_problems(ledger, num_drawn=ledger["next_position"], prompts_per_step=2) == []
    assert len(trained_positions(rollout)) == 20


def test_the_submission_bound_at_its_edge(parts: Parts) -> None:
    # prompts_per_step 2, max_staleness 1, the engines serving version 0, the trainer about to collect step 0.
    rollout = parts.make(prompts_per_step=2, capacity=8, max_staleness=1)
    assert parts.publisher.version == 0

    def held_with(buffered: int) -> bool:
        rollout.buffer._items.clear()
        rollout.buffer.restore([BufferedGroup(p, 0, Group(example=None), 0) for p in range(buffered)])  # type: ignore[arg-type]
        return rollout._held_for_staleness()

    # 2 groups ahead: the new one is trained at step 1, staleness exactly 1: admitted. 4 ahead: step 2, held.
    assert [held_with(n) for n in range(6)] == [False, False, False, False, True, True]
    rollout._next_step = 1  # step 0 committed: the new group is a step later for the same groups ahead
    assert [held_with(n) for n in range(4)] == [False, False, True, True]

    bound = {"prompts_per_step": 2, "max_staleness": 1}
    assert earliest_step(5, 0, [], 0, **bound) == 5
    assert earliest_step(5, 1, [], 0, **bound) == 5  # one slot of step 5 left
    assert earliest_step(5, 2, [], 0, **bound) == 6  # step 5 is full (training): the next one
    assert earliest_step(5, 1, [5], 0, **bound) == 6
    assert earliest_step(5, 1, [], 1, **bound) == 6  # the group in flight is counted ahead
    # A buffered group that is stale where collect() reaches it is dropped there and takes no place.
    assert earliest_step(5, 0, [3, 5], 0, **bound) == 5
    assert earliest_step(5, 0, [4, 5], 0, **bound) == 6
    assert earliest_step(5, 0, [5, 5, 4], 0, **bound) == 6  # 4 is 2 behind step 6: dropped
    assert earliest_step(5, 0, [None, None], 0, **bound) == 6  # no known version: it is kept


def _result(n: int, spans: list[tuple[str, int, int]] | None, version: str = "9") -> GenerateResult:
    return GenerateResult(
        text="", rid="r", output_ids=list(range(n)), finish_reason=FinishReason(type="length"), weight_version=version,
        weight_versions=None if spans is None else [WeightVersionSpan(version=v, start=s, end=e) for v, s, e in spans],
    )  # fmt: skip


def test_staleness_is_the_oldest_token_version_of_the_group() -> None:
    # Checkpoints written while versions were strings: digits, the warm start's "sft" and SGLang's "default" (the
    # weights an engine loaded) read as ints; another label is outside the run's order.
    assert [stored_version(v) for v in (0, 7, "0", "7", "sft", "default", "w1", None)] == [0, 7, 0, 7, 0, 0, None, None]
    # Per-token spans: one sample straddles a push from 3 to 4, the other is all 4; submitted under 3.
    url = "http://127.0.0.1:1"
    spans = [_result(5, [("3", 0, 2), ("4", 2, 5)]), _result(4, [("4", 0, 4)])]
    assert oldest_version(spans, 3, url) == 3
    # Queued through a push before its first token: its tokens are all 4, whatever was served at submit.
    assert oldest_version([_result(4, [("4", 0, 4)])], 3, url) == 4
    # One version per request (SGLang reports the server's version when the response is built): read as the
    # version served at submit, which no token of the request predates.
    assert oldest_version([_result(5, None, version="5")], 3, url) == 3
    group = BufferedGroup(0, 0, Group(example=None), oldest_version(spans, 3, url))  # type: ignore[arg-type]
    assert group.staleness(5) == 2
    # An answer whose version is not one: refused, naming the engine and the field.
    with pytest.raises(ValueError, match=rf"engine {url} answered meta_info.weight_versions\[1\].version='w2'"):
        oldest_version([_result(3, [("4", 0, 1), ("w2", 1, 3)])], 3, url)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["rollout.mode=async", "engine.offload_during_train=true"], ["both stages", "offload_during_train=false"]),
        (["rollout.mode=async", "sync.pause_mode=abort"], ["pause_mode=abort", "retract"]),
        (["rollout.mode=async", "buffer.capacity_groups=8"], ["smaller than one step", "capacity_groups >= 32"]),
        (["rollout.mode=async", "buffer.max_staleness=-1"], ["max_staleness must be >= 0", "null"]),
        (
            ["rollout.mode=async", "buffer.max_staleness=1", "sync.every_steps=3"],
            ["could never be collected", "buffer.max_staleness >= 2", "sync.every_steps <= 2"],
        ),
    ],
)
def test_bad_async_configs_are_refused_at_load_with_the_fix(overrides: list[str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_run_config(REPO / "experiments" / "quickstart.yaml", overrides)
    for name in names:
        assert name in str(err.value)


def test_async_on_a_shared_device_without_the_rental_is_allowed() -> None:
    cfg = load_run_config(
        REPO / "experiments" / "quickstart.yaml", ["rollout.mode=async", "engine.device=cpu", "train.device=cpu"]
    )
    assert cfg.capacity_groups == 64 and cfg.inflight_groups == 32


def test_async_mode_takes_the_ppo_ratio_against_the_engines_logprobs_unless_told_otherwise() -> None:
    quickstart = REPO / "experiments" / "quickstart.yaml"
    sync = load_run_config(quickstart)
    assert sync.train.old_logprobs == "trainer" and "old_logprobs: trainer" in run_config_yaml(sync)
    with warnings.catch_warnings():
        # The clipped ratio against the engine is a correction: no off-policy warning.
        warnings.filterwarnings("error", message="rollout.mode=async without an off-policy correction")
        default = load_run_config(quickstart, ["rollout.mode=async"])
        tis = load_run_config(quickstart, ["rollout.mode=async", "train.off_policy_correction=tis"])
    assert default.train.old_logprobs == "rollout" and "old_logprobs: rollout" in run_config_yaml(default)
    assert tis.train.old_logprobs == "trainer"  # TIS weighs by trainer / engine: it needs the trainer's
    with pytest.warns(UserWarning, match="train.old_logprobs=rollout"):
        explicit = load_run_config(quickstart, ["rollout.mode=async", "train.old_logprobs=trainer"])
    assert explicit.train.old_logprobs == "trainer"


def test_the_async_quickstart_is_the_quickstarts_task() -> None:
    sync = load_run_config(REPO / "experiments" / "quickstart.yaml")
    cfg = load_run_config(REPO / "experiments" / "async-quickstart.yaml")
    assert cfg.rollout.mode == "async" and cfg.buffer.max_staleness == 2 and cfg.train.old_logprobs == "rollout"
    for section in ("seed", "num_steps", "model", "data", "sft", "reward", "engine", "checkpoint"):
        assert getattr(cfg, section) == getattr(sync, section), section
    assert replace(cfg.rollout, mode="sync") == sync.rollout
    assert replace(cfg.train, old_logprobs="trainer") == sync.train


def test_checkpoint_mid_flight_and_resume_trains_every_position_exactly_once(parts: Parts) -> None:
    first = parts.make(inflight=3, capacity=4)
    first.start()
    trained: dict[int, list[int]] = {}
    for step in range(2):
        groups = first.collect(step, interrupted=never_interrupted)
        assert groups is not None
        first.commit(step)
    tensors, state = first.state_dict()  # the checkpoint of step 1, taken while groups are in flight
    assert state["pending"], "the checkpoint should hold prompts in flight"
    saved_groups = {g["position"] for g in state["groups"]}
    for p, s in trained_positions(first).items():
        trained.setdefault(p, []).append(s)
    # The job goes on past the checkpoint, then is preempted: its later work is lost with it.
    after: dict[int, list[int]] = {}
    groups = first.collect(2, interrupted=never_interrupted)
    assert groups is not None
    for item in first._taken:
        after[item.position] = item.group.samples[0].output_ids
    first.stop()

    state = json.loads(json.dumps(state))  # what the checkpoint's JSON holds
    second = parts.make(inflight=3, capacity=4)
    second.load_state_dict({k: v.clone() for k, v in tensors.items()}, state, step=1)
    restored = {item.position: item for item in second.buffer}
    assert set(restored) == saved_groups
    second.start()
    regenerated: dict[int, list[int]] = {}
    for step in range(2, 6):
        groups = second.collect(step, interrupted=never_interrupted)
        assert groups is not None
        for item in second._taken:
            regenerated[item.position] = item.group.samples[0].output_ids
        second.commit(step)
    for p, s in trained_positions(second).items():
        if s >= 2:
            trained.setdefault(p, []).append(s)
    ledger = second.finish()
    assert all(len(steps) == 1 for steps in trained.values()), trained
    assert sorted(p for p, e in second.ledger.entries.items() if e.status == "trained") == sorted(trained)
    assert ledger_problems(ledger, num_drawn=ledger["next_position"], prompts_per_step=2) == []
    # Same weights and the same seeds: a prompt the lost job generated comes out the same when re-issued.
    common = [p for p in after if p in regenerated]
    assert common and all(after[p] == regenerated[p] for p in common)


def test_supports_travel_through_the_buffer_and_its_checkpoint(parts: Parts) -> None:
    # top-k/top-p in async mode: the producer asks for the supports, the samples carry them (log-probs
    # renormalised over them), and a checkpointed buffer gives them back ragged and unchanged.
    first = parts.make(inflight=2, capacity=4, sampling={"top_k": 8, "top_p": 0.9})
    first.start()
    groups = first.collect(0, interrupted=never_interrupted)
    assert groups is not None
    for s in (s for g in groups for s in g.samples):
        assert s.supports is not None and s.supports.num_tokens == len(s.output_ids)
        assert 1 <= s.supports.sizes().min() and s.supports.sizes().max() <= 8
    until(lambda: len(first.buffer) >= 1, "a buffered group")
    first.stop()
    tensors, state = first.state_dict()
    assert tensors["rollout_buffer/support_ids"].dtype == torch.int32  # ragged ids, never [tokens x vocab]
    saved = [s.supports for item in [*first._taken, *first.buffer] for s in item.group.samples]
    second = parts.make(inflight=2, capacity=4, sampling={"top_k": 8, "top_p": 0.9})
    second.load_state_dict({k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(state)), step=0)
    assert [s.supports for item in second.buffer for s in item.group.samples] == saved


def test_routed_experts_travel_through_the_buffer_checkpoint(parts: Parts) -> None:
    # Routing replay: each sample's routes [prompt + output - 1, layers, top-k] come back from a checkpoint unchanged.
    first = parts.make(inflight=2, capacity=4)
    first.start()
    until(lambda: len(first.buffer) >= 2, "two buffered groups")
    first.stop()
    samples = [s for item in first.buffer for s in item.group.samples]
    for i, s in enumerate(samples[1:]):  # the first sample carries none (a multi-turn one, say)
        s.routed_experts = np.full((len(s.prompt_ids) + len(s.output_ids) - 1, 3, 2), i, dtype=np.int32)
    tensors, state = first.state_dict()
    second = parts.make(inflight=2, capacity=4)
    second.load_state_dict({k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(state)), step=0)
    back = [s.routed_experts for item in second.buffer for s in item.group.samples]
    assert back[0] is None
    for want, got in zip([s.routed_experts for s in samples[1:]], back[1:], strict=True):
        assert got is not None and want is not None and np.array_equal(got, want)


def test_pause_and_push_50_times_with_hundreds_of_requests_in_flight(parts: Parts) -> None:
    rollout = parts.make(n=8, inflight=40, capacity=10_000, max_new_tokens=24, prompts_per_step=8)
    rollout.start()
    seen_in_flight = 0
    for version in range(1, 51):
        until(lambda: len(rollout._calls) >= 30, "30 groups in flight")
        seen_in_flight = max(seen_in_flight, 8 * len(rollout._calls))
        done = threading.Event()

        def push(v: int = version, done: threading.Event = done) -> None:
            rollout.publish(v)
            done.set()

        threading.Thread(target=push, daemon=True).start()
        assert done.wait(60), f"push {version} did not return: deadlock"
        assert parts.clients[0].weight_version() == version
    assert seen_in_flight >= 240
    groups = rollout.collect(50, interrupted=never_interrupted)
    rollout.stop()
    assert groups is not None
    metrics = rollout.pop_metrics()
    assert metrics["buffer/dropped_aborted"] == 0  # a push never aborts a request
    assert all(s.finish in ("stop", "length") for g in groups for s in g.samples)
    straddling = [s for g in rollout.buffer for s in g.group.samples if len(set(s.weight_versions)) > 1]
    assert straddling, "requests in flight across a push carry both versions"


def test_an_engine_death_reissues_its_groups(tiny_model_dir: Path, engine: EngineProcess, engine_factory: Any) -> None:
    engines = [engine, engine_factory(*ENGINE_ARGS)]
    parts = Parts(tiny_model_dir, [e.url for e in engines])
    try:
        # Room for every group: a producer waiting for room would leave no call open on engine 1 to kill it under.
        rollout = parts.make(inflight=4, capacity=10_000, max_new_tokens=64)
        rollout.start()
        # Kill engine 1 while it holds a group: freeze it first, then make sure a call to it is still open (a fast
        # engine can answer between a look at the calls and the kill, and the death would then go unseen). A call
        # still listed is not enough: its answer may have arrived while the producer waits for room in the buffer.
        victim = engines[1].proc

        def open_on_victim() -> bool:
            return any(c.slot.index == 1 and not fut.done() for fut, c in list(rollout._calls.items()))

        while True:
            until(open_on_victim, "a group on engine 1")
            victim.send_signal(signal.SIGSTOP)
            time.sleep(0.3)  # an answer already on its way is read and its call's future completed by now
            if open_on_victim():
                break
            victim.send_signal(signal.SIGCONT)
        victim.kill()
        # The producer sees the open call fail, marks the engine dead and re-sends the group to engine 0.
        until(lambda: any(kind == "engine_dead" for kind, _ in parts.events), "the engine marked dead")
        for step in range(2):
            groups = rollout.collect(step, interrupted=never_interrupted)
            assert groups is not None and all(s.finish != "abort" for g in groups for s in g.samples)
            rollout.commit(step)
        rollout.stop()
        assert parts.fleet.pop_metrics()["fleet/reissued_requests"] >= 4
        assert rollout.ledger.counts()["dropped"] == 0
    finally:
        parts.close()


BUFFER_METRICS = [
    f"buffer/{name}"
    for name in (
        "queue_groups", "inflight_groups", "staleness_mean", "staleness_max", "waiting_staleness_max",
        "dropped_aborted", "dropped_filtered", "dropped_stale", "mixed_version_token_share", "trainer_wait_s",
        "producer_blocked_s", "producer_stale_wait_s",
    )
]  # fmt: skip


def checkpoint_versions(state: dict[str, Any]) -> list[Any]:
    """Every weight version a checkpoint's state holds: the engines' and each buffered token's."""
    tokens = [v for g in state["rollout_buffer"]["groups"] for s in g["samples"] for v, _ in s["versions"]]
    return [state["weights"]["version"], *tokens]


def write_versions_as_strings(path: Path) -> None:
    """Rewrite a checkpoint's weight versions as hpcrl wrote them before they were ints: digits, and "sft" for the
    warm start's weights (version 0)."""
    import h5py

    def label(v: int | None) -> str | None:
        return None if v is None else "sft" if v == 0 else str(v)

    with h5py.File(path, "r+") as f:
        state = json.loads(f.attrs["state_json"])
        state["weights"]["version"] = label(state["weights"]["version"])
        for s in (s for g in state["rollout_buffer"]["groups"] for s in g["samples"]):
            s["versions"] = [[label(v), n] for v, n in s["versions"]]
        f.attrs["state_json"] = json.dumps(state)


def test_quickstart_in_async_mode_survives_sigterm_and_every_prompt_is_accounted_for(workdir: Path) -> None:
    from hpcrl.store.checkpoint import list_checkpoints, load_checkpoint

    args = [*SMALL, "rollout.mode=async", "buffer.max_staleness=2"]
    proc = signal_at_step(workdir, args, "r", 3, signal.SIGTERM)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, rest
    # Weight versions are ints in the checkpoint (the engines' and every buffered token's) ...
    (preempted,) = list_checkpoints(workdir / "r" / "checkpoints")[-1:]
    versions = checkpoint_versions(load_checkpoint(preempted).state)
    assert len(versions) > 1 and all(isinstance(v, int) for v in versions), versions
    # ... and a checkpoint written while they were strings resumes all the same.
    write_versions_as_strings(preempted)
    assert any(isinstance(v, str) for v in checkpoint_versions(load_checkpoint(preempted).state))
    out = hpcrl("run", "qs.yaml", *args, "--run-dir", "r", cwd=workdir)
    assert "resumed from" in out.stdout and "step    6/6" in out.stdout
    metrics = load_metrics(workdir / "r" / "metrics.h5")
    assert list(metrics["step"]) == list(range(6))
    # The push after step s is version s + 1 (0: the weights before any GRPO step, the warm start's too).
    assert list(metrics["sync/weight_version"]) == [s + 1 for s in range(6)]
    state = load_checkpoint(list_checkpoints(workdir / "r" / "checkpoints")[-1]).state
    assert state["weights"]["version"] == 6
    assert all(isinstance(v, int) for v in checkpoint_versions(state))
    for key in BUFFER_METRICS:
        assert key in metrics and not np.isnan(metrics[key]).any(), key
    assert metrics["buffer/staleness_max"].max() <= 2
    ledger = json.loads((workdir / "r" / "prompt_ledger.json").read_text())
    assert ledger_problems(ledger, num_drawn=ledger["next_position"], prompts_per_step=4) == []
    trained_steps = sorted({s for s in ledger["step"] if s is not None})
    assert trained_steps == list(range(6))


def test_a_run_with_1000_groups_allowed_in_flight_ends_with_every_drawn_prompt_trained(workdir: Path) -> None:
    args = [*SMALL, "num_steps=4", "sft.num_steps=0", "rollout.mode=async", "buffer.max_inflight_groups=1000"]
    hpcrl("run", "qs.yaml", *args, "--run-dir", "r", cwd=workdir)
    ledger = json.loads((workdir / "r" / "prompt_ledger.json").read_text())
    assert ledger_problems(ledger, num_drawn=ledger["next_position"], prompts_per_step=4) == []
    # 4 steps of 4 prompts: 16 drawn, 16 trained; none drawn only to be dropped when the run ended.
    assert ledger["next_position"] == 16 and ledger["status"].count("trained") == 16, ledger
    assert "run_ended" not in ledger["reason"]


def test_with_no_engine_left_the_trainers_thread_restarts_them(
    parts: Parts, tiny_model_dir: Path, tmp_path: Path
) -> None:
    lone = start_engine(tiny_model_dir, tmp_path, *ENGINE_ARGS, timeout_s=180)
    fresh: list[EngineProcess] = []
    try:
        parts.fleet.slots[0].client = EngineClient(lone.url)
        rollout = parts.make(inflight=2, capacity=4, max_new_tokens=64)
        threads: list[str] = []

        def restore_engines() -> None:  # what the publisher does with a launcher: restart, push, then serve
            threads.append(threading.current_thread().name)
            fresh.append(start_engine(tiny_model_dir, tmp_path, *ENGINE_ARGS, timeout_s=180))
            slot = parts.fleet.slots[0]
            slot.client, slot.state = EngineClient(fresh[0].url), "live"

        rollout.publisher = type("P", (), {"version": "0", "restore_engines": staticmethod(restore_engines)})()
        rollout.start()
        until(lambda: len(rollout._calls) == 2, "two groups in flight")
        lone.proc.kill()
        groups = rollout.collect(0, interrupted=never_interrupted)
        rollout.stop()
        assert groups is not None and len(groups) == 2
        assert threads == [threading.current_thread().name]  # the push ran where the trainer would, once
        assert rollout.ledger.counts()["dropped"] == 0
    finally:
        lone.stop()
        for eng in fresh:
            eng.stop()


FILTERS = """
import torch


def raising(group):
    raise KeyError("no such field")


def none(group):
    return None


def tensor(group):
    return torch.tensor([True])


def text(group):
    return "yes"
"""


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("raising", "raised KeyError: 'no such field'"),
        ("none", "returned NoneType None, not a bool"),
        ("tensor", "returned Tensor tensor([True]), not a bool"),
        ("text", "returned str 'yes', not a bool"),
    ],
)
def test_a_filter_that_raises_or_returns_no_bool_stops_the_run_naming_its_key(
    parts: Parts, tmp_path: Path, name: str, expected: str
) -> None:
    (tmp_path / "my_filters.py").write_text(FILTERS)
    spec = f"{tmp_path / 'my_filters.py'}:{name}"
    rollout = parts.make(filter=spec)
    rollout.start()
    with pytest.raises(ValueError) as info:
        rollout.collect(0, interrupted=never_interrupted)
    rollout.stop()
    message = str(info.value)
    assert f"buffer.filter={spec}" in message and expected in message, message
    assert rollout._counts["filtered"] == 0  # nothing was counted as kept or dropped by a verdict it never gave
    assert len(rollout.buffer) == 0
