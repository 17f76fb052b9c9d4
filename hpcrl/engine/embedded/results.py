"""The scheduler's results: each step's sampled tokens appended to their requests, the finish tests, and a finished
request's completion (its log-probs recomputed when engine.logprobs is recompute, then its callback)."""

from __future__ import annotations

import logging
import time
from array import array

import torch

from hpcrl.engine.embedded.requests import SeqRequest
from hpcrl.engine.embedded.scheduler_state import SchedulerState
from hpcrl.engine.embedded.step_output import StepOutput
from hpcrl.model.qwen3 import token_logprobs_of_sequence

# The scheduler's logger: a failed completion callback is the scheduler's to report.
log = logging.getLogger("hpcrl.engine.embedded.scheduler")


class Results(SchedulerState):
    def _append_tokens(self, rows: list[SeqRequest], out: StepOutput, *, advance: bool) -> bool:
        """Record one sampled token per row; `advance` moves cached_len past the step's input token.

        This runs for every row of every step, so the version stamp and the finish test are inlined.
        """
        finished = False
        mask = out.support_mask
        version = self.weight_version
        context_length = self.cfg.context_length
        appended = 0
        for i, r in enumerate(rows):
            if r.finish_reason is not None:
                continue  # finished (or aborted) before this look-ahead step: its token is dropped
            tok = out.tokens[i]
            outputs = r.output_ids
            outputs.append(tok)
            r.logprobs.append(out.logprobs[i])
            r.scaled_logprobs.append(out.scaled_logprobs[i])
            if advance:
                r.cached_len += 1
            if r.return_sampling_mask:
                assert out.support_logprobs is not None
                r.support_logprobs.append(out.support_logprobs[i])
                # empty = the whole vocabulary (no filtering)
                r.support_ids.append(mask[i].nonzero()[:, 0].tolist() if mask is not None else [])
            n = len(outputs)
            spans = r.version_spans
            if spans and spans[-1][0] == version and spans[-1][2] == n - 1:
                spans[-1][2] = n
            else:
                spans.append([version, n - 1, n])
            appended += 1
            if (
                n >= r.max_new_tokens
                or tok in r.stop_token_ids
                or tok in self.eos_ids
                or len(r.prompt_ids) + n >= context_length
            ) and self._finish_if_done(r):
                finished = True
        self.num_generated_tokens += appended
        return finished

    def _finish_if_done(self, r: SeqRequest, *, before_first_token: bool = False) -> bool:
        if before_first_token:
            if r.max_new_tokens == 0 or len(r.output_ids) >= r.max_new_tokens:
                r.finish_reason = {"type": "length", "length": r.max_new_tokens}
                self._complete(r)
                return True
            return False
        tok = r.output_ids[-1]
        if tok in r.stop_token_ids or (not r.ignore_eos and tok in self.eos_ids):
            r.finish_reason = {"type": "stop", "matched": tok}
        elif len(r.output_ids) >= r.max_new_tokens or r.num_tokens >= self.cfg.context_length:
            r.finish_reason = {"type": "length", "length": len(r.output_ids)}
        else:
            return False
        return True

    def _complete(self, r: SeqRequest) -> None:
        r.finished_s = time.monotonic()
        if self.cfg.logprobs == "recompute" and r.output_ids and r.return_logprob and not self.weights_released:
            # A relabel, not on-policy: the tokens were drawn from the decode step's distribution, the reported
            # log-probs are the standard forward's of the whole sequence. The sampled ones travel along, so
            # the difference is measured (rollout/recompute_abs_diff), never hidden.
            ids = torch.tensor(r.all_ids, device=self.device)
            r.sampled_logprobs = r.logprobs.tolist()
            r.logprobs = array("d", token_logprobs_of_sequence(self.model, ids, len(r.prompt_ids)).tolist())
        r.answered_s = time.monotonic()
        try:
            r.on_done(r)
        except Exception:  # noqa: BLE001 - a broken callback must not kill the scheduler
            log.exception("completion callback failed for %s", r.rid)

    def _score_prompts(self, rows: list[SeqRequest]) -> None:
        """The prompt log-probs of the rows that asked for them (logprob_start_len >= 0; a teacher's scoring request,
        max_new_tokens=0), by the standard forward of right-padded batches of at most max_prefill_tokens tokens
        (causal attention: the padding after a row never reaches it). As SGLang's input_token_logprobs: one per
        prompt token from logprob_start_len, None for that first one: SGLang computes logits from logprob_start_len
        on, so nothing it computed predicts the token there (0.5.16's recorded answers show it), and a client that
        relied on a value there would break on SGLang."""
        rows = [r for r in rows if r.logprob_start_len >= 0 and r.return_logprob]
        if not rows or self.weights_released:
            return
        budget, i = self.cfg.max_prefill_tokens, 0
        while i < len(rows):
            chunk, width = [rows[i]], len(rows[i].prompt_ids)
            i += 1
            while i < len(rows) and max(width, len(rows[i].prompt_ids)) * (len(chunk) + 1) <= budget:
                width = max(width, len(rows[i].prompt_ids))
                chunk.append(rows[i])
                i += 1
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            for k, r in enumerate(chunk):
                ids[k, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
            ids = ids.to(self.device)
            with torch.inference_mode():
                logits = self.model(ids)
                for k, r in enumerate(chunk):
                    start, end = r.logprob_start_len, len(r.prompt_ids)
                    head: list[float | None] = [None]
                    lps = torch.log_softmax(logits[k, start : end - 1].float(), dim=-1)
                    r.input_logprobs = head + lps.gather(-1, ids[k, start + 1 : end, None])[:, 0].tolist()
                    if r.top_logprobs_num > 0:
                        top = lps.topk(min(r.top_logprobs_num, lps.shape[-1]), dim=-1)
                        vals, idx = top.values.tolist(), top.indices.tolist()
                        pairs = [list(zip(v, t, strict=True)) for v, t in zip(vals, idx, strict=True)]
                        r.input_top_logprobs = [None] * len(head) + pairs

    def _fail_all(self, message: str) -> None:
        with self._lock:
            victims = self.running + list(self.waiting)
            self.running = []
            self.waiting.clear()
        self._inflight = None
        self._rows_dirty = True
        for r in victims:
            r.finish_reason = {"type": "abort", "message": message, "status_code": 500}
            self._complete(r)
