"""The GRPO driver loop: each line is a call into a component (DESIGN.md §2).

hpcrl run experiments/quickstart.yaml [--run-dir DIR] [key=value ...]
"""

from __future__ import annotations

from pathlib import Path

from hpcrl.run.session import RunSession
from hpcrl.run_config import RunConfig
from hpcrl.slurm.env import LaunchEnv
from hpcrl.store.progress import StepTimer


def run(cfg: RunConfig, run_dir: Path, *, slurm: LaunchEnv | None = None, restart: bool = False) -> int:
    """Run (or resume) GRPO in run_dir (restart: move its old contents aside first); returns the exit code."""
    with RunSession(cfg, run_dir, slurm=slurm, restart=restart) as s:
        start = s.resume()
        if start >= cfg.num_steps > 0:
            s.progress.say(f"{run_dir} already finished all {cfg.num_steps} steps; use a new --run-dir for a new run")
            return 0
        if s.warm_start.run():
            s.publisher.publish("sft")
        for step in range(start, cfg.num_steps):
            s.guard.wait_until_cool(step)
            timer = StepTimer()
            served = s.publisher.version  # the weights this step's rollout is generated with
            with timer.phase("rollout"):
                groups = s.rollout.generate(step, s.data.batch(step))
            with timer.phase("reward"):
                scored = s.rewards.score(step, groups)
            if scored is None:  # a preemption signal came while a reward was still running
                return s.on_preempt()
            with timer.phase("train"):
                train = s.train(groups)
            with timer.phase("sync"):
                sync = s.publisher.publish(str(step + 1))
            with timer.phase("eval"):
                evals = s.evaluate(step)
            metrics = s.step_metrics(groups, rollout_s=timer.seconds["rollout"], rollout_version=served)
            metrics |= train | sync | evals | s.guard.metrics()
            with timer.phase("checkpoint"):
                if s.state.due(step):
                    s.state.save(step, metrics | timer.metrics())
            metrics |= timer.metrics()
            s.record_step(step, metrics)
            if s.preempt_signal is not None:
                return s.on_preempt()
        s.finish()
    return 0
