"""The asynchronous rollout: a producer thread keeps whole groups generating on the live engines while the
trainer trains, and the trainer collects each step's batch from the group buffer (docs/async.md). Two roles, two
classes: `GroupProducer` is the producer thread (draw, submit, hold, arrive); `AsyncRollout` adds the trainer's
side (collect, publish, checkpoint) and is what the driver holds.

- Draw: prompts by global position of the data order (PromptSource.at); re-issued and retried ones first.
- Submit: at most `max_inflight_groups` groups, one request batch per group, to the live engine with the
  fewest groups in flight. Seeds: those the synchronous loop would give the position (step = position //
  prompts_per_step), with the sample index moved past n per retry attempt; a re-issued group (engine death,
  resume) repeats its seeds exactly.
- Hold: submit nothing while a group submitted now would reach the trainer staler than `max_staleness`
  (`earliest_step`); wait for a push or for the trainer to move. It cannot deadlock (`_held_for_staleness`).
- Arrive: score with the reward, judge (aborted, reward failed, filter), then `put` into the buffer, waiting
  while it is full: a full buffer stops new submissions (backpressure).
- Collect (the trainer): take groups oldest first, dropping those staler than `max_staleness`.
- Publish: the driver pushes weights through `publish()`; requests stay in flight. With no engine live the
  producer waits, and the trainer's thread restarts them (`publisher.restore_engines`) in `collect()`: a
  push reads the trainer's weights, so it never runs while the trainer trains, nor beside another push.
- Checkpoint (the state part "rollout_buffer"): the buffered groups as tensors (token ids, log-probs) and
  JSON (rewards, finish, per-token version spans), the positions pending, the next position and the ledger.
  A resume restores the buffer, re-issues the pending positions with the same seeds, and draws on after.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from hpcrl.engine.client import EngineClient
from hpcrl.engine.errors import EngineRequestError
from hpcrl.engine.fleet import EngineFleet, EngineSlot
from hpcrl.engine.protocol.answers import GenerateResult
from hpcrl.engine.protocol.requests import SamplingParams
from hpcrl.engine.supports import checked_supports
from hpcrl.engine.versions import token_weight_versions
from hpcrl.rollout.buffer import BufferedGroup, GroupBuffer, arrival_verdict, load_filter
from hpcrl.rollout.config import BufferConfig, RolloutConfig
from hpcrl.rollout.data import PromptSource
from hpcrl.rollout.dynamic import DynamicSamplingError, cap_message
from hpcrl.rollout.generate import PromptFormatter, sample_of
from hpcrl.rollout.ledger import PromptLedger
from hpcrl.rollout.scoring import RewardScorer
from hpcrl.samples.sample import Group, Sample, sample_seed
from hpcrl.samples.support import TokenSupports
from hpcrl.samples.versions import stored_version

MAX_ATTEMPTS = 3  # buffer.on_drop=retry: a prompt is generated at most this often, then dropped
_STATE_VERSION = 1
_DROP_COUNTERS = {
    "aborted": "aborted", "reward_failed": "aborted", "filtered": "filtered", "stale": "stale",
    "equal_rewards": "equal_rewards",
}  # fmt: skip


class Publisher(Protocol):
    version: int

    def publish(self, version: int) -> dict[str, float]: ...

    def restore_engines(self) -> None: ...


@dataclass
class _Call:
    slot: EngineSlot
    client: EngineClient  # the slot's engine when the call was sent: a restart gives the slot a new one
    position: int
    attempt: int
    submit_version: int
    prompt: list[int]


class GroupProducer:
    """The producer thread's role: draw positions, submit their groups, hold for staleness, take arrivals into the
    buffer (or drop them), re-issue a dead engine's groups. The state it keeps (positions pending, the buffer, the
    ledger) is what the trainer's side (`AsyncRollout`) collects from and checkpoints."""

    def __init__(
        self,
        rollout: RolloutConfig,
        buffer: BufferConfig,
        fleet: EngineFleet,
        formatter: PromptFormatter,
        data: PromptSource,
        scorer: RewardScorer,
        publisher: Publisher,
        *,
        seed: int,
        prompts_per_step: int,
        max_inflight_groups: int,
        capacity_groups: int,
        num_steps: int | None = None,
        poll_s: float = 0.05,
        routes_shape: tuple[int, int] | None = None,
    ) -> None:
        """`num_steps`: the steps of the run (None: no end); the producer draws no prompt those steps cannot train."""
        self.cfg, self.buffer_cfg = rollout, buffer
        self.routes_shape = routes_shape  # (layers, top-k): ask for and keep routed experts (as Rollout does)
        self.fleet, self.formatter, self.data, self.scorer, self.publisher = fleet, formatter, data, scorer, publisher
        self.seed, self.prompts_per_step, self.max_inflight = seed, prompts_per_step, max_inflight_groups
        self.poll_s, self.num_steps = poll_s, num_steps
        self.keep = load_filter(buffer.filter)
        self._lock = threading.RLock()
        self.buffer = GroupBuffer(capacity_groups, self._lock)
        self.ledger = PromptLedger()
        self.next_position = 0
        self._pending: dict[int, int] = {}  # drawn, not yet buffered nor final: position -> attempt
        self._queue: deque[int] = deque()  # of _pending: to (re)submit before drawing new positions
        self._taken: list[BufferedGroup] = []  # collected by the step being trained, not yet committed
        self._calls: dict[Future[list[GenerateResult]], _Call] = {}
        self._publish_lock = threading.Lock()  # one push at a time: the driver's or the producer's recovery
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._need_engines = False  # no engine is live: collect() restarts them (the trainer is idle there)
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=max_inflight_groups, thread_name_prefix="hpcrl-async")
        self.trainer_step = 0  # the step being collected or trained (the reward's stop event names it)
        self._next_step = 0  # the lowest step that still takes groups: _taken's step until it commits
        self._stale_wait_s = 0.0  # time submission was held for staleness, since the last pop_metrics
        self._held_since: float | None = None
        self._wake: Future[None] = Future()  # set when a held submission may go: a push, a commit, a stop
        self._counts = dict.fromkeys(("aborted", "filtered", "stale", "equal_rewards"), 0)
        self._step_metrics: dict[str, float] = {}
        self._saved_ledger: dict[str, Any] | None = None

    # ----- the producer thread -----
    def start(self) -> None:
        assert self._thread is None, "the producer is already running"
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="hpcrl-producer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop submitting and stop waiting; requests still running on the engines are left to finish there."""
        self._stop.set()
        self._nudge()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            if self._held_since is not None:
                self._stale_wait_s += time.perf_counter() - self._held_since
                self._held_since = None
            for call in self._calls.values():
                if call.position in self._pending and call.position not in self._queue:
                    self._queue.append(call.position)
            self._calls.clear()

    def close(self) -> None:
        self.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:  # before _fill looks: a nudge from here on ends the wait that follows it
                    if self._wake.done():
                        self._wake = Future()
                self._fill()
                self._wait_some()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's collect(), which raises it
            self._error = exc
            with self.buffer.cond:
                self.buffer.cond.notify_all()

    def _fill(self) -> None:
        while len(self._calls) < self.max_inflight and not self._stop.is_set():
            live = self.fleet.live()
            if not live:
                # The restart push reads the trainer's weights: it runs on the trainer's thread, in collect().
                self._need_engines = True
                return
            with self._lock:
                if self._held_for_staleness():
                    return
                if self._queue:
                    position = self._queue.popleft()
                elif not self._draws_more():
                    return
                else:
                    position = self.next_position
                    self.next_position += 1
                    self._pending[position] = 0
                    self.ledger.drawn(position)
                attempt = self._pending[position]
            busy = {id(s): 0 for s in live}
            for call in self._calls.values():
                if id(call.slot) in busy:
                    busy[id(call.slot)] += 1
            slot = min(live, key=lambda s: (busy[id(s)], s.index))
            # The tokenizer is used on this thread only (a fast tokenizer is not safe across threads).
            prompt = self.formatter.encode(self.data.at(position).prompt)
            call = _Call(slot, slot.client, position, attempt, self.publisher.version, prompt)
            self._calls[self._pool.submit(self._generate, call)] = call

    def _held_for_staleness(self) -> bool:
        """Whether a group submitted now would be dropped as stale when the trainer reaches it (holding the lock).

        Its tokens come from the version served now or a later one, and it arrives behind every group buffered
        now; the groups in flight are counted ahead of it too (they were submitted first). Holding is safe from
        deadlock: while the trainer waits in collect() the buffer is empty and fewer than prompts_per_step groups
        are taken, so only groups in flight can push the bound past max_staleness, and each of them arrives or
        is re-issued (leaving the count) until one is admitted (docs/async.md, "Staleness-aware submission")."""
        max_staleness = self.buffer_cfg.max_staleness
        served = self.publisher.version
        held = False
        if max_staleness is not None:
            step = earliest_step(
                self._next_step, len(self._taken), (g.oldest_version for g in self.buffer), len(self._calls),
                prompts_per_step=self.prompts_per_step, max_staleness=max_staleness,
            )  # fmt: skip
            held = step - served > max_staleness
        now = time.perf_counter()
        if held and self._held_since is None:
            self._held_since = now
        elif not held and self._held_since is not None:
            self._stale_wait_s += now - self._held_since
            self._held_since = None
        return held

    def _draws_more(self) -> bool:
        """Whether the steps left can train one more prompt (holding the lock). Every prompt drawn and not yet
        trained or dropped (in flight, queued, buffered, taken) will fill a place of those steps: one drawn beyond
        them would end the run untrained, however many groups `max_inflight_groups` allows in flight. A drop
        frees its place, so a dropped prompt is replaced by a new one."""
        if self.num_steps is None:
            return True
        places = (self.num_steps - self._next_step) * self.prompts_per_step
        return len(self._pending) + len(self.buffer) + len(self._taken) < places

    def _nudge(self) -> None:
        """Wake the producer now rather than at its next poll: what held a submission may have changed."""
        with self._lock:
            if not self._wake.done():
                self._wake.set_result(None)

    def _generate(self, call: _Call) -> list[GenerateResult]:
        n = self.cfg.n_samples_per_prompt
        step, index = divmod(call.position, self.prompts_per_step)
        params = [
            SamplingParams(
                max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                top_k=self.cfg.top_k, sampling_seed=sample_seed(self.seed, step, index, s + call.attempt * n),
            )
            for s in range(n)
        ]  # fmt: skip
        out = call.client.generate(
            [call.prompt] * n, params, return_logprob=True, return_sampling_mask=self.cfg.replays_support,
            rid=[f"pos{call.position}-a{call.attempt}-s{s}" for s in range(n)], timeout_s=self.cfg.request_timeout_s,
            return_routed_experts=self.routes_shape is not None,
        )  # fmt: skip
        return out if isinstance(out, list) else [out]

    def _wait_some(self) -> None:
        wake = self._wake
        futures: list[Future[Any]] = [*self._calls, wake]
        done, _ = wait(futures, timeout=self.poll_s, return_when=FIRST_COMPLETED)
        # In submission order (the dict's), as earliest_step counts the groups in flight ahead of a new one.
        for fut in [f for f in self._calls if f in done]:
            call = self._calls.pop(fut)
            try:
                results = fut.result()
            except EngineRequestError:
                raise  # the engine refused the request itself: re-sending would not help
            except Exception as exc:  # noqa: BLE001 - a dead or unreachable engine
                self.fleet.report_failure(call.slot, exc, client=call.client)
                if call.slot.state == "live" and call.slot.client is call.client:
                    raise
                self._reissue(call)
                continue
            self._arrive(call, results)
            if self._stop.is_set():
                return
        for fut, call in list(self._calls.items()):
            # declared dead by the monitor while we waited, or restarted since: the old process will not answer
            if call.slot.state != "live" or call.slot.client is not call.client:
                del self._calls[fut]
                self._reissue(call)

    def _reissue(self, call: _Call) -> None:
        with self._lock:
            self._queue.appendleft(call.position)
        self.fleet.num_reissued += self.cfg.n_samples_per_prompt

    def _arrive(self, call: _Call, results: Sequence[GenerateResult]) -> None:
        example = self.data.at(call.position)
        prompt = call.prompt
        group = Group(example=example)
        url = call.client.url
        for r in results:
            supports = checked_supports(r, url) if self.cfg.replays_support else None
            group.samples.append(sample_of(r, prompt, self.formatter, supports, url, self.routes_shape))
        if self.scorer.score(self.trainer_step, [group]) is None:  # a preemption signal: leave it pending
            with self._lock:
                self._queue.appendleft(call.position)
            self._stop.set()
            return
        item = BufferedGroup(call.position, call.attempt, group, oldest_version(results, call.submit_version, url))
        reason = arrival_verdict(group, self.keep, dynamic=self.cfg.dynamic_sampling)
        if reason is not None:
            with self._lock:
                self._drop(item, reason)
            return

        def added() -> None:
            self._pending.pop(call.position)
            self.ledger.set(call.position, "buffered")

        if not self.buffer.put(item, self._stop, added):
            with self._lock:
                self._queue.appendleft(call.position)  # stopped while waiting for room: still pending

    def _drop(self, item: BufferedGroup, reason: str) -> None:
        """Record a dropped group (holding the lock); with on_drop=retry its prompt goes again, fresh seeds."""
        self._counts[_DROP_COUNTERS[reason]] += 1
        if self.buffer_cfg.on_drop == "retry" and item.attempt + 1 < MAX_ATTEMPTS:
            self.ledger.retried(item.position, reason)
            self._pending[item.position] = item.attempt + 1
            self._queue.append(item.position)
        else:
            self._pending.pop(item.position, None)
            final = reason if item.attempt == 0 else f"{reason} after {item.attempt + 1} attempts"
            self.ledger.dropped(item.position, final)


class AsyncRollout(GroupProducer):
    """The asynchronous rollout as the driver sees it: the producer beside the trainer, and the trainer's side
    (collect a step's groups, commit them, push weights, the step's buffer figures) and the checkpointed state."""

    # ----- the trainer's side -----
    def collect(self, step: int, *, interrupted: Callable[[], bool]) -> list[Group] | None:
        """The `prompts_per_step` groups step `step` trains on (None: a preemption signal came meanwhile).

        Step s trains the policy of version s (s optimizer steps); a group staler than max_staleness is
        dropped here. Raises what stopped the producer (a reward stop, an engine refusing a request, no
        engine left)."""
        self.trainer_step = step
        max_staleness = self.buffer_cfg.max_staleness
        wait_s = 0.0
        with self.buffer.cond:
            self._next_step = step
            while len(self._taken) < self.prompts_per_step:
                if self._error is not None:
                    raise self._error
                if interrupted():
                    return None
                if self._need_engines:
                    self._restore_engines()
                self._check_dynamic_cap(step)
                item = self.buffer.pop()
                if item is None:
                    t0 = time.perf_counter()
                    self.buffer.cond.wait(self.poll_s)
                    wait_s += time.perf_counter() - t0
                    continue
                staleness = item.staleness(step)
                if max_staleness is not None and staleness is not None and staleness > max_staleness:
                    self._drop(item, "stale")
                else:
                    self._taken.append(item)
            taken = list(self._taken)
            waiting = [s for s in (g.staleness(step) for g in self.buffer) if s is not None]
            self._step_metrics = _consumed_metrics(taken, step) | {
                "buffer/queue_groups": float(len(self.buffer)),
                "buffer/inflight_groups": float(len(self._pending)),
                "buffer/waiting_staleness_max": float(max(waiting)) if waiting else 0.0,
                "buffer/trainer_wait_s": wait_s,
            }
        return [g.group for g in taken]

    def _check_dynamic_cap(self, step: int) -> None:
        """Stop a step whose dynamic sampling dropped its most groups (the counters reset once per step)."""
        pps, max_batches = self.prompts_per_step, self.cfg.dynamic_sampling_max_batches
        if self.cfg.dynamic_sampling and self._counts["equal_rewards"] > (max_batches - 1) * pps:
            raise DynamicSamplingError(cap_message(step, len(self._taken), pps, max_batches))

    def _restore_engines(self) -> None:
        with self._publish_lock:
            if not self.fleet.live():
                self.publisher.restore_engines()  # FleetError when none can be restarted
        self._need_engines = False

    def commit(self, step: int) -> None:
        """The collected groups were trained at `step`."""
        with self._lock:
            for item in self._taken:
                self.ledger.trained(item.position, step)
            self._taken = []
            self._next_step = step + 1
        self._nudge()

    def publish(self, version: int) -> dict[str, float]:
        """Push the trainer's weights as `version` while the producer's requests stay in flight."""
        with self._publish_lock:
            out = self.publisher.publish(version)
        self._nudge()
        return out

    def pop_metrics(self) -> dict[str, float]:
        """This step's buffer figures; the drop counters and the producer's blocked time reset."""
        with self._lock:
            out = self._step_metrics | {f"buffer/dropped_{k}": float(v) for k, v in self._counts.items()}
            out["rollout/dynamic_dropped_groups"] = out.pop("buffer/dropped_equal_rewards")
            out["buffer/producer_blocked_s"] = self.buffer.blocked_s
            if self._held_since is not None:  # still held: this step's share of the wait
                now = time.perf_counter()
                self._stale_wait_s += now - self._held_since
                self._held_since = now
            out["buffer/producer_stale_wait_s"] = self._stale_wait_s
            self._counts = dict.fromkeys(self._counts, 0)
            self.buffer.blocked_s = 0.0
            self._stale_wait_s = 0.0
        return out

    def finish(self) -> dict[str, Any]:
        """At the end of the run: stop, and record what was drawn but never trained as dropped (run_ended)."""
        self.stop()
        with self._lock:
            for item in [*self._taken, *self.buffer]:
                self.ledger.dropped(item.position, "run_ended")
            for position in list(self._pending):
                self.ledger.dropped(position, "run_ended")
            return self.ledger.to_json() | {"next_position": self.next_position}

    # ----- a part of the run's checkpointed state (hpcrl/store/run_state.py) -----
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        with self._lock:
            items = [*self._taken, *self.buffer]  # taken but not trained: buffered again on resume
            pending = [[p, self._pending[p]] for p in sorted(self._pending)]
            ledger = self.ledger.to_json()
            for item in self._taken:
                assert ledger["status"][ledger["position"].index(item.position)] == "buffered"
            next_position = self.next_position
        samples = [s for item in items for s in item.group.samples]
        tensors = {
            "rollout_buffer/prompt_ids": _flat_ints([s.prompt_ids for s in samples]),
            "rollout_buffer/output_ids": _flat_ints([s.output_ids for s in samples]),
            "rollout_buffer/logprobs": torch.tensor([x for s in samples for x in s.logprobs], dtype=torch.float64),
        }
        if any(s.supports is not None for s in samples):  # top-k/top-p replay: the ragged supports, as they are
            joined = TokenSupports.concat([s.supports for s in samples if s.supports is not None])
            for key, array in joined.to_arrays(prefix="rollout_buffer/support_").items():
                tensors[key] = torch.from_numpy(array)
        routed = [s.routed_experts for s in samples if s.routed_experts is not None]
        if routed:  # routing replay: each sample's [tokens - 1, layers, k] routes, flat, in sample order
            tensors["rollout_buffer/routed_experts"] = torch.from_numpy(np.concatenate([r.reshape(-1) for r in routed]))
        groups = [
            {
                "position": item.position, "attempt": item.attempt, "oldest_version": item.oldest_version,
                "samples": [
                    {
                        "prompt_len": len(s.prompt_ids), "output_len": len(s.output_ids),
                        "logprob_len": len(s.logprobs),
                        "finish": s.finish, "reward": s.reward, "reward_error": s.reward_error,
                        "versions": _spans(s.weight_versions),
                        "routes_shape": None if s.routed_experts is None else list(s.routed_experts.shape),
                    }
                    for s in item.group.samples
                ],
            }
            for item in items
        ]  # fmt: skip
        state = {
            "version": _STATE_VERSION, "groups": groups, "pending": pending, "next_position": next_position,
            "ledger": ledger, "prompts_per_step": self.prompts_per_step,
            "n_samples_per_prompt": self.cfg.n_samples_per_prompt,
        }  # fmt: skip
        self._saved_ledger = ledger | {"next_position": next_position}
        return tensors, state

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any], *, step: int) -> None:
        assert self._thread is None, "load the buffer before the producer starts"
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"rollout_buffer state version {state['version']}, this code reads {_STATE_VERSION}")
        settings = {"prompts_per_step": self.prompts_per_step, "n_samples_per_prompt": self.cfg.n_samples_per_prompt}
        for key, now in settings.items():
            if state[key] != now:
                raise ValueError(
                    f"the checkpoint's buffer was drawn with {key}={state[key]}, this config has {now}: positions and "
                    "seeds would no longer match; resume with the same setting, or start a new run"
                )
        prompt_ids = iter(tensors["rollout_buffer/prompt_ids"].tolist())
        output_ids = iter(tensors["rollout_buffer/output_ids"].tolist())
        logprobs = iter(tensors["rollout_buffer/logprobs"].tolist())
        supports: Iterator[TokenSupports | None] = itertools.repeat(None)
        if "rollout_buffer/support_ids" in tensors:
            arrays = {k: v.numpy() for k, v in tensors.items() if k.startswith("rollout_buffer/support_")}
            lengths = [s["output_len"] for g in state["groups"] for s in g["samples"]]
            supports = iter(TokenSupports.from_arrays(arrays, prefix="rollout_buffer/support_").split(lengths))
        items = []
        routes = (
            tensors["rollout_buffer/routed_experts"].numpy() if "rollout_buffer/routed_experts" in tensors else None
        )
        routes_at = 0
        for g in state["groups"]:
            group = Group(example=self.data.at(g["position"]))
            for s in g["samples"]:
                out = [next(output_ids) for _ in range(s["output_len"])]
                shape = s.get("routes_shape")
                sample_routes = None
                if shape is not None and routes is not None:
                    size = int(np.prod(shape))
                    sample_routes = routes[routes_at : routes_at + size].reshape(shape)
                    routes_at += size
                group.samples.append(
                    Sample(
                        prompt_ids=[next(prompt_ids) for _ in range(s["prompt_len"])], output_ids=out,
                        logprobs=[next(logprobs) for _ in range(s["logprob_len"])], text=self.formatter.decode(out),
                        finish=s["finish"], weight_versions=_unspan(s["versions"]), reward=s["reward"],
                        reward_error=s["reward_error"], supports=next(supports), routed_experts=sample_routes,
                    )
                )  # fmt: skip
            items.append(BufferedGroup(g["position"], g["attempt"], group, g["oldest_version"]))
        with self._lock:
            self.ledger = PromptLedger.from_json(state["ledger"])
            self.next_position = int(state["next_position"])
            self._pending = {int(p): int(a) for p, a in state["pending"]}
            self._queue = deque(sorted(self._pending))
            self._taken = []
            self._next_step = step + 1  # the checkpoint is of `step`, trained and committed
            self.buffer._items.clear()
            self.buffer.restore(items)

    def saved_ledger(self) -> dict[str, Any] | None:
        """The ledger as of the last checkpoint written (what a resume continues from)."""
        return self._saved_ledger


def oldest_version(results: Sequence[GenerateResult], submit_version: int, url: str) -> int | None:
    """The oldest weight version of any token of a group.

    With per-token spans (the embedded engine) each token's own version counts. An engine that reports one
    version per request (SGLang's meta_info.weight_version: the server's version when the response is built,
    so after a mid-request update it names the newest weights only) is read as the version served when the
    request was submitted: versions only grow, so no token of it is older (staleness is never under-counted).
    """
    known: list[int | None] = []
    for r in results:
        if r.weight_versions:
            known += token_weight_versions(r, url)
        else:
            known.append(submit_version)
    values = [v for v in known if v is not None]
    return min(values) if values else None


def earliest_step(
    next_step: int,
    taken: int,
    buffered: Iterable[int | None],
    inflight: int,
    *,
    prompts_per_step: int,
    max_staleness: int,
) -> int:
    """The earliest step that can train a group submitted now.

    collect() fills each step with prompts_per_step groups, oldest arrival first, skipping the stale ones. Ahead of
    the new group: the `taken` groups of `next_step`, the buffered groups (their oldest versions, in arrival
    order; one stale at the step that reaches it takes no place), and the `inflight` groups (submitted before
    it, so counted as arriving first: a short answer that overtakes a long one may be trained a step earlier)."""
    step, filled = next_step + taken // prompts_per_step, taken % prompts_per_step
    for oldest in buffered:
        if oldest is not None and step - oldest > max_staleness:
            continue  # collect() drops it
        filled += 1
        if filled == prompts_per_step:
            step, filled = step + 1, 0
    return step + (filled + inflight) // prompts_per_step


def _consumed_metrics(items: Sequence[BufferedGroup], step: int) -> dict[str, float]:
    staleness = [s for s in (g.staleness(step) for g in items) if s is not None]
    tokens = mixed = 0
    for item in items:
        for sample in item.group.samples:
            tokens += len(sample.weight_versions)
            if len(set(sample.weight_versions)) > 1:  # generated across a weight push
                mixed += len(sample.weight_versions)
    return {
        "buffer/staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
        "buffer/staleness_max": float(max(staleness)) if staleness else 0.0,
        "buffer/mixed_version_token_share": mixed / tokens if tokens else 0.0,
    }


def _flat_ints(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row], dtype=torch.int64)


def _spans(versions: Sequence[int | None]) -> list[list[Any]]:
    """Per-token versions as [version, count] runs."""
    out: list[list[Any]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _unspan(spans: Sequence[Sequence[Any]]) -> list[int | None]:
    """Per-token versions from [version, count] runs (strings in checkpoints written before versions were ints)."""
    runs = [(stored_version(v), count) for v, count in spans]
    return [v for v, count in runs for _ in range(count)]
