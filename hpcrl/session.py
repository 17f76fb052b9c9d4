"""Everything a run holds besides its loop: components built from the config, resume, checkpoints, export.

The driver (hpcrl/driver.py) only calls into this and into the components it builds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpcrl import preemption
from hpcrl.config import dump_yaml
from hpcrl.engine.fleet import EngineFleet, FleetError
from hpcrl.engine.local import Incarnation, LocalEngines, done_marker, wait_for_rendezvous
from hpcrl.guard import Guard, OffGuard, ThermalGuard, open_source
from hpcrl.model.hf import check_model_dir
from hpcrl.rollout.config import RewardConfig
from hpcrl.rollout.data import PromptSource, build_examples
from hpcrl.rollout.generate import Group, PromptFormatter, Rollout, rollout_stats
from hpcrl.rollout.rewards import RewardError, ScoreResult, ScoringInterrupted, check_failures, load_reward, score
from hpcrl.run_config import RunConfig
from hpcrl.slurm.env import SlurmEnv
from hpcrl.store.checkpoint import (
    CheckpointError,
    capture_rng_state,
    remove_temp_files,
    restore_rng_state,
    save_checkpoint,
)
from hpcrl.store.metrics import MetricsWriter
from hpcrl.store.progress import Progress
from hpcrl.store.run_dir import (
    ResumePoint,
    RunDirLock,
    check_can_continue,
    find_resume_point,
    inspect_run_dir,
    keep_unreadable,
    set_aside,
)
from hpcrl.sync.push import WeightSync, WeightSyncError
from hpcrl.trainer.advantage import group_advantages
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.ranks import RankGroup, build_trainer, init_trainer_group, spawn_followers
from hpcrl.trainer.step_stats import NonFiniteWeightsError, first_non_finite

OFFLOAD_TAGS = ["kv_cache", "weights"]


class RunError(RuntimeError):
    """A run cannot go on; the message says why and what to do."""


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def prepare_model(cfg: RunConfig) -> Path:
    """The model dir, created first when model.init_tiny asks for it (under a lock: in a Slurm job every
    node's roles may get here at once)."""
    import fcntl

    path = Path(cfg.model.path)
    if (path / "config.json").is_file() or cfg.model.init_tiny is None:
        return _create_model_if_missing(cfg, path)  # refuses a missing model without writing a lock file
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _create_model_if_missing(cfg, path)


def _create_model_if_missing(cfg: RunConfig, path: Path) -> Path:
    if not (path / "config.json").is_file():
        if cfg.model.init_tiny is None:
            raise RunError(
                f"model.path {path} has no config.json: point it at a Hugging Face model directory, or set "
                "model.init_tiny to create a tiny model there"
            )
        from hpcrl.model.tiny import init_tiny_model

        init_tiny_model(path, cfg.model.init_tiny, overwrite=path.exists() and not any(path.iterdir()))
    return path


def check_devices(cfg: RunConfig, *, engines_here: bool) -> None:
    """A CUDA device the config names must exist on this machine (checked here, not at config load:
    `hpcrl sbatch` renders GPU configs on machines without one)."""
    keys = [("train.device", cfg.train.device)] + ([("engine.device", cfg.engine.device)] if engines_here else [])
    for key, device in keys:
        if not device.startswith("cuda"):
            continue
        try:
            index = torch.device(device).index or 0
        except RuntimeError as exc:
            raise RunError(f"{key}={device!r} is not a device name ({exc}); use cpu, cuda or cuda:N") from None
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= num_gpus:
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise RunError(
                f"{key}={device} but this machine shows {num_gpus} CUDA device(s) to torch {torch.__version__} "
                f"({build}); set {key}=cpu, or run on a GPU node with a CUDA build of torch"
            )


class Rewards:
    """Scores a step's samples; a stop for too many failures is recorded (`on_stop`) before it is raised."""

    def __init__(
        self,
        cfg: RewardConfig,
        *,
        interrupted: Callable[[], bool],
        on_stop: Callable[[int, dict[str, Any]], None],
    ) -> None:
        self.fn = load_reward(cfg.fn)
        self.cfg = cfg
        self.interrupted = interrupted
        self.on_stop = on_stop

    def score(self, step: int, groups: list[Group]) -> ScoreResult | None:
        """Score the groups in place; None when a preemption signal came while a reward was running."""
        samples = [s for g in groups for s in g.samples]
        answers = [g.example.answer for g in groups for _ in g.samples]
        try:
            result = score(
                self.fn, [s.text for s in samples], answers, timeout_s=self.cfg.timeout_s, interrupted=self.interrupted
            )
        except ScoringInterrupted:
            return None
        for s, r, e in zip(samples, result.rewards, result.errors, strict=True):
            s.reward, s.reward_error = r, e
        try:
            check_failures(result, self.cfg.max_failed_share)
        except RewardError as exc:
            first = next(e for e in result.errors if e is not None)
            self.on_stop(step, {"reason": "reward_failures", "num_failed": result.num_failed, "first_error": first})
            raise RewardError(f"{exc}; the run stops (event 'stopped'): fix the reward and rerun to resume") from None
        return result


def batch_from_groups(groups: list[Group], *, normalize_std: bool) -> TrainBatch:
    rewards = []
    for g in groups:
        valid = [s.reward for s in g.samples if s.reward_error is None]
        fill = sum(valid) / len(valid) if valid else 0.0
        # A sample whose reward failed gets the group mean: advantage 0, so it teaches nothing.
        rewards.append([s.reward if s.reward_error is None else fill for s in g.samples])
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), normalize_std=normalize_std).flatten()
    samples = [s for g in groups for s in g.samples]
    return TrainBatch.from_sequences(
        [s.prompt_ids for s in samples],
        [s.output_ids for s in samples],
        advantages=adv.tolist(),
        rollout_logprobs=[s.logprobs for s in samples],
    )


class RunSession:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        *,
        progress: Progress | None = None,
        slurm: SlurmEnv | None = None,
        restart: bool = False,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.restart = restart
        self._lock: RunDirLock | None = None
        self._resume_point = ResumePoint()
        # In a Slurm job the engines and the other trainer ranks were started by srun; locally we start them.
        self.slurm = slurm
        self.incarnation = Incarnation(slurm.job_id, slurm.restart_count) if slurm else Incarnation()
        if cfg.sync.transport == "mpi" and not slurm:
            # Agents and driver come from one mpiexec launch; its namespace names this incarnation.
            self.incarnation = Incarnation(os.environ.get("PMIX_NAMESPACE", "mpi"), 0)
        self.progress = progress or Progress(cfg.num_steps)
        preemption.watch()
        self._engines: LocalEngines | None = None
        self.sync: WeightSync | None = None
        self.trainer: RankGroup | None = None
        self.store: MetricsWriter | None = None
        self.guard: Guard = OffGuard()
        self.weight_version = "0"
        self.rollout_version = "0"
        self._steps_trained = self._steps_logged = 0
        self._last_logged: tuple[int, dict[str, float]] | None = None
        self.sft_done = False

    # ----- setup -----
    def __enter__(self) -> RunSession:
        try:
            return self._enter()
        except BaseException:
            if self._lock is not None:  # shut down what was started; a refused run touched nothing
                self.__exit__(None, None, None)
            raise

    def _enter(self) -> RunSession:
        # Validate everything the user gave (guard, model, data, reward) before anything is written to run_dir.
        guard_source = open_source(self.cfg.guard, warn=self.progress.say)
        guard = (
            ThermalGuard(self.cfg.guard, guard_source, say=self.progress.say, interrupted=self._preempted)
            if guard_source is not None
            else None
        )
        check_devices(self.cfg, engines_here=not self.slurm and self.cfg.sync.transport != "mpi")
        model_dir = prepare_model(self.cfg)
        check_model_dir(model_dir)
        examples = build_examples(
            self.cfg.data.source,
            **(
                {"num_examples": self.cfg.data.num_examples, "digits": self.cfg.data.digits, "seed": self.cfg.seed}
                if self.cfg.data.source == "addition"
                else {"prompt_key": self.cfg.data.prompt_key, "answer_key": self.cfg.data.answer_key}
            ),
        )
        self.rewards = Rewards(self.cfg.reward, interrupted=self._preempted, on_stop=self._record_stop)
        from transformers import AutoTokenizer

        self.formatter = PromptFormatter(AutoTokenizer.from_pretrained(model_dir), self.cfg.data)
        self.formatter.check_encodable(examples, source=self.cfg.data.source, answers=self.cfg.sft.num_steps > 0)
        self.data = PromptSource(examples, batch_size=self.cfg.data.prompts_per_step, seed=self.cfg.seed)
        self.sft_data = PromptSource(examples, batch_size=self.cfg.sft.batch_size, seed=self.cfg.seed + 1)
        self._claim_run_dir()
        self._write_config()
        self.store = MetricsWriter(
            self.run_dir / "metrics.h5",
            root_attrs={
                "config": dump_yaml(self.cfg),
                "versions": json.dumps({"python": platform.python_version(), "torch": torch.__version__}),
                "git_commit": _git_commit(),
                "hosts": json.dumps([socket.gethostname()]),
            },
        )
        self._start_trainer(model_dir)
        clients = self._start_engines(model_dir)
        self.fleet = EngineFleet(self.cfg.engine, clients, launcher=self._engines, on_event=self._engine_event)
        self.rollout = Rollout(self.cfg.rollout, self.fleet, self.formatter, seed=self.cfg.seed, recover=self.heal)
        colocated = torch.device(self.cfg.engine.device) == torch.device(self.cfg.train.device) and not self.slurm
        sync_cfg = self.cfg.sync
        if self.slurm:
            # Engines on other nodes must reach the group's store on this node.
            sync_cfg = dataclasses.replace(sync_cfg, master_address=socket.gethostbyname(self.slurm.node_name))
        self.sync = WeightSync(sync_cfg, clients, device=torch.device(self.cfg.train.device), colocated=colocated)
        self.sync.connect()
        if guard is not None:
            assert self.trainer is not None
            local_engines = self._engines.engines if self._engines else []
            pids = [e.proc.pid for e in local_engines] + [p.pid for p in self.trainer.followers]
            self.guard = guard.start(engines=clients, pids=pids, on_event=self.store.event)
        return self

    def _claim_run_dir(self) -> None:
        """Lock the run dir, then decide, before anything is written, whether this config may run there."""
        self._lock = RunDirLock.acquire(self.run_dir, job_id=self.incarnation.job_id)
        if self.restart and (moved := set_aside(self.run_dir)) is not None:
            self.progress.say(f"--restart: moved the previous contents of {self.run_dir} to {moved}")
        self._resume_point = find_resume_point(self.run_dir / "checkpoints")
        ckpt, unreadable = self._resume_point.checkpoint, self._resume_point.unreadable
        step = ckpt.step if ckpt is not None else None
        check_can_continue(inspect_run_dir(self.run_dir), self.cfg, resume_step=step, unreadable=unreadable)
        self._lock.record_owner()

    def _write_config(self) -> None:
        path = self.run_dir / "config.yaml"
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(dump_yaml(self.cfg))
        os.replace(tmp, path)

    def _start_engines(self, model_dir: Path) -> list:  # type: ignore[type-arg]
        n = self.cfg.engine.num_engines
        if self.cfg.sync.transport == "mpi":
            from hpcrl.sync.mpi import mpi_world

            mpi_world()  # MPI_Init is collective with the agents: join it before waiting on them
        if (self.slurm and self.slurm.engines_elsewhere) or self.cfg.sync.transport == "mpi":
            job = self.incarnation.job_id
            self.progress.say(f"waiting for {n} engine(s) of job {job} to write run_dir/engines/*.json")
            return wait_for_rendezvous(self.run_dir, n, self.incarnation, timeout_s=self.cfg.engine.startup_timeout_s)
        self._engines = LocalEngines(self.cfg.engine, model_dir, self.run_dir, seed=self.cfg.seed)
        self.progress.say(f"starting {n} embedded engine(s) on {self.cfg.engine.device}")
        return self._engines.start()

    def _start_trainer(self, model_dir: Path) -> None:
        world = self.cfg.train.num_ranks
        followers = []
        if self.slurm:
            if self.slurm.world_size != world:
                raise RunError(
                    f"the trainer step has {self.slurm.world_size} tasks but train.num_ranks={world}; "
                    "make the trainer het group's nodes x tasks per node equal train.num_ranks"
                )
            if world > 1:
                init_trainer_group(
                    rank=0, world_size=world, device=torch.device(self.cfg.train.device),
                    timeout_s=self.cfg.sync.group_timeout_s,
                )  # fmt: skip
        elif world > 1:
            port = _free_port()
            os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            followers = spawn_followers(self.run_dir, world, port)
            init_trainer_group(
                rank=0,
                world_size=world,
                device=torch.device(self.cfg.train.device),
                timeout_s=self.cfg.sync.group_timeout_s,
            )
        trainer = build_trainer(self.cfg.train, model_dir, rank=0, world_size=world, sft_lr=self.cfg.sft.lr)
        self.trainer = RankGroup(trainer, followers)

    @property
    def preempt_signal(self) -> int | None:
        """SIGTERM/SIGUSR2 received since the process started (the loop checkpoints at its next safe point)."""
        return preemption.received()

    def _preempted(self) -> bool:
        return self.preempt_signal is not None

    # ----- resume, warm start -----
    def resume(self) -> int:
        """Load the latest valid checkpoint (if any); returns the first step to run."""
        assert self.store is not None and self.trainer is not None
        ckpt_dir = self.run_dir / "checkpoints"
        for path in remove_temp_files(ckpt_dir) if ckpt_dir.exists() else []:
            self.progress.say(f"removed a partial checkpoint left by an interrupted write: {path.name}")
        ckpt, unreadable = self._resume_point.checkpoint, self._resume_point.unreadable
        self._resume_point = ResumePoint()  # its tensors are loaded below; do not hold them twice
        kept = keep_unreadable(ckpt_dir, list(unreadable))
        for name, reason in unreadable.items():
            kept_as = kept[name].name if name in kept else name
            self.progress.say(f"warning: skipping checkpoint {name}: {reason}; kept as {kept_as}")
            self.store.event("checkpoint_skipped", step=None, detail={"reason": reason, "kept_as": kept_as})
        if ckpt is None:
            self.store.truncate_after(-1)
            return 0
        self.trainer.trainer.load_state(ckpt.tensors, ckpt.state["trainer"])
        self.trainer.load_checkpoint_step(ckpt.step)
        restore_rng_state({k: v for k, v in ckpt.tensors.items() if k.startswith("rng/")}, ckpt.state["rng"])
        self.data.load_state(ckpt.state["data"])
        self.weight_version = ckpt.state["weight_version"]
        self.sft_done = bool(ckpt.state.get("sft_done"))
        self.store.truncate_after(ckpt.step)
        if self.store.last_step != ckpt.step:
            row = dict(zip(ckpt.state["last_row_keys"], ckpt.tensors["last_row"].tolist(), strict=True))
            self.store.log(ckpt.step, row)
        self.push_weights(self.weight_version)
        if ckpt.step + 1 < self.cfg.num_steps:
            # The steps after this resume make the run's end; an earlier `finished` no longer is.
            self.store.rename_events("finished", "finished_superseded")
        self.store.event("resumed", step=ckpt.step, detail={"checkpoint": ckpt.path.name})
        self.progress.say(f"resumed from {ckpt.path} (step {ckpt.step + 1} done); continuing at step {ckpt.step + 2}")
        return ckpt.step + 1

    def warm_start(self) -> None:
        """Supervised steps on (prompt, answer) before GRPO; skipped when done or not configured."""
        sft = self.cfg.sft
        if self.sft_done or sft.num_steps == 0:
            return
        assert self.trainer is not None and self.store is not None
        eos = self.formatter.tokenizer.eos_token_id
        t0 = time.perf_counter()
        for step in range(sft.num_steps):
            self.guard.wait_until_cool(None)
            examples = self.sft_data.batch(step)
            prompts = [self.formatter.encode(e.prompt) for e in examples]
            answers = [self.formatter.tokenizer.encode(e.answer, add_special_tokens=False) + [eos] for e in examples]
            m = self.trainer.train_sft(TrainBatch.from_sequences(prompts, answers))
            if (step + 1) % sft.log_every_steps == 0 or step + 1 == sft.num_steps:
                self.progress.say(
                    f"sft {step + 1:>4}/{sft.num_steps} | loss {m['loss']:.3f} | {time.perf_counter() - t0:.1f} s"
                )
        self.sft_done = True
        self.store.event("sft_done", step=None, detail={"num_steps": sft.num_steps, "loss": m["loss"]})
        self.push_weights("sft")

    def _engine_event(self, kind: str, detail: dict[str, Any]) -> None:
        assert self.store is not None
        self.store.event(kind, step=None, detail=detail)
        self.progress.say(f"{kind}: {detail}")

    def heal(self) -> None:
        """Restart dead engines (bounded) and push them the current weights before they serve again."""
        self.push_weights(self.weight_version)

    def push_weights(self, version: str) -> dict[str, float]:
        """Push to every live engine; dead ones are restarted first, and a push that an engine's death
        breaks is done once more over the engines then alive (all weights: a fresh engine has none)."""
        assert self.sync is not None and self.trainer is not None
        # The version the engines served until now: what this step's rollout was generated with.
        self.rollout_version, self.weight_version = self.weight_version, version
        offloaded = self.cfg.engine.offload_during_train and self.fleet.weights_released
        weights = self.trainer.named_weights()
        self._refuse_non_finite(weights, f"weight version {version}")
        if offloaded:
            self.fleet.resume_memory(["weights"])  # contents are stale until the push below rewrites them
        for attempt in (0, 1):
            if self.fleet.heal() or attempt:
                self.sync.reconnect([s.client for s in self.fleet.live()])
            try:
                pushed = self.sync.push(weights, version)
                if offloaded:
                    self.fleet.resume_memory(["kv_cache"])
                return pushed
            except WeightSyncError:
                if attempt:
                    raise
                self.fleet.probe_all()
        raise AssertionError("unreachable")

    def _refuse_non_finite(self, weights: list[tuple[str, torch.Tensor]], what: str) -> None:
        """NaN or inf weights must reach neither an engine nor a checkpoint: record which, and stop."""
        bad = first_non_finite(weights)
        if bad is None:
            return
        assert self.store is not None
        self.store.event("nan_weights", step=None, detail={"parameter": bad, "what": what})
        raise NonFiniteWeightsError(
            f"parameter {bad!r} of the trainer's {what} holds NaN or inf; it was neither pushed nor checkpointed, "
            f"and the last checkpoint is intact: lower train.lr (now {self.cfg.train.lr:g}), check the rewards and "
            f"that {self.cfg.model.path} holds finite weights, then rerun to resume"
        )

    # ----- per step -----
    def batch(self, groups: list[Group]) -> TrainBatch:
        return batch_from_groups(groups, normalize_std=self.cfg.train.normalize_advantage_std)

    def train(self, groups: list[Group]) -> dict[str, float]:
        """One trainer step on the groups; colocated engines lend their memory meanwhile."""
        assert self.trainer is not None
        released = self.fleet.release_memory(OFFLOAD_TAGS) if self.cfg.engine.offload_during_train else {}
        self._steps_trained += 1
        return self.train_metrics(self.trainer.train_grpo(self.batch(groups))) | released

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        assert self.store is not None
        self.store.log(step, metrics)
        self._steps_logged += 1
        self._last_logged = (step, metrics)

    def _checkpoint_before_failing(self, exc: BaseException) -> None:
        """An engine failure stops the run; keep the last finished step if the trainer has not moved past it."""
        if self._last_logged is None or self._steps_trained != self._steps_logged:
            return
        step, row = self._last_logged
        self.checkpoint(step, row, force=True)
        self.progress.say(f"{type(exc).__name__}: checkpointed step {step + 1}; fix the cause and rerun to resume")

    def train_metrics(self, m: dict[str, float]) -> dict[str, float]:
        out = {f"train/{k}": v for k, v in m.items() if k not in ("forward_s",)}
        out["timing/logprob_s"] = m.get("forward_s", 0.0)
        return out

    def step_metrics(self, groups: list[Group], rollout_s: float) -> dict[str, float]:
        return rollout_stats(groups, rollout_s, version=self.rollout_version) | self.fleet.metrics()

    def checkpoint(self, step: int, row: dict[str, float], *, force: bool = False) -> bool:
        """Save on the configured cadence. The step's metrics row goes into the checkpoint too: it is
        logged only after the save, and a resume re-logs it if the process died in between."""
        every = self.cfg.checkpoint.every_steps
        if not force and (step + 1) % every and step + 1 != self.cfg.num_steps:
            return False
        assert self.trainer is not None and self.store is not None
        self.store.flush()
        tensors, trainer_state = self.trainer.state()
        model_tensors = [(k, v) for k, v in tensors.items() if k.startswith("model/")]
        self._refuse_non_finite(model_tensors, f"step {step + 1} weights")
        rng_tensors, rng_state = capture_rng_state()
        tensors.update(rng_tensors)
        keys = sorted(row)
        tensors["last_row"] = torch.tensor([row[k] for k in keys], dtype=torch.float64)
        state: dict[str, Any] = {
            "last_row_keys": keys,
            "trainer": trainer_state,
            "rng": rng_state,
            "data": self.data.state(),
            "weight_version": self.weight_version,
            "sft_done": self.sft_done,
        }
        try:
            save_checkpoint(self.run_dir / "checkpoints", step, tensors, state, keep_last=self.cfg.checkpoint.keep_last)
        except CheckpointError as exc:
            raise RunError(str(exc)) from None
        return True

    def check_nan_limit(self, m: dict[str, float], step: int) -> None:
        assert self.store is not None
        if m.get("train/nan_skipped"):
            self.store.event(
                "nan_skipped", step=step, detail={"loss": m.get("train/loss"), "grad_norm": m.get("train/grad_norm")}
            )

    def on_preempt(self, step: int | None, row: dict[str, float] | None) -> int:
        """Checkpoint step `step` (None: nothing finished since the last checkpoint) and report how the
        process should exit."""
        assert self.store is not None
        if step is not None and row is not None:
            self.checkpoint(step, row, force=True)
        name = signal.Signals(self.preempt_signal or signal.SIGTERM).name
        self.store.event("preempted", step=step, detail={"signal": name, "job_id": self.incarnation.job_id})
        saved = f"checkpointed step {step + 1}" if step is not None else "the last checkpoint holds the last step"
        if self.slurm:
            # The requeued job (same id, SLURM_RESTART_COUNT + 1) resumes from this checkpoint.
            out = subprocess.run(["scontrol", "requeue", self.slurm.job_id], capture_output=True, text=True)
            self.progress.say(
                f"received {name}: {saved}; scontrol requeue {self.slurm.job_id}: "
                + ("ok" if out.returncode == 0 else f"failed ({out.stderr.strip()})")
            )
            return 0 if out.returncode == 0 else 1
        self.progress.say(f"received {name}: {saved}; rerun the same command to resume")
        return 128 + int(self.preempt_signal or signal.SIGTERM)

    def on_preempt_mid_step(self) -> int:
        """A signal came before this step trained (during a slow reward): keep the last finished step."""
        finished = self._last_logged if self._steps_trained == self._steps_logged else None
        return self.on_preempt(*(finished or (None, None)))

    def _record_stop(self, step: int, detail: dict[str, Any]) -> None:
        assert self.store is not None
        self.store.event("stopped", step=step, detail=detail)

    def finish(self) -> None:
        assert self.trainer is not None and self.store is not None
        out = self.trainer.export(self.run_dir / "model")
        self.store.event(
            "finished", step=self.cfg.num_steps - 1 if self.cfg.num_steps else None, detail={"model": str(out)}
        )
        self.progress.say(f"done: policy exported to {out}; metrics in {self.run_dir / 'metrics.h5'}")

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, FleetError):
            try:
                self._checkpoint_before_failing(exc)
            except Exception as err:  # noqa: BLE001 - the original failure is what the user must see
                self.progress.say(f"warning: could not checkpoint before stopping: {err}")
        for closer in (
            self.guard.stop,  # first: stopped workers must get SIGCONT before they are shut down
            lambda: self.rollout.close() if hasattr(self, "rollout") else None,
            lambda: self.fleet.close() if hasattr(self, "fleet") else None,
            lambda: self.sync.close() if self.sync else None,
            lambda: self._engines.stop() if self._engines else None,
            lambda: (
                done_marker(self.run_dir, self.incarnation).touch()
                if (self.slurm and self.slurm.engines_elsewhere) or self.cfg.sync.transport == "mpi"
                else None
            ),
            lambda: self.trainer.close() if self.trainer else None,
            lambda: self.store.close() if self.store else None,
            lambda: self._lock.release() if self._lock else None,  # last: nothing writes run_dir after it
        ):
            try:
                closer()
            except Exception as err:  # noqa: BLE001 - shutting down: report, keep closing the rest
                self.progress.say(f"warning during shutdown: {err}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
