"""The model dir of a run: checked, or created first when model.init_tiny asks for it.

Every role of a run calls it (the driver, the engine roles of a Slurm job, the MPI agents), so it lives here
beside the model, below all of them.
"""

from __future__ import annotations

from pathlib import Path

from hpcrl.model.tiny import TinyModelSpec


class ModelDirError(RuntimeError):
    """model.path holds no model and nothing may create one there."""


def prepare_model_dir(path: Path, init_tiny: TinyModelSpec | None) -> Path:
    """The model dir, created first when `init_tiny` is set (under a lock: in a Slurm job every node's roles may
    get here at once)."""
    import fcntl

    if (path / "config.json").is_file() or init_tiny is None:
        return _create_if_missing(path, init_tiny)  # refuses a missing model without writing a lock file
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _create_if_missing(path, init_tiny)


def _create_if_missing(path: Path, init_tiny: TinyModelSpec | None) -> Path:
    if not (path / "config.json").is_file():
        if init_tiny is None:
            raise ModelDirError(
                f"model.path {path} has no config.json: point it at a Hugging Face model directory, or set "
                "model.init_tiny to create a tiny model there"
            )
        from hpcrl.model.tiny import init_tiny_model

        init_tiny_model(path, init_tiny, overwrite=path.exists() and not any(path.iterdir()))
    return path
