"""Turn a step's prompts into groups of samples by driving the engines.

Every sample carries an explicit sampling seed derived from (run seed, step, prompt, sample), so the
same step produces the same samples after a resume, whichever engine serves it.

With top-k/top-p filtering (`RolloutConfig.replays_support`) every request asks for the sampling support of
each token (`return_sampling_mask`); the sample keeps it (`Sample.supports`) and its log-probs are the
support-normalised ones, i.e. the behaviour policy's (docs/sampling-replay.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcrl.engine.errors import EngineRequestError
from hpcrl.engine.fleet import EngineFleet, EngineSlot, FleetError
from hpcrl.engine.protocol.answers import GenerateResult
from hpcrl.engine.protocol.requests import SamplingParams
from hpcrl.engine.supports import checked_supports
from hpcrl.engine.versions import token_weight_versions
from hpcrl.model.moe import decode_routes
from hpcrl.rollout.config import DataConfig, RolloutConfig
from hpcrl.rollout.data import PromptSource
from hpcrl.samples.sample import DataError, Example, Group, Sample, sample_seed
from hpcrl.samples.support import TokenSupports
from hpcrl.sessions.tokens import first_unencodable, unknown_token
from hpcrl.trainer.batch import TrainBatch


@dataclass(frozen=True)
class Draw:
    """What a rollout call draws, where it differs from the training rollout's settings (None: the same)."""

    n_samples: int | None = None
    temperature: float | None = None  # 0: greedy
    max_new_tokens: int | None = None
    namespace: str = ""  # seeds and request ids of their own (see sample_seed)


class PromptFormatter:
    def __init__(self, tokenizer: Any, cfg: DataConfig) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg

    def encode(self, prompt: str) -> list[int]:
        """The prompt's ids as the model sees them, special tokens per `data.add_special_tokens`."""
        add = self.cfg.add_special_tokens
        if self.cfg.prompt_template == "chat":
            if add is True:
                return list(self.tokenizer.encode(self._model_text(prompt), add_special_tokens=True))
            # The template writes its own markers (a BOS included, where the model wants one).
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            # transformers 5 returns a BatchEncoding (a Mapping, not a dict), whose list() would be its keys.
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        text = self.cfg.prompt_template.format(prompt=prompt)
        if add == "auto":
            return list(self.tokenizer.encode(text))
        return list(self.tokenizer.encode(text, add_special_tokens=add))

    def describe(self, ids: Sequence[int]) -> str:
        """`ids` and their tokens, special ones included: what a user checks the prompt's BOS with."""
        tokens = self.tokenizer.convert_ids_to_tokens(list(ids))
        return f"{list(ids)} = {tokens}"

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def check_encodable(self, examples: Sequence[Example], *, source: str, answers: bool) -> None:
        """Raise DataError for a character the tokenizer can only map to its unknown token (which, for
        hpcrl's character tokenizer, is also the pad token): training on it would teach nothing true."""
        if unknown_token(self.tokenizer) is None:
            return  # every character encodes: skip rendering each prompt
        fields = [("prompt", i, self._model_text(e.prompt)) for i, e in enumerate(examples)]
        fields += [("answer", i, e.answer) for i, e in enumerate(examples)] if answers else []
        bad = first_unencodable(self.tokenizer, [t for _, _, t in fields])
        if bad is None:
            return
        name, i, _ = fields[bad.index]
        where = f"the {name} of example {i + 1} of {source}"
        if name == "prompt" and self.cfg.prompt_template != "{prompt}":
            where += " (after data.prompt_template)"
        raise DataError(
            f"{where} holds {bad.describe()}; remove or replace it in the data, or use a model whose tokenizer "
            "covers it"
        )

    def _model_text(self, prompt: str) -> str:
        if self.cfg.prompt_template == "chat":
            return str(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
                )
            )
        return self.cfg.prompt_template.format(prompt=prompt)


def answer_batches(formatter: PromptFormatter, data: PromptSource) -> Callable[[int], TrainBatch]:
    """SFT on prompt -> answer: the prompt as the rollout encodes it, the answer's ids and EOS as the response."""
    eos = formatter.tokenizer.eos_token_id

    def batch(step: int) -> TrainBatch:
        examples = data.batch(step)
        prompts = [formatter.encode(e.prompt) for e in examples]
        answers = [formatter.tokenizer.encode(e.answer, add_special_tokens=False) + [eos] for e in examples]
        return TrainBatch.from_sequences(prompts, answers)

    return batch


class Rollout:
    """Sends a step's samples to the live engines of the fleet, one batch call per engine.

    If an engine dies while its call is in flight, its samples go again, with the same seeds, to the
    engines still alive (`recover` is called first when none is left); nothing is lost or duplicated.
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        fleet: EngineFleet,
        formatter: PromptFormatter,
        *,
        seed: int,
        recover: Callable[[], None] | None = None,
        poll_s: float = 0.2,
        routes_shape: tuple[int, int] | None = None,
    ) -> None:
        """`routes_shape`: (decoder layers, top-k) of a mixture-of-experts model whose routes the trainer replays:
        every request asks for them and each sample keeps them (None: not asked)."""
        self.routes_shape = routes_shape
        self.cfg = cfg
        self.fleet = fleet
        self.formatter = formatter
        self.seed = seed
        self.recover = recover
        self.poll_s = poll_s
        self._pool = ThreadPoolExecutor(max_workers=2 * len(fleet.slots), thread_name_prefix="hpcrl-rollout")

    def _call(
        self, slot: EngineSlot, step: int, items: list[tuple[int, int]], prompts: list[list[int]], draw: Draw
    ) -> list[tuple[GenerateResult, TokenSupports | None]]:
        params = [
            SamplingParams(
                max_new_tokens=draw.max_new_tokens or self.cfg.max_new_tokens,
                temperature=self.cfg.temperature if draw.temperature is None else draw.temperature,
                top_p=self.cfg.top_p,
                top_k=self.cfg.top_k,
                sampling_seed=sample_seed(self.seed, step, p, s, draw.namespace),
            )
            for p, s in items
        ]
        out = slot.client.generate(
            [prompts[p] for p, _ in items],
            params,
            return_logprob=True,
            rid=[f"{draw.namespace or 'step'}{step}-p{p}-s{s}" for p, s in items],
            return_sampling_mask=self.cfg.replays_support,
            timeout_s=self.cfg.request_timeout_s,
            return_routed_experts=self.routes_shape is not None,
        )
        results = out if isinstance(out, list) else [out]
        if not self.cfg.replays_support:
            return [(r, None) for r in results]
        return [(r, checked_supports(r, slot.client.url)) for r in results]

    def generate(self, step: int, examples: Sequence[Example], draw: Draw | None = None) -> list[Group]:
        """The groups of `examples`; `draw` changes what is drawn (evaluation: greedy, k samples)."""
        draw = draw or Draw()
        n = draw.n_samples or self.cfg.n_samples_per_prompt
        prompts = [self.formatter.encode(e.prompt) for e in examples]
        results: dict[tuple[int, int], tuple[GenerateResult, TokenSupports | None, str]] = {}  # ..., engine URL
        pending = [(p, s) for p in range(len(examples)) for s in range(n)]
        while pending:
            live = self.fleet.live()
            if not live:
                if self.recover is None:
                    raise FleetError("no live engine to send the rollout to")
                self.recover()
                continue
            work = assign_least_loaded(pending, [len(prompts[p]) for p in range(len(prompts))], len(live))
            calls = {
                self._pool.submit(self._call, live[k], step, items, prompts, draw): (live[k], items)
                for k, items in work.items()
            }
            pending = []
            while calls:
                done, _ = wait(list(calls), timeout=self.poll_s, return_when=FIRST_COMPLETED)
                for fut in done:
                    slot, items = calls.pop(fut)
                    try:
                        answers = zip(items, fut.result(), strict=True)
                        results.update((item, (r, supports, slot.client.url)) for item, (r, supports) in answers)
                    except EngineRequestError:
                        raise  # the engine refused the request itself: re-sending would not help
                    except Exception as exc:  # noqa: BLE001 - a dead or unreachable engine
                        self.fleet.report_failure(slot, exc)
                        if slot.state == "live":
                            raise
                        pending += items
                        self.fleet.num_reissued += len(items)
                for fut, (slot, items) in list(calls.items()):
                    if slot.state != "live":  # declared dead by the monitor while we waited
                        del calls[fut]
                        pending += items
                        self.fleet.num_reissued += len(items)
        groups = [Group(example=e) for e in examples]
        for p in range(len(examples)):
            for s in range(n):
                r, supports, url = results[(p, s)]
                groups[p].samples.append(sample_of(r, prompts[p], self.formatter, supports, url, self.routes_shape))
        return groups

    def pop_metrics(self) -> dict[str, float]:
        """Figures of the last step beyond rollout_stats' (none for single completions; see EpisodeRollout)."""
        return {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def sample_of(
    r: GenerateResult,
    prompt: list[int],
    formatter: PromptFormatter,
    supports: TokenSupports | None,
    url: str,
    routes_shape: tuple[int, int] | None = None,
) -> Sample:
    """The training sample of one result of the engine at `url` (the synchronous rollout's and the async
    producer's); with `routes_shape` (layers, top-k), its routed experts."""
    return Sample(
        prompt_ids=prompt,
        output_ids=list(r.output_ids),
        # With supports, the behaviour policy's log-prob is the one renormalised over them.
        logprobs=list((r.support_logprobs if supports is not None else r.output_token_logprobs) or []),
        text=formatter.decode(r.output_ids),
        finish=r.finish_reason.type if r.finish_reason else "abort",
        weight_versions=token_weight_versions(r, url),
        supports=supports,
        sampled_logprobs=_sampled_logprobs(r),
        routed_experts=None if routes_shape is None else routed_experts(r, len(prompt), routes_shape, url),
    )


def routed_experts(r: GenerateResult, prompt_len: int, shape: tuple[int, int], url: str) -> np.ndarray:
    """The result's `meta_info.routed_experts` as [prompt + output - 1, layers, top-k] int32, checked against the
    model's shape."""
    text = r.meta_info.get("routed_experts")
    if not isinstance(text, str):
        raise ValueError(
            f"the engine at {url} answered no meta_info.routed_experts, which routing replay needs: start SGLang "
            "with --enable-return-routed-experts, or set train.routing_replay: off"
        )
    routes = decode_routes(text, *shape)
    tokens = prompt_len + len(r.output_ids) - 1
    if routes.shape[0] != tokens:
        raise ValueError(
            f"the engine at {url} answered routed experts of shape {tuple(routes.shape)}, but a sequence of "
            f"{tokens + 1} tokens on this model needs ({tokens}, {shape[0]}, {shape[1]}): the engine serves another "
            "model"
        )
    return routes


def assign_least_loaded(
    items: Sequence[tuple[int, int]], prompt_lens: Sequence[int], num_engines: int
) -> dict[int, list[tuple[int, int]]]:
    """Whole groups (all samples of a prompt) to the engine with the least work so far, in prompt order.

    Work is counted in prompt tokens times samples plus the samples themselves; ties go to the lowest
    engine index, so the split is deterministic (equal groups come out round-robin) and a resumed run
    sends every engine exactly the batch it sent before.
    """
    groups: dict[int, list[tuple[int, int]]] = {}
    for p, s in items:
        groups.setdefault(p, []).append((p, s))
    load = [0] * num_engines
    work: dict[int, list[tuple[int, int]]] = {}
    for p, group in groups.items():
        k = min(range(num_engines), key=lambda i: (load[i], i))
        load[k] += len(group) * (prompt_lens[p] + 1)
        work.setdefault(k, []).extend(group)
    return work


def _sampled_logprobs(r: GenerateResult) -> list[float] | None:
    """The log-probs an engine in `logprobs: recompute` mode sampled with (sent next to the re-score)."""
    raw = r.meta_info.get("hpcrl_sampled_logprobs")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != len(r.output_ids):
        raise ValueError(f"meta_info.hpcrl_sampled_logprobs must be one number per output token, got {raw!r:.80}")
    return [float(x) for x in raw]


def recompute_abs_diff(samples: Sequence[Sample]) -> float | None:
    """Mean |sampled - reported| log-prob over the tokens of re-scored samples; None when none was re-scored."""
    total, count = 0.0, 0
    for s in samples:
        if s.sampled_logprobs is not None:
            total += sum(abs(a - b) for a, b in zip(s.sampled_logprobs, s.logprobs, strict=True))
            count += len(s.logprobs)
    return total / count if count else None


def rollout_stats(groups: Sequence[Group], seconds: float, *, version: int | None = None) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    recompute = recompute_abs_diff(samples)
    # Tokens the model did not sample (a multi-turn episode's tool results) carry no version and are not counted.
    versions = [v for s in samples for v in s.weight_versions if v is not None]
    lengths = [len(s.output_ids) for s in samples]
    rewards = [s.reward for s in samples if s.reward_error is None]
    zero_std = sum(1 for g in groups if len({s.reward for s in g.samples}) == 1)
    return {
        # Plain sum, not fsum: a reward scale bug should show as inf, not crash the statistics.
        "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "rollout/response_len_mean": statistics.fmean(lengths),
        "rollout/response_len_median": float(statistics.median(lengths)),
        "rollout/response_len_max": float(max(lengths)),
        "rollout/truncated_share": sum(s.finish == "length" for s in samples) / len(samples),
        "rollout/aborted_share": sum(s.finish == "abort" for s in samples) / len(samples),
        "rollout/zero_std_group_share": zero_std / len(groups),
        "rollout/reward_failed_share": sum(s.reward_error is not None for s in samples) / len(samples),
        "rollout/tokens_per_s": sum(lengths) / seconds if seconds > 0 else float("nan"),
        "rollout/num_samples": float(len(samples)),
        # Tokens generated under other weights than the driver's current version (0 in synchronous runs).
        "rollout/stale_token_share": (sum(v != version for v in versions) / len(versions))
        if version is not None and versions
        else 0.0,
        **support_stats(samples),
    } | ({"rollout/recompute_abs_diff": recompute} if recompute is not None else {})


def support_stats(samples: Sequence[Sample], *, sampled_only: bool = False) -> dict[str, float]:
    """`rollout/support_size_mean` / `_max` over the step's generated tokens (none without replay); with
    `sampled_only`, over the tokens the loss trains (multi-turn: not the tool results' singletons)."""
    sizes = []
    for s in samples:
        if s.supports is None:
            continue
        per_token = s.supports.sizes()
        sizes.append(per_token[np.asarray(s.loss_mask, dtype=bool)] if sampled_only and s.loss_mask else per_token)
    if not sizes:
        return {}
    flat = np.concatenate(sizes)
    if not flat.size:
        return {"rollout/support_size_mean": float("nan"), "rollout/support_size_max": float("nan")}
    return {"rollout/support_size_mean": float(flat.mean()), "rollout/support_size_max": float(flat.max())}
