"""The scheduler's control operations (abort, pause, weight version, memory release and resume), run on the
scheduler thread between forward passes through `Scheduler.call`."""

from __future__ import annotations

import gc
from collections import deque

import torch

from hpcrl.engine.embedded.admission import Admission
from hpcrl.engine.embedded.requests import EngineStateError, PauseMode, SeqRequest
from hpcrl.model.qwen3 import KVCache


class Control(Admission):
    # ----- control operations: run on the scheduler thread through `call` -----
    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort requests whose id starts with rid (SGLang matches by prefix); returns how many."""

        def match(r: SeqRequest) -> bool:
            return abort_all or (rid != "" and r.rid.startswith(rid))

        with self._lock:
            waiting = [r for r in self.waiting if match(r)]
            self.waiting = deque(r for r in self.waiting if not match(r))
        running = [r for r in self.running if match(r)]
        for r in waiting + running:
            r.finish_reason = {"type": "abort", "message": "Abort request " + ("(all)" if abort_all else rid)}
        for r in waiting:
            self._complete(r)
        self._compact()  # completes the running ones
        return len(waiting) + len(running)

    def pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self.abort(abort_all=True)
        elif mode == "retract":
            # Running requests go back to the front of the queue with what they generated so far;
            # after continue they prefill prompt + partial output again (under the weights of then).
            with self._lock:
                for r in reversed(self.running):
                    r.num_retractions += 1
                    r.cached_len = 0
                    self.waiting.appendleft(r)
            self.running = []
            self._rows_dirty = True
        self.paused = mode

    def resume_generation(self) -> None:
        self.paused = None

    def flush_cache(self) -> None:
        if self.running or self.waiting:
            raise EngineStateError(
                f"cannot flush the cache while {len(self.running)} requests run and {len(self.waiting)} wait"
            )

    def set_weight_version(self, version: str, abort_all_requests: bool) -> None:
        if abort_all_requests:
            self.abort(abort_all=True)
        self.weight_version = version

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's shape, also while the weights are released (their tensors are then empty)."""
        if self.weights_released:
            return {n: tuple(shape) for n, (shape, _) in self._weight_shapes.items()}
        return {n: tuple(p.shape) for n, p in self.model.named_parameters()}

    def release_memory(self, tags: list[str], *, weights_cpu_backup: bool) -> dict[str, int]:
        if self.running or self.waiting:
            raise EngineStateError(
                f"release_memory_occupation needs an idle engine, but {len(self.running)} requests run and "
                f"{len(self.waiting)} wait: pause_generation(mode='abort') or wait for them first"
            )
        freed: dict[str, int] = {}
        cuda = self.device.type == "cuda"
        # Captured graphs hold raw addresses of the cache, the weights and their own memory pool:
        # releasing any of them makes the graphs invalid, so they go first (re-captured on demand).
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        self.runner.reset_graphs()
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
        if "cuda_graph" in tags:
            freed["cuda_graph"] = reserved - torch.cuda.memory_reserved(self.device) if cuda else 0
        if "kv_cache" in tags and self.cache is not None:
            freed["kv_cache"] = self.cache.nbytes()
            self.cache = None
            self.runner.set_cache(None)
        if "weights" in tags and not self.weights_released:
            total = 0
            for name, p in self.model.named_parameters():
                self._weight_shapes[name] = (p.shape, p.dtype)
                if weights_cpu_backup:
                    self._weight_backup[name] = p.detach().to("cpu", copy=True)
                total += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.weights_released = True
            freed["weights"] = total
        if cuda:
            # Dropped tensors go back to torch's caching allocator, not to the device: empty_cache
            # returns them, so the trainer (another process) can use the memory.
            gc.collect()
            torch.cuda.empty_cache()
        return freed

    def resume_memory(self, tags: list[str]) -> dict[str, int]:
        restored: dict[str, int] = {}
        if "weights" in tags and self.weights_released:
            total = 0
            for name, p in self.model.named_parameters():
                shape, dtype = self._weight_shapes[name]
                backup = self._weight_backup.pop(name, None)
                # Without a backup the contents are undefined, as with SGLang's memory saver: the
                # trainer pushes weights next. Zeros keep that state deterministic.
                p.data = (
                    backup.to(self.device)
                    if backup is not None
                    else torch.zeros(shape, dtype=dtype, device=self.device)
                )
                total += p.numel() * p.element_size()
            self.weights_released = False
            self.runner.reset_graphs()  # new weight storage: graphs are re-captured against it
            restored["weights"] = total
        if "kv_cache" in tags and self.cache is None:
            self.cache = KVCache.allocate(
                self.model.args,
                self.cfg.max_running_requests,
                self.cfg.context_length,
                self.cfg.kv_cache_dtype or self.dtype,
                self.device,
            )
            self.runner.set_cache(self.cache)
            restored["kv_cache"] = self.cache.nbytes()
        if "cuda_graph" in tags:
            restored["cuda_graph"] = 0
        return restored
