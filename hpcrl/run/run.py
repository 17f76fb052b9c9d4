"""Run: every part of a run built from its config, wired, and closed in order.

It validates what the user gave before anything is written to the run dir, claims the dir (one writer),
starts the trainer ranks and the engines where the placement says, and registers every stateful part with
the run state. The driver (hpcrl/driver.py) calls the parts directly; what is left here are the run's own
decisions: the step's metrics row, preemption, the end of the run.
"""

from __future__ import annotations

import json
import platform
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

from hpcrl import preemption
from hpcrl.config import dump_yaml, to_dict
from hpcrl.engine.fleet import EngineFleet, FleetError
from hpcrl.engine.sglang import check_routed_experts_capture
from hpcrl.guard import Guard, OffGuard, ThermalGuard, open_source
from hpcrl.model.hf import check_model_dir
from hpcrl.model.moe import replayed_routes_shape
from hpcrl.model.prepare import prepare_model_dir
from hpcrl.rollout.buffer import load_filter
from hpcrl.rollout.data import PromptSource, build_examples, source_options
from hpcrl.rollout.dynamic import DynamicSampler
from hpcrl.rollout.episodes import EpisodeRollout
from hpcrl.rollout.evaluate import Evaluator
from hpcrl.rollout.generate import PromptFormatter, Rollout, rollout_stats
from hpcrl.rollout.producer import AsyncRollout
from hpcrl.rollout.scoring import RewardScorer
from hpcrl.rollout.teacher import Teacher
from hpcrl.run.claim import RunDirClaim
from hpcrl.run.groups import AsyncGroups, StepGroups, SyncGroups
from hpcrl.run.placement import Placement
from hpcrl.run.prepare import check_devices, git_commit, held_out, sft_batches
from hpcrl.run.step_batch import step_batch
from hpcrl.run.teacher_start import check_teacher, start_teacher_aside
from hpcrl.run.weights import join_watcher, weight_publisher
from hpcrl.run_config import RunConfig
from hpcrl.samples.sample import Group
from hpcrl.sessions.environment import environment_class
from hpcrl.slurm.env import LaunchEnv
from hpcrl.store.metrics import MetricsWriter
from hpcrl.store.progress import Progress
from hpcrl.store.run_dir import ResumePoint
from hpcrl.store.run_state import JsonState, RngState, RunState
from hpcrl.store.sinks import open_sinks
from hpcrl.sync.publisher import WeightPublisher
from hpcrl.trainer.ranks import RankGroup
from hpcrl.trainer.warm_start import WarmStart

RECOMPUTE_HIDDEN_KEYS = (
    "train/train_rollout_logprob_abs_diff",
    "train/train_rollout_logprob_max_abs_diff",
    "train/train_rollout_kl",
)
"""NaN under engine.logprobs: recompute (see Run.train)."""


class Run:
    trainer: RankGroup
    store: MetricsWriter
    state: RunState
    fleet: EngineFleet
    rollout: Rollout | EpisodeRollout
    publisher: WeightPublisher
    rewards: RewardScorer
    warm_start: WarmStart
    data: PromptSource
    evaluator: Evaluator | None = None  # single-turn runs only
    teacher: Teacher | None = None  # distill runs only
    formatter: PromptFormatter
    groups: StepGroups  # where a step's groups come from: made in the step (sync) or by a producer (async)

    def __init__(self, cfg: RunConfig, run_dir: Path, *, slurm: LaunchEnv | None = None, restart: bool = False) -> None:
        self.cfg, self.run_dir, self.slurm, self.restart = cfg, run_dir, slurm, restart
        self.progress = Progress(cfg.num_steps)
        self.placement = Placement(cfg, run_dir, slurm=slurm, progress=self.progress)
        self.guard: Guard = OffGuard()
        self._closers: list[Any] = []
        # The last row logged and whether the trainer has moved past it (then it cannot be checkpointed).
        self._last_logged: tuple[int, dict[str, float]] | None = None
        self._stop_recorded = False
        self._trained_past_last_logged = False
        self._prompt_ids_shown = False
        self.claim: RunDirClaim | None = None
        preemption.watch()

    # ----- setup -----
    def __enter__(self) -> Run:
        try:
            self._build()
        except BaseException as exc:
            self.__exit__(type(exc), exc, None)  # shut down what was started; a refused run touched nothing
            raise
        return self

    def _build(self) -> None:
        cfg, say = self.cfg, self.progress.say
        # Validate everything the user gave (guard, devices, model, data, reward) before the run dir is touched.
        guard_source = open_source(cfg.guard, warn=say)
        check_devices(cfg, engines_here=self.placement.engines_here)
        model_dir = prepare_model_dir(Path(cfg.model.path), cfg.model.init_tiny)
        check_model_dir(model_dir)
        routes_shape = replayed_routes_shape(model_dir, cfg.train.routing_replay)
        d = cfg.data
        examples = build_examples(
            d.source,
            **source_options(
                d.source, num_examples=d.num_examples, digits=d.digits, seed=cfg.seed,
                prompt_key=d.prompt_key, answer_key=d.answer_key,
            ),
        )  # fmt: skip
        eval_examples = held_out(cfg, examples)
        if cfg.distill is not None:
            check_teacher(cfg.distill, model_dir, self.placement.engines_here, cfg.reward.fn, self.progress.say)
        multi_turn = cfg.rollout.kind == "multi_turn"
        self.rewards = RewardScorer(
            cfg.reward, interrupted=self._preempted, on_stop=self._record_stop, by_environment=multi_turn
        )
        load_filter(cfg.buffer.filter)  # a bad buffer.filter is refused before the run dir is touched
        if multi_turn:
            environment_class(cfg.rollout.environment or "calculator")  # so is a bad rollout.environment
        from transformers import AutoTokenizer

        self.formatter = formatter = PromptFormatter(AutoTokenizer.from_pretrained(model_dir), cfg.data)
        formatter.check_encodable(examples, source=cfg.data.source, answers=cfg.sft.num_steps > 0)
        self.data = PromptSource(
            examples, batch_size=cfg.data.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle
        )
        resume_point = self._claim_run_dir()
        self.store = MetricsWriter(
            self.run_dir / "metrics.h5",
            root_attrs={
                "config": dump_yaml(cfg),
                "versions": json.dumps({"python": platform.python_version(), "torch": torch.__version__}),
                "git_commit": git_commit(),
                "hosts": json.dumps([socket.gethostname()]),
            },
            sinks=open_sinks(  # logging: TensorBoard, wandb, MLflow
                cfg.logging, self.run_dir, run_name=cfg.name, params=to_dict(cfg), draw_plots=_report_plots, say=say
            ),
        )
        self._closers.append(self.store.close)
        teacher = None
        if cfg.distill is not None:
            teacher = start_teacher_aside(
                cfg.distill, self.run_dir, seed=cfg.seed, timeout_s=cfg.rollout.request_timeout_s,
                say=self.progress.say, on_event=self._engine_event, closers=self._closers,
            )  # fmt: skip
        self.trainer = self.placement.start_trainer(model_dir)
        self._closers.append(self.trainer.close)
        clients = self.placement.start_engines(model_dir)
        self._closers.append(self.placement.stop_engines)
        if routes_shape is not None:
            check_routed_experts_capture(clients, replay=cfg.train.routing_replay)
        self.fleet = EngineFleet(cfg.engine, clients, launcher=self.placement.launcher, on_event=self._engine_event)
        self._closers.append(self.fleet.close)
        if teacher is not None:
            self.teacher = teacher.result()
        self.publisher = weight_publisher(
            cfg, self.placement, clients, self.fleet, lambda: self.trainer, self.run_dir, on_event=self._event,
            closers=self._closers,
        )  # fmt: skip
        self.publisher.joins = join_watcher(cfg, model_dir, self.run_dir, self._engine_event, self._closers)
        if multi_turn:
            self.rollout = EpisodeRollout(
                cfg.rollout, self.fleet, model_dir=model_dir, tokenizer=formatter.tokenizer, seed=cfg.seed,
                recover=self.publisher.restore_engines, routes_shape=routes_shape,
            )  # fmt: skip
            self._closers.append(self.rollout.close)
        else:
            rollout = Rollout(
                cfg.rollout, self.fleet, formatter, seed=cfg.seed, recover=self.publisher.restore_engines,
                routes_shape=routes_shape,
            )  # fmt: skip
            self._closers.append(rollout.close)
            self.rollout = rollout
            self.evaluator = Evaluator(
                cfg.eval, rollout, self.rewards.fn, eval_examples, num_steps=cfg.num_steps,
                timeout_s=cfg.reward.timeout_s,
            )  # fmt: skip
        if guard_source is not None:
            guard = ThermalGuard(cfg.guard, guard_source, say=say, interrupted=self._preempted)
            pids = self.placement.local_engine_pids() + self.trainer.pids
            self.guard = guard.start(engines=clients, pids=pids, on_event=self.store.event)
        self.warm_start = WarmStart(
            cfg.sft, self.trainer, sft_batches(cfg, formatter, examples), guard=self.guard, say=say,
            on_event=self._event, interrupted=self._preempted,
        )  # fmt: skip
        self.state = RunState(
            self.run_dir, self.store, every_steps=cfg.checkpoint.every_steps, keep_last=cfg.checkpoint.keep_last,
            num_steps=cfg.num_steps, say=say, check_weights=self.publisher.check_finite,
        )  # fmt: skip
        self._closers.append(self.state.close)  # before the parts it saves close, and the run-dir lock
        self.state.register("trainer", self.trainer)
        self.state.register("rng", RngState())
        self.state.register("data", JsonState(self.data.state, self.data.load_state))
        self.state.register("weights", self.publisher)
        self.state.register("warm_start", self.warm_start)
        if cfg.rollout.mode == "async":
            producer = AsyncRollout(
                cfg.rollout, cfg.buffer, self.fleet, formatter, self.data, self.rewards, self.publisher,
                seed=cfg.seed, prompts_per_step=cfg.data.prompts_per_step,
                max_inflight_groups=cfg.inflight_groups, capacity_groups=cfg.capacity_groups, num_steps=cfg.num_steps,
                routes_shape=routes_shape,
            )  # fmt: skip
            self._closers.append(producer.close)
            self.state.register("rollout_buffer", producer)
            self.groups = AsyncGroups(producer, self.run_dir, interrupted=self._preempted)
        else:
            dynamic = None
            if cfg.rollout.dynamic_sampling:
                dynamic = DynamicSampler(
                    self.data, prompts_per_step=cfg.data.prompts_per_step,
                    max_batches=cfg.rollout.dynamic_sampling_max_batches,
                )  # fmt: skip
            self.groups = SyncGroups(self.rollout, self.rewards, self.data, self.publisher, dynamic)
        self._resume_point = resume_point

    def _claim_run_dir(self) -> ResumePoint:
        """Lock the run dir, then decide, before anything is written, whether this config may run there."""
        self.claim = RunDirClaim(self.run_dir, job_id=self.placement.incarnation.job_id, say=self.progress.say)
        self._closers.insert(0, self.claim.close)  # last to close: nothing writes run_dir after it
        return self.claim.check(self.cfg, restart=self.restart)

    # ----- the run's own decisions -----
    def resume(self) -> int:
        """Load every part from the latest valid checkpoint (if any), give the engines its weights, and
        return the first step to run."""
        point, self._resume_point = self._resume_point, ResumePoint()  # do not hold its tensors twice
        step = self.state.resume(point)
        if step is None:
            return 0
        # With sync.every_steps > 1 the engines served an older version than the trainer's weights: label the
        # weights pushed now with their own version (the number of optimizer steps behind them).
        self.publisher.publish(self.publisher.version if self.cfg.sync.every_steps == 1 else step + 1)
        return step + 1

    def train(self, groups: list[Group]) -> dict[str, float]:
        """One trainer step on the scored groups; colocated engines lend their memory meanwhile."""
        self.publisher.lend_memory()
        self._show_prompt_ids(groups)
        self._trained_past_last_logged = True
        batch, distilled = step_batch(self.cfg, groups, self.teacher)
        m = self.trainer.train_grpo(batch)
        out = distilled | {f"train/{k}": v for k, v in m.items() if k != "forward_s"}
        out["timing/logprob_s"] = m.get("forward_s", 0.0)
        if self.cfg.engine.logprobs == "recompute":
            # The engines reported a re-score, not the log-probs they sampled with: trainer vs re-score is
            # no measure of the sampling gap, so it is not shown as one (rollout/recompute_abs_diff is).
            for key in RECOMPUTE_HIDDEN_KEYS:
                if key in out:
                    out[key] = float("nan")
        return out

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluation's figures when it is due after `step` (the engines serve the step's new weights)."""
        if self.evaluator is None or not self.evaluator.due(step):
            return {}
        return self.evaluator.run(step)

    def _show_prompt_ids(self, groups: list[Group]) -> None:
        """Once per process: the ids the policy is trained on, so a missing (or doubled) BOS is seen at once."""
        if self._prompt_ids_shown or not groups or not groups[0].samples:
            return
        self._prompt_ids_shown = True
        ids = groups[0].samples[0].prompt_ids
        add = str(self.cfg.data.add_special_tokens).lower()
        shown = self.formatter.describe(ids)
        # The run's log, not an event: every resumed process shows it again; events keep the run's own history.
        self.progress.detail(f"first prompt of this step as token ids (data.add_special_tokens={add}): {shown}")

    def step_metrics(self, groups: list[Group], *, rollout_s: float, rollout_version: int) -> dict[str, float]:
        """The rollout's and the fleet's figures of this step (reading the fleet's counters resets them)."""
        stats = rollout_stats(groups, rollout_s, version=rollout_version)
        return stats | self.rollout.pop_metrics() | self.fleet.pop_metrics()

    def record_step(self, step: int, row: dict[str, float]) -> None:
        """Log the step's row (after its checkpoint: a resume re-logs a row the process died before logging)."""
        self.store.log(step, row)
        self._last_logged, self._trained_past_last_logged = (step, row), False
        if row.get("train/nan_skipped"):
            detail = {"loss": row.get("train/loss"), "grad_norm": row.get("train/grad_norm")}
            self.store.event("nan_skipped", step=step, detail=detail)
        self.progress.step(step, row)

    @property
    def preempt_signal(self) -> int | None:
        """SIGTERM/SIGUSR2 received since the process started (the loop checkpoints at its next safe point)."""
        return preemption.received()

    def _preempted(self) -> bool:
        return self.preempt_signal is not None

    def on_preempt(self) -> int:
        """Checkpoint the last finished step (unless the trainer moved past it) and say how to exit."""
        self.groups.stop()
        finished = None if self._trained_past_last_logged else self._last_logged
        if finished is not None:
            self.state.save(*finished)
        self.state.wait()  # the checkpoint is on disk before the job is requeued
        self.groups.checkpointed()
        step = finished[0] if finished else None
        name = signal.Signals(self.preempt_signal or signal.SIGTERM).name
        job_id = self.placement.incarnation.job_id
        self.store.event("preempted", step=step, detail={"signal": name, "job_id": job_id})
        saved = f"checkpointed step {step + 1}" if step is not None else "the last checkpoint holds the last step"
        if self.slurm and self.slurm.scheduler == "slurm":  # an mpiexec launch has no job to requeue
            # The requeued job (same id, SLURM_RESTART_COUNT + 1) resumes from this checkpoint.
            out = subprocess.run(["scontrol", "requeue", self.slurm.job_id], capture_output=True, text=True)
            self.progress.say(
                f"received {name}: {saved}; scontrol requeue {self.slurm.job_id}: "
                + ("ok" if out.returncode == 0 else f"failed ({out.stderr.strip()})")
            )
            return 0 if out.returncode == 0 else 1
        self.progress.say(f"received {name}: {saved}; rerun the same command to resume")
        return 128 + int(self.preempt_signal or signal.SIGTERM)

    def finish(self) -> None:
        self.groups.finish()
        self.state.wait()  # a failed last checkpoint is the error to report, before the export
        out = self.trainer.export(self.run_dir / "model")
        last = self.cfg.num_steps - 1 if self.cfg.num_steps else None
        self.store.event("finished", step=last, detail={"model": str(out)})
        self.progress.say(f"done: policy exported to {out}; metrics in {self.run_dir / 'metrics.h5'}")

    def _event(self, kind: str, detail: dict[str, Any]) -> None:
        self.store.event(kind, step=None, detail=detail)

    def _engine_event(self, kind: str, detail: dict[str, Any]) -> None:
        self.store.event(kind, step=None, detail=detail)
        self.progress.say(f"{kind}: {detail}")

    def _record_stop(self, step: int, detail: dict[str, Any]) -> None:
        self.store.event("stopped", step=step, detail=detail)
        self._stop_recorded = True  # the run stepped and says why it stopped: not a failed start

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self.claim is not None and exc is not None and self._last_logged is None and not self._stop_recorded:
            self.claim.failed_start = True  # its close leaves the run dir as this start found it
        if isinstance(exc, FleetError) and self._last_logged and not self._trained_past_last_logged:
            # An engine failure stops the run; keep the last finished step.
            try:
                step, row = self._last_logged
                self.state.save(step, row)
                self.state.wait()
                self.progress.say(f"{type(exc).__name__}: checkpointed step {step + 1}; fix the cause and rerun")
            except Exception as err:  # noqa: BLE001 - the original failure is what the user must see
                self.progress.say(f"warning: could not checkpoint before stopping: {err}")
        # The guard first (stopped workers must get SIGCONT before they are shut down), then the parts in
        # reverse order of their start; the run-dir lock last.
        for closer in [self.guard.stop, *reversed(self._closers)]:
            try:
                closer()
            except Exception as err:  # noqa: BLE001 - shutting down: report, keep closing the rest
                self.progress.say(f"warning during shutdown: {err}")
        self._closers = []


def _report_plots(run_dir: Path) -> list[Path]:
    """The report's plots, drawn for the logging sinks at the end of the run."""
    from hpcrl.report.build import build_report

    return list(build_report(run_dir).plots)
