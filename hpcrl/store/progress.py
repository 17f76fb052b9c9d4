"""Phase timing and the one-line-per-step progress report."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import TextIO


class StepTimer:
    """Named spans of one step; keys map one-to-one onto metrics.h5 datasets (timing/<phase>_s)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {f"timing/{k}_s": v for k, v in self.seconds.items()}
        out["timing/total_s"] = time.perf_counter() - self.t0
        return out


def _fmt_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


_verbose = False


def set_verbose(on: bool) -> None:
    """Show the details a run prints only on request (`hpcrl run --verbose`), for this process."""
    global _verbose
    _verbose = on


class Progress:
    """The run's log: one line per step, numbered as the user counts (step 1 is the first, N of N the last)."""

    def __init__(self, num_steps: int, *, stream: TextIO = sys.stdout) -> None:
        self.num_steps = num_steps
        self.stream = stream
        self.step_seconds: list[float] = []

    def say(self, message: str) -> None:
        print(message, file=self.stream, flush=True)

    def detail(self, message: str) -> None:
        """A line for debugging a run (e.g. the first prompt's token ids), printed only under --verbose."""
        if _verbose:
            self.say(message)

    def step(self, step: int, m: dict[str, float]) -> None:
        self.step_seconds.append(m["timing/total_s"])
        recent = self.step_seconds[-10:]
        eta = sum(recent) / len(recent) * (self.num_steps - step - 1)
        phases = " ".join(
            f"{name} {m[f'timing/{name}_s']:.2f}s"
            for name in ("rollout", "reward", "train", "sync", "checkpoint")
            if f"timing/{name}_s" in m
        )
        if m.get("timing/eval_s", 0.0) > 0.005:
            phases += f" eval {m['timing/eval_s']:.2f}s"
        self.say(
            f"step {step + 1:>4}/{self.num_steps} | reward {m['rollout/reward_mean']:.3f} "
            f"| len {m['rollout/response_len_mean']:.1f} (max {m['rollout/response_len_max']:.0f}, "
            f"trunc {m['rollout/truncated_share']:.2f}) "
            f"| {_gap(m)} "
            f"| {phases} | {m['timing/total_s']:.2f} s/step | ETA {_fmt_eta(eta)}"
        )
        if "eval/accuracy_greedy" in m:
            k = int(m["eval/k"])
            self.say(
                f"eval after step {step + 1}: greedy accuracy {m['eval/accuracy_greedy']:.3f} | pass@{k} "
                f"{m['eval/pass_at_k']:.3f} | mean reward@{k} {m['eval/mean_at_k']:.3f} "
                f"({m['eval/num_prompts']:.0f} prompts)"
            )


def _gap(m: dict[str, float]) -> str:
    """The train/rollout gap, or, for re-scored log-probs, the sampled-vs-reported difference, labelled."""
    if "rollout/recompute_abs_diff" in m:
        return f"gap n/a (recompute: sampled vs reported {m['rollout/recompute_abs_diff']:.2e})"
    return f"gap {m.get('train/train_rollout_logprob_abs_diff', float('nan')):.2e}"
