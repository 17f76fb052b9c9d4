"""The GRPO driver loop: each line is a call into a component (docs/architecture.md).

hpcrl run experiments/quickstart.yaml [--run-dir DIR] [key=value ...]

Synchronous and asynchronous runs are one loop: where a step's groups come from is the run's `StepGroups`
(hpcrl/run/groups.py: generated and scored in the step, or collected from a producer beside the trainer). The
publisher owns the push cadence (`publisher.due`), the run state the checkpoint cadence (`state.due`).
"""

from __future__ import annotations

from pathlib import Path

from hpcrl.run.run import Run
from hpcrl.run_config import RunConfig
from hpcrl.samples.versions import INITIAL_VERSION
from hpcrl.slurm.env import LaunchEnv
from hpcrl.store.progress import StepTimer
from hpcrl.store.run_dir import finished_run


def run(cfg: RunConfig, run_dir: Path, *, slurm: LaunchEnv | None = None, restart: bool = False) -> int:
    """Run (or resume) GRPO in run_dir (restart: move its old contents aside first); returns the exit code."""
    # A finished local run stops here, before any engine or trainer starts. In a Slurm job the other tasks
    # (engine nodes, trainer ranks) wait for this process's done marker and STOP, so it takes the usual way.
    if slurm is None and not restart and finished_run(run_dir, cfg) is not None:
        print(f"{run_dir} already finished all {cfg.num_steps} steps; use a new --run-dir for a new run", flush=True)
        return 0
    with Run(cfg, run_dir, slurm=slurm, restart=restart) as r:
        start = r.resume()
        if start >= cfg.num_steps > 0:
            r.progress.say(f"{run_dir} already finished all {cfg.num_steps} steps; use a new --run-dir for a new run")
            return 0
        if r.warm_start.run():
            r.publisher.publish(INITIAL_VERSION)  # no GRPO step is behind the warm start's weights
        if r.preempt_signal is not None:  # it came during the warm start
            return r.on_preempt()
        r.groups.start()
        for step in range(start, cfg.num_steps):
            r.guard.wait_until_cool(step)
            timer = StepTimer()
            served = r.publisher.version  # the weights this step's rollout is generated with (async: starts with)
            groups = r.groups.take(step, timer)
            if groups is None:  # a preemption signal came while the groups were made or awaited
                return r.on_preempt()
            with timer.phase("train"):
                train = r.train(groups)
            r.groups.trained(step)
            sync: dict[str, float] = {}
            if r.publisher.due(step):
                with timer.phase("sync"):
                    sync = r.groups.publish(step + 1)
            with timer.phase("eval"):  # async: beside the producer's requests, with seeds and ids of its own
                evals = r.evaluate(step)
            metrics = r.step_metrics(groups, rollout_s=timer.seconds["rollout"], rollout_version=served)
            metrics |= train | sync | evals | r.groups.pop_metrics() | r.guard.metrics()
            with timer.phase("checkpoint"):
                if r.state.due(step):
                    r.state.save(step, metrics | timer.metrics())
                    r.groups.checkpointed()
            metrics |= timer.metrics()
            r.record_step(step, metrics)
            if r.preempt_signal is not None:
                return r.on_preempt()
        r.finish()
    return 0
