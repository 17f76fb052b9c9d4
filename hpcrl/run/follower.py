"""Trainer ranks 1..N-1 of a local run (`hpcrl run` spawns them: `python -m hpcrl.run.follower RUN_DIR`)."""

from __future__ import annotations

import sys
from pathlib import Path

from hpcrl.run_config import RunConfig, load_run_config
from hpcrl.trainer.ranks import follow


def follow_run(run_dir: Path, cfg: RunConfig) -> int:
    """Build this rank's trainer as rank 0 builds its own, then obey rank 0 until it says STOP."""
    return follow(
        run_dir, cfg.train, model_path=cfg.model.path, sft_lr=cfg.sft.lr, group_timeout_s=cfg.sync.group_timeout_s
    )


if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    sys.exit(follow_run(run_dir, load_run_config(run_dir / "config.yaml")))
