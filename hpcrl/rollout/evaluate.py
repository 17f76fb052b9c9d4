"""Evaluation during training: greedy accuracy, pass@k and mean@k on held-out prompts.

It draws from the engines with seeds and request ids of its own (namespace "eval/"), scores with the run's
reward, and feeds nothing back into training: the data order, the training samples' seeds and the trainer's
random state are untouched, so a run with evaluation trains exactly as one without, and a resumed run stays
bitwise equal. A sample counts as correct when its reward is at least 1.0 (rewards in [0, 1], 1 = right).
"""

from __future__ import annotations

from collections.abc import Sequence

from hpcrl.rollout.config import EvalConfig
from hpcrl.rollout.generate import Draw, Rollout
from hpcrl.rollout.rewards import RewardFn, score
from hpcrl.samples.sample import DataError, Example, Group

CORRECT_REWARD = 1.0


def held_out_examples(cfg: EvalConfig, training: Sequence[Example], built: Sequence[Example]) -> list[Example]:
    """The first cfg.num_prompts of `built` whose prompt is not a training prompt (held out by construction
    when `built` comes from the training generator with another seed)."""
    seen = {e.prompt for e in training}
    held = [e for e in built if e.prompt not in seen][: cfg.num_prompts]
    if not held:
        raise DataError(
            "evaluation has no held-out prompt: every generated eval prompt is also a training prompt; set "
            "eval.source to a held-out file or raise data.digits"
        )
    return held


class Evaluator:
    def __init__(
        self, cfg: EvalConfig, rollout: Rollout, reward: RewardFn, examples: Sequence[Example], *,
        num_steps: int, timeout_s: float,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.rollout = rollout
        self.reward = reward
        self.examples = list(examples)
        self.num_steps = num_steps
        self.timeout_s = timeout_s

    def due(self, step: int) -> bool:
        every = self.cfg.every_steps
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.num_steps)

    def run(self, step: int) -> dict[str, float]:
        """Evaluate the weights the engines serve now (after step `step`'s push)."""
        tokens = self.cfg.max_new_tokens
        greedy_draw = Draw(n_samples=1, temperature=0.0, max_new_tokens=tokens, namespace="eval-greedy/")
        greedy = self.rollout.generate(step, self.examples, greedy_draw)
        sampled_draw = Draw(n_samples=self.cfg.num_samples, max_new_tokens=tokens, namespace="eval/")
        sampled = self.rollout.generate(step, self.examples, sampled_draw)
        g = self._rewards(greedy)
        k = self._rewards(sampled)
        return {
            "eval/accuracy_greedy": sum(r[0] >= CORRECT_REWARD for r in g) / len(g),
            "eval/pass_at_k": sum(any(x >= CORRECT_REWARD for x in r) for r in k) / len(k),
            "eval/mean_at_k": sum(sum(r) / len(r) for r in k) / len(k),
            "eval/num_prompts": float(len(g)),
            "eval/k": float(self.cfg.num_samples),
        }

    def _rewards(self, groups: list[Group]) -> list[list[float]]:
        """Rewards per prompt; a sample whose reward failed counts as wrong (0.0)."""
        responses = [s.text for grp in groups for s in grp.samples]
        answers = [grp.example.answer for grp in groups for _ in grp.samples]
        metas = [grp.example.meta for grp in groups for _ in grp.samples]
        result = score(self.reward, responses, answers, metas=metas, timeout_s=self.timeout_s)
        flat = [0.0 if e is not None else r for r, e in zip(result.rewards, result.errors, strict=True)]
        out, i = [], 0
        for grp in groups:
            out.append(flat[i : i + len(grp.samples)])
            i += len(grp.samples)
        return out
