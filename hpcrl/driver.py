"""The GRPO driver loop: each line is a call into a component (docs/architecture.md).

hpcrl run experiments/quickstart.yaml [--run-dir DIR] [key=value ...]
"""

from __future__ import annotations

import json
from pathlib import Path

from hpcrl.rollout.producer import AsyncRollout
from hpcrl.run.session import RunSession
from hpcrl.run_config import RunConfig
from hpcrl.slurm.env import LaunchEnv
from hpcrl.store.progress import StepTimer
from hpcrl.store.run_dir import write_file_atomically


def run(cfg: RunConfig, run_dir: Path, *, slurm: LaunchEnv | None = None, restart: bool = False) -> int:
    """Run (or resume) GRPO in run_dir (restart: move its old contents aside first); returns the exit code."""
    with RunSession(cfg, run_dir, slurm=slurm, restart=restart) as s:
        start = s.resume()
        if start >= cfg.num_steps > 0:
            s.progress.say(f"{run_dir} already finished all {cfg.num_steps} steps; use a new --run-dir for a new run")
            return 0
        if s.warm_start.run():
            s.publisher.publish("sft")
        if s.preempt_signal is not None:  # it came during the warm start
            return s.on_preempt()
        if s.async_rollout is not None:
            return run_async(s, start)
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


def run_async(s: RunSession, start: int) -> int:
    """rollout.mode=async: the producer generates while the trainer trains (hpcrl/rollout/producer.py)."""
    cfg, rollout = s.cfg, s.async_rollout
    assert rollout is not None
    ledger_path = s.run_dir / "prompt_ledger.json"
    rollout.start()
    for step in range(start, cfg.num_steps):
        s.guard.wait_until_cool(step)
        timer = StepTimer()
        served = s.publisher.version  # what the engines serve as this step collects
        with timer.phase("rollout"):
            groups = rollout.collect(step, interrupted=lambda: s.preempt_signal is not None)
        if groups is None:  # a preemption signal came while the trainer waited for groups
            return _preempt_async(s, ledger_path)
        with timer.phase("train"):
            train = s.train(groups)
        rollout.commit(step)
        sync: dict[str, float] = {}
        if (step + 1) % cfg.sync.every_steps == 0 or step + 1 == cfg.num_steps:
            with timer.phase("sync"):
                sync = rollout.publish(str(step + 1))
        with timer.phase("eval"):  # beside the producer's requests, with seeds and ids of its own
            evals = s.evaluate(step)
        metrics = s.step_metrics(groups, rollout_s=timer.seconds["rollout"], rollout_version=served)
        metrics |= train | sync | evals | rollout.pop_metrics() | s.guard.metrics()
        with timer.phase("checkpoint"):
            if s.state.due(step):
                s.state.save(step, metrics | timer.metrics())
                _write_ledger(rollout, ledger_path)
        metrics |= timer.metrics()
        s.record_step(step, metrics)
        if s.preempt_signal is not None:
            return _preempt_async(s, ledger_path)
    _write_json(ledger_path, rollout.finish())
    s.finish()
    return 0


def _preempt_async(s: RunSession, ledger_path: Path) -> int:
    assert s.async_rollout is not None
    s.async_rollout.stop()
    code = s.on_preempt()
    _write_ledger(s.async_rollout, ledger_path)
    return code


def _write_ledger(rollout: AsyncRollout, path: Path) -> None:
    """The ledger of the checkpoint just written, where a user (or a test) can read it."""
    ledger = rollout.saved_ledger()
    if ledger is not None:
        _write_json(path, ledger)


def _write_json(path: Path, data: dict) -> None:
    # A reader sees the previous ledger or this one, never half of one; a link planted at either name is refused.
    write_file_atomically(path, json.dumps(data).encode())
