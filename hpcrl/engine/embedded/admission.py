"""The scheduler's admission: waiting requests taken into the cache slots after the running ones (within
max_running_requests and max_prefill_tokens), prefilled together with one forward per distinct prompt, their first
tokens sampled; and the compaction that closes the slots finished requests leave."""

from __future__ import annotations

import time
from array import array

import torch

from hpcrl.engine.embedded.requests import SeqRequest
from hpcrl.engine.embedded.results import Results


class Admission(Results):
    def _can_admit(self) -> bool:
        if not self.waiting or len(self.running) >= self.cfg.max_running_requests:
            return False
        # Deterministic mode forms batches only from an idle engine, so one /generate call on an
        # idle engine always meets the same batch composition and gives bit-identical results.
        return not (self.cfg.deterministic and self.running)

    def _take_waiting(self) -> list[SeqRequest]:
        free = self.cfg.max_running_requests - len(self.running)
        if free <= 0:
            return []
        # Deterministic mode forms batches only from an idle engine, so one /generate call on an
        # idle engine always meets the same batch composition and gives bit-identical results.
        if self.cfg.deterministic and self.running:
            return []
        taken: list[SeqRequest] = []
        budget = self.cfg.max_prefill_tokens
        prompts: set[tuple[int, ...]] = set()
        with self._lock:
            while self.waiting and len(taken) < free:
                # A sequence already taken (a group's other samples) is copied from its prefill, not recomputed:
                # it costs no budget, and a group is not split over two forwards that would each run its prompt.
                ids = tuple(self.waiting[0].all_ids)
                need = 0 if ids in prompts else len(ids)
                if taken and need > budget:
                    break
                budget -= need
                prompts.add(ids)
                taken.append(self.waiting.popleft())
        return taken

    def _admit(self) -> None:
        new = self._take_waiting()
        if not new:
            return
        self._score_prompts(new)
        ready = [r for r in new if not self._finish_if_done(r, before_first_token=True)]
        if not ready:
            return
        t0 = time.perf_counter()
        # The samples of one prompt (a group's n) share its prefill: the first of each distinct sequence
        # runs it, the others get a copy of its K/V rows and its logits row. Slots: the prefilled rows
        # first, then the copies.
        owner: dict[tuple[int, ...], int] = {}
        lead_of = [owner.setdefault(tuple(r.all_ids), k) for k, r in enumerate(ready)]
        leads = [k for k, o in enumerate(lead_of) if o == k]
        copies = [k for k, o in enumerate(lead_of) if o != k]
        ready = [ready[k] for k in leads + copies]
        first_slot = len(self.running)
        self.running.extend(ready)
        self._rows_dirty = True
        heads = ready[: len(leads)]
        lengths = [r.num_tokens for r in heads]
        width = max(lengths)
        # One flat array, not torch.tensor of nested lists: that walks every int in Python (4-6 ms for 256 x 128
        # on a 2-core CPU, against ~1.4 ms).
        flat = array("q")
        for r, n in zip(heads, lengths, strict=True):
            flat.extend(r.prompt_ids)
            flat.extend(r.output_ids)
            flat.frombytes(bytes(8 * (width - n)))  # zero padding: 8 bytes an id
        ids = torch.frombuffer(flat, dtype=torch.int64).view(len(heads), width)
        last = torch.tensor(lengths) - 1
        logits = self.runner.prefill(ids.to(self.device), first_slot, last.to(self.device))
        self.num_prefill_forwards += 1
        if any(r.return_routed_experts for r in ready):
            self._record_prefill_routes(ready, lead_of, leads, width)
        if copies:
            assert self.cache is not None
            row_of_lead = {k: row for row, k in enumerate(leads)}
            sources = [row_of_lead[lead_of[k]] for k in copies]
            copy_slots = range(first_slot + len(leads), first_slot + len(ready))
            self.cache.copy_prefix([first_slot + row for row in sources], list(copy_slots), width)
            logits = logits[torch.tensor(list(range(len(leads))) + sources, device=logits.device)]
        for r in ready:
            r.cached_len = r.num_tokens
        self._refresh_sampler_flags()
        out = self.runner.sample_prefill(
            logits,
            [r.row_state() for r in ready],
            torch_sampler=any(r.filtered or r.return_sampling_mask for r in ready),
            want_support=any(r.return_sampling_mask for r in ready),
        )
        self._append_tokens(ready, out, advance=False)
        self.host_stats["prefill_s"] += time.perf_counter() - t0

    def _record_prefill_routes(self, ready: list[SeqRequest], lead_of: list[int], leads: list[int], width: int) -> None:
        """Each prefilled row's routes (a copy's are its lead's); a row re-prefilled after a retraction keeps those
        its tokens were first run with (`SeqRequest.add_routes`)."""
        routes = self.runner.routes(len(leads), width)
        if routes is None:
            return
        host = routes.cpu().numpy()
        row_of_lead = {k: row for row, k in enumerate(leads)}
        order = leads + [k for k, o in enumerate(lead_of) if o != k]
        for r, k in zip(ready, order, strict=True):
            if r.return_routed_experts:
                r.add_routes(host[row_of_lead[lead_of[k]], : r.num_tokens], 0)

    def _refresh_sampler_flags(self) -> None:
        self._want_routes = any(r.return_routed_experts for r in self.running)
        self._want_support = any(r.return_sampling_mask for r in self.running)
        self._torch_sampler = self._want_support or any(r.filtered for r in self.running)

    def _compact(self) -> None:
        """Complete rows that have a finish reason and close the gaps they leave in slots 0..R-1."""
        done = [r for r in self.running if r.finish_reason is not None]
        if not done:
            return
        keep = len(self.running) - len(done)
        holes = [i for i in range(keep) if self.running[i].finish_reason is not None]
        movers = [i for i in range(keep, len(self.running)) if self.running[i].finish_reason is None]
        for dst, src in zip(holes, movers, strict=True):
            if self.cache is not None:
                self.cache.move_slot(src, dst)
            self.running[dst] = self.running[src]
        del self.running[keep:]
        self._rows_dirty = True
        self._refresh_sampler_flags()
        for r in done:
            self._complete(r)
