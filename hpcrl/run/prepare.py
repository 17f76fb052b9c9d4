"""What a run checks and builds before it writes anything to its run dir: the devices it names, the SFT batches and
the held-out evaluation prompts (model dir: model/prepare.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from hpcrl.rollout.data import PromptSource, build_examples, source_options
from hpcrl.rollout.evaluate import held_out_examples
from hpcrl.rollout.generate import PromptFormatter, answer_batches
from hpcrl.run.errors import RunError
from hpcrl.run_config import RunConfig
from hpcrl.samples.sample import Example
from hpcrl.sessions.traces import ToolTraces
from hpcrl.trainer.batch import TrainBatch

# Evaluation's generated prompts come from the training generator under this seed offset.
EVAL_SEED_OFFSET = 1_000_003


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


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


def sft_batches(cfg: RunConfig, formatter: PromptFormatter, examples: list[Example]) -> Callable[[int], TrainBatch]:
    """The warm start's batches: tool traces for multi-turn runs, prompt + answer otherwise."""
    if cfg.rollout.kind == "multi_turn":
        assert cfg.rollout.model_family is not None
        traces = ToolTraces(
            examples, family=cfg.rollout.model_family, tokenizer=formatter.tokenizer,
            batch_size=cfg.sft.batch_size, seed=cfg.seed + 1,
            wrong_operand_share=cfg.sft.trace_wrong_operand_share, no_tool_share=cfg.sft.trace_no_tool_share,
        )  # fmt: skip
        return traces.batch
    sft_data = PromptSource(examples, batch_size=cfg.sft.batch_size, seed=cfg.seed + 1, shuffle=cfg.data.shuffle)
    return answer_batches(formatter, sft_data)


def held_out(cfg: RunConfig, training: list[Example]) -> list[Example]:
    """The held-out prompts of evaluation (none when it is off): from eval.source, or from the training
    generator under another seed; training prompts are taken out either way."""
    e = cfg.eval
    if not e.every_steps:
        return []
    source = e.source or cfg.data.source
    seed = cfg.seed + EVAL_SEED_OFFSET if e.source is None else cfg.seed
    d = cfg.data
    built = build_examples(
        source,
        **source_options(source, num_examples=max(d.num_examples, e.num_prompts), digits=d.digits, seed=seed,
                         prompt_key=d.prompt_key, answer_key=d.answer_key),
    )  # fmt: skip
    return held_out_examples(e, training, built)
