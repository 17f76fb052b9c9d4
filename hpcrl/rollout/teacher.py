"""The distillation teacher: a frozen model on engines of its own that scores the tokens the student sampled.

Each sample (prompt + response) goes to a teacher engine as a scoring request: `max_new_tokens=0`, `return_logprob`
with `logprob_start_len` at the prompt's last token, so the answer's `input_token_logprobs` hold null for that token
(SGLang computes logits from `logprob_start_len` on: nothing it computed predicts the token there) and then the
teacher's log-prob of every response token (SGLang's fields; the embedded engine answers them alike). With
`distill.top_k` the request also sets `top_logprobs_num`, and `input_top_logprobs` holds the teacher's k most likely
(log-prob, id) at each of those positions. Samples with one prompt
length share a request. The teacher's engines are started, watched and restarted by the same launcher and
`EngineFleet` as the student's; a request that fails on a dead engine is sent again once the fleet restarted it
(bounded by the fleet's `max_restarts`). Nothing is ever pushed to them: their weights are the teacher's, always.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.engine.client import EngineClient
from hpcrl.engine.errors import EngineRequestError
from hpcrl.engine.fleet import EngineFleet, EngineSlot, FleetError
from hpcrl.engine.local import LocalEngines
from hpcrl.engine.protocol.answers import GenerateResult, input_token_logprobs, input_top_logprobs
from hpcrl.engine.protocol.requests import GenerateRequest, SamplingParams
from hpcrl.rollout.distill_config import DistillConfig
from hpcrl.samples.sample import Group, Sample
from hpcrl.store.run_dir import make_subdir

__all__ = ["Teacher", "TeacherError", "TeacherScores", "check_same_vocabulary", "start_teacher"]

SAMPLES_PER_REQUEST = 64
"""Sequences of one scoring request: enough to batch the teacher's forward, few enough to spread over engines."""


class TeacherError(ValueError):
    """A teacher that cannot score this student's tokens (another vocabulary), or a request it refused."""


def check_same_vocabulary(student_dir: str | Path, teacher_dir: str | Path) -> None:
    """Refuse a teacher whose tokenizer maps any token to another id than the student's (or has other tokens):
    the teacher scores the student's token ids, which must mean the same text to both."""
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(student_dir).get_vocab()
    teacher = AutoTokenizer.from_pretrained(teacher_dir).get_vocab()
    if student == teacher:
        return
    fix = (
        "on-policy distillation scores the student's token ids with the teacher, so both need one tokenizer: pick a "
        "teacher of the student's model family"
    )
    moved = next(((tok, i) for tok, i in sorted(student.items(), key=lambda kv: kv[1]) if teacher.get(tok) != i), None)
    if moved is not None:
        tok, i = moved
        other = teacher.get(tok)
        where = f"id {other} in the teacher's" if other is not None else "absent from the teacher's"
        raise TeacherError(
            f"distill.teacher.model {teacher_dir} has another vocabulary than the student {student_dir} "
            f"({len(student)} tokens against {len(teacher)}): token {tok!r} is id {i} in the student's tokenizer and "
            f"{where}; {fix}"
        )
    extra = min(set(teacher) - set(student), key=lambda t: teacher[t])
    raise TeacherError(
        f"distill.teacher.model {teacher_dir} has another vocabulary than the student {student_dir} ({len(student)} "
        f"tokens against {len(teacher)}): token {extra!r} (id {teacher[extra]}) is only in the teacher's; {fix}"
    )


TopK = list[list[tuple[float, int]]]
"""One sample's teacher top-k: per response token, its (log-prob, id) pairs, most likely first."""


@dataclass(frozen=True)
class TeacherScores:
    """One step's scoring, in the groups' sample order."""

    logprobs: list[list[float]]
    """The teacher's log-prob of every response token of every sample."""
    top: list[TopK] | None
    """With `top_k`: the teacher's top-k at every response token of every sample; else None."""
    stats: dict[str, float]
    """`distill/teacher_s` (the scoring's wall time) and `distill/teacher_retries` (requests sent again)."""


class Teacher:
    """Scores samples on the teacher's fleet; `close` stops its engines. `top_k`: also its top-k ids per token."""

    def __init__(
        self,
        fleet: EngineFleet,
        *,
        timeout_s: float,
        launcher: LocalEngines | None = None,
        max_attempts: int = 0,
        top_k: int | None = None,
    ) -> None:
        self.fleet = fleet
        self.top_k = top_k
        self.launcher = launcher
        self.timeout_s = timeout_s
        # Every restart the fleet may make, plus the first try: a request never waits on an engine without bound.
        self.max_attempts = max_attempts or fleet.cfg.max_restarts * max(len(fleet.slots), 1) + 1

    def score(self, groups: list[Group]) -> TeacherScores:
        """The teacher's log-prob (and top-k) of every response token of every sample, in the groups' order."""
        t0 = time.perf_counter()
        samples = [s for g in groups for s in g.samples]
        out: list[list[float] | None] = [None if s.output_ids else [] for s in samples]
        self._top: list[TopK] = [[] for _ in samples]
        todo = _requests(samples, self.top_k)
        retries = 0
        for _ in range(self.max_attempts):
            failed = self._send(todo, samples, out)
            if not failed:
                break
            retries += len(failed)
            self.fleet.restart_dead()  # raises FleetError when an engine used up its restarts
            todo = failed
        else:
            raise FleetError(
                f"the teacher's engines failed {len(todo)} scoring request(s) {self.max_attempts} times; see the "
                "engine_dead events and run_dir/teacher/logs/"
            )
        scored = [lps for lps in out if lps is not None]
        assert len(scored) == len(samples)
        stats = {"distill/teacher_s": time.perf_counter() - t0, "distill/teacher_retries": float(retries)}
        return TeacherScores(scored, self._top if self.top_k else None, stats)

    def _send(
        self, todo: list[tuple[list[int], GenerateRequest]], samples: list[Sample], out: list[list[float] | None]
    ) -> list[tuple[list[int], GenerateRequest]]:
        """Send every request to the live engines (round robin); fill `out`; return the requests that failed."""
        live = self.fleet.live()
        if not live:
            self.fleet.restart_dead()
            live = self.fleet.live()
        failed: list[tuple[list[int], GenerateRequest]] = []

        def one(k: int) -> None:
            rows, request = todo[k]
            slot = live[k % len(live)]
            client = slot.client
            try:
                results = _call(client, request, self.timeout_s)
            except EngineRequestError as exc:
                if exc.status_code is not None and 400 <= exc.status_code < 500:
                    raise TeacherError(f"the teacher's engine {client.url} refused a scoring request: {exc}") from exc
                self._failed(slot, exc, client, failed, todo[k])
                return
            except Exception as exc:  # noqa: BLE001 - a dead or hung engine: the fleet decides, the request retries
                self._failed(slot, exc, client, failed, todo[k])
                return
            for i, result in zip(rows, results, strict=True):
                lps = input_token_logprobs(result)[1:]  # the first entry is the prompt's last token: null
                if len(lps) != len(samples[i].output_ids) or any(lp is None for lp in lps):
                    raise TeacherError(
                        f"the teacher's engine {client.url} scored {len(lps)} response tokens of a sample with "
                        f"{len(samples[i].output_ids)}: an engine that ignores logprob_start_len cannot be a teacher"
                    )
                out[i] = [float(lp) for lp in lps if lp is not None]
                if self.top_k:
                    top = input_top_logprobs(result)[1:]
                    if len(top) != len(lps) or any(not pairs for pairs in top):
                        raise TeacherError(
                            f"the teacher's engine {client.url} returned top-k log-probs for {len(top)} response "
                            f"tokens of a sample with {len(lps)} (or an empty entry): it ignored top_logprobs_num"
                        )
                    self._top[i] = [list(pairs) for pairs in top if pairs]

        with ThreadPoolExecutor(max_workers=min(len(todo), 4 * len(live)) or 1) as pool:
            for future in [pool.submit(one, k) for k in range(len(todo))]:
                future.result()
        return failed

    def _failed(
        self,
        slot: EngineSlot,
        exc: BaseException,
        client: EngineClient,
        failed: list[tuple[list[int], GenerateRequest]],
        item: tuple[list[int], GenerateRequest],
    ) -> None:
        self.fleet.report_failure(slot, exc, client=client)
        failed.append(item)

    def close(self) -> None:
        self.fleet.close()
        if self.launcher is not None:
            self.launcher.stop()


def _requests(samples: list[Sample], top_k: int | None = None) -> list[tuple[list[int], GenerateRequest]]:
    """Scoring requests: one `logprob_start_len` per request, so the samples of one prompt length go together."""
    by_prompt: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        if s.output_ids:
            by_prompt.setdefault(len(s.prompt_ids), []).append(i)
    todo = []
    for prompt_len, rows in sorted(by_prompt.items()):
        for k in range(0, len(rows), SAMPLES_PER_REQUEST):
            chunk = rows[k : k + SAMPLES_PER_REQUEST]
            request = GenerateRequest(
                input_ids=[samples[i].prompt_ids + samples[i].output_ids for i in chunk],
                sampling_params=SamplingParams(max_new_tokens=0),
                return_logprob=True,
                logprob_start_len=prompt_len - 1,
                top_logprobs_num=top_k or 0,
            )
            todo.append((chunk, request))
    return todo


def _call(client: EngineClient, request: GenerateRequest, timeout_s: float) -> list[GenerateResult]:
    results = client.generate_request(request, timeout_s=timeout_s)
    results = results if isinstance(results, list) else [results]
    aborted = [r for r in results if r.aborted]
    if aborted:
        raise RuntimeError(f"the teacher's engine aborted a scoring request: {aborted[0].finish_reason}")
    return results


def start_teacher(
    cfg: DistillConfig,
    model_dir: Path,
    run_dir: Path,
    *,
    seed: int,
    timeout_s: float,
    say: Callable[[str], None],
    on_event: Callable[[str, dict[str, Any]], None],
) -> Teacher:
    """Start the teacher's engines on this node (their logs in run_dir/teacher/logs/) under a fleet of their own."""
    engine = cfg.teacher.engine
    launcher = LocalEngines(engine, model_dir, make_subdir(run_dir / "teacher"), seed=seed, say=say)
    say(f"starting {engine.num_engines} {engine.kind} teacher engine(s) on {engine.device} for {model_dir}")
    clients = launcher.start()

    def event(kind: str, detail: dict[str, Any]) -> None:
        on_event(f"teacher_{kind}", detail)

    fleet = EngineFleet(engine, clients, launcher=launcher, on_event=event)
    return Teacher(fleet, timeout_s=timeout_s, launcher=launcher, top_k=cfg.top_k)
