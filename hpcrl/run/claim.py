"""The run directory as a run holds it: locked, checked before anything is written, and left as it was found
by a start that fails before its first step (the rules themselves are hpcrl/store/run_dir.py's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hpcrl.config import dump_yaml
from hpcrl.run_config import RunConfig
from hpcrl.store.run_dir import (
    ResumePoint,
    RunDirLock,
    check_can_continue,
    find_resume_point,
    forget_failed_start,
    inspect_run_dir,
    refuse_planted_links,
    set_aside,
    write_file_atomically,
)


class RunDirClaim:
    """One run's hold on its run dir, from `__init__` (the lock) to `close` (the lock released, last)."""

    def __init__(self, run_dir: Path, *, job_id: str, say: Callable[[str], None]) -> None:
        self.run_dir, self.say = run_dir, say
        self.created = not run_dir.exists()
        self.lock = RunDirLock.acquire(run_dir, job_id=job_id)
        # The entries the directory held when this start began writing (None: it has written nothing).
        self._before: set[str] | None = None
        self.failed_start = False
        """Set when the run fails before it recorded a step: `close` then removes what this start wrote."""

    def check(self, cfg: RunConfig, *, restart: bool) -> ResumePoint:
        """Decide, before anything is written, whether `cfg` may run here; then record the owner and the config."""
        refuse_planted_links(self.run_dir)
        if restart and (moved := set_aside(self.run_dir)) is not None:
            self.say(f"--restart: moved the previous contents of {self.run_dir} to {moved}")
        point = find_resume_point(self.run_dir / "checkpoints")
        step = point.checkpoint.step if point.checkpoint is not None else None
        check_can_continue(inspect_run_dir(self.run_dir), cfg, resume_step=step, unreadable=point.unreadable)
        self._before = {p.name for p in self.run_dir.iterdir()}
        self.lock.record_owner()
        write_file_atomically(self.run_dir / "config.yaml", dump_yaml(cfg).encode())
        return point

    def close(self) -> None:
        """Release the run dir (after every other part closed: nothing writes it afterwards)."""
        try:
            if self.failed_start and self._before is not None:
                if removed := forget_failed_start(self.run_dir, self._before, created=self.created):
                    self.say(f"no step was recorded: removed what this start wrote ({', '.join(removed)})")
        finally:
            self.lock.release()
