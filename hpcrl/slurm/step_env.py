"""What the steps of a Slurm job run in: the environment lines its batch shell starts with (slurm.modules,
slurm.setup, the Python, slurm.env) and, with slurm.container, the image every step runs in. The run's job
(hpcrl/slurm/render.py) and an engines-only join job (hpcrl/slurm/join_script.py) start their steps alike.

apptainer/singularity wrap each step's command: `srun ... "${hpcrl_container[@]}" CMD` is `srun ... RUNTIME exec
[--nv] --bind ... IMAGE CMD`. pyxis starts the container per srun step: `srun "${hpcrl_pyxis[@]}" ... CMD` with
`--container-image`, `--container-mounts` and `--container-workdir`. Host paths are seen at the same paths
inside, so that every path in the config means the same there: the run dir, the directory the job runs in, a weight
directory outside the run dir (sync.delta_dir), and slurm.container.binds.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config import ConfigError
from hpcrl.run_config import RunConfig
from hpcrl.slurm.config import ContainerConfig

# Exported in every step, always: NVLink multicast (NVLS) is not to be used on the project's GPU machines,
# so NCCL, torch symmetric memory and NVSHMEM must not try it.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class StepLaunch:
    """How a step's command enters its environment: `srun{srun_args} OPTIONS {command_prefix}"$HPCRL_PYTHON" ...`."""

    srun_args: str = ""
    """pyxis: ' "${hpcrl_pyxis[@]}"' (the container is the srun step's)."""
    command_prefix: str = ""
    """apptainer/singularity: '"${hpcrl_container[@]}" ' (the step's command runs under `RUNTIME exec`)."""


def step_launch(container: ContainerConfig | None) -> StepLaunch:
    if container is None:
        return StepLaunch()
    if container.runtime == "pyxis":
        return StepLaunch(srun_args=' "${hpcrl_pyxis[@]}"')
    return StepLaunch(command_prefix='"${hpcrl_container[@]}" ')


def check_container(cfg: RunConfig, base_dir: str) -> None:
    """ConfigError when slurm.container names an image file that is not there (a registry reference is not
    checked here: the nodes pull it)."""
    container = cfg.slurm.container
    if container is None or not container.is_file:
        return
    image = Path(base_dir) / Path(container.image).expanduser()
    if not image.is_file():
        make = (
            "enroot import -o IMAGE.sqsh docker://REGISTRY#IMAGE"
            if container.runtime == "pyxis"
            else f"{container.runtime} build IMAGE.sif docker://IMAGE"
        )
        raise ConfigError(
            f"slurm.container.image {container.image!r} does not exist ({image} is no file): build or pull it "
            f"first ({make}), fix the path, or name a registry image ("
            + ("nvcr.io#nvidia/pytorch:25.01-py3" if container.runtime == "pyxis" else "docker://...")
            + ")"
        )


def container_image(container: ContainerConfig, base_dir: str | None) -> str:
    if container.is_file and base_dir is not None:
        return os.path.normpath(Path(base_dir) / Path(container.image).expanduser())
    return container.image


def delta_weights_dir(cfg: RunConfig, base_dir: str) -> str | None:
    """The weight directory sync.delta_dir names, absolute (a relative one starts where the job runs, as the
    trainer resolves it); None when the weights stay in RUN_DIR/weights or go through no directory at all."""
    if cfg.sync.transport != "disk_delta" or not cfg.sync.delta_dir:
        return None
    return os.path.normpath(Path(base_dir) / Path(cfg.sync.delta_dir).expanduser())


def environment_lines(
    cfg: RunConfig,
    run_dir: str,
    *,
    base_dir: str,
    python: str | None = None,
    gpus: bool,
    weights_dir: str | None = None,
) -> list[str]:
    """The batch shell's first lines: RUN_DIR, modules, setup, the Python (the nodes' or the image's), slurm.env.

    python: the interpreter (None: slurm.python, else a lookup at run time; ignored with a container, whose
    interpreter is slurm.python or python3). gpus: whether a step of the job has GPUs (apptainer's --nv).
    weights_dir: the absolute weight directory of sync.transport disk_delta; one outside run_dir is created here
    and bound into the container (the trainer writes the versions there, the engines read them)."""
    slurm, q = cfg.slurm, shlex.quote
    check_container(cfg, base_dir)
    lines = [f"RUN_DIR={q(run_dir)}"]
    if slurm.modules:
        lines += _module_lines(slurm.modules)
    if slurm.setup:
        lines += ["# slurm.setup (shell code from the config), before the Python environment", *slurm.setup]
    container = slurm.container
    if container is None:
        lines += _python_lines(python if python is not None else slurm.python)
    else:
        outside = weights_dir is not None and not Path(weights_dir).is_relative_to(run_dir)
        extra = [weights_dir] if outside and weights_dir is not None else []
        lines += _container_lines(cfg, container, container_image(container, base_dir), gpus=gpus, extra_dirs=extra)
    lines += [f"export {name}={q(value)}" for name, value in (NVLS_OFF | dict(slurm.env)).items()]
    return lines


def import_check_lines(container: ContainerConfig | None) -> list[str]:
    """Fail in the batch shell, readably, when the steps' Python cannot import hpcrl (not in every task's log)."""
    if container is None:
        return [
            "# Fail here, readably, when the nodes' Python cannot import hpcrl (not in every rank's log).",
            '"$HPCRL_PYTHON" -c "import hpcrl" || { echo "hpcrl: $HPCRL_PYTHON cannot import hpcrl; activate the '
            'venv before sbatch or set slurm.python" >&2; exit 1; }',
        ]
    launch = step_launch(container)
    if not launch.command_prefix:
        return []  # pyxis: the image is the srun step's, and a step just for this check would pull it once more
    return [
        "# Fail here, readably, when the image's Python cannot import hpcrl (not in every rank's log).",
        f'{launch.command_prefix}"$HPCRL_PYTHON" -c "import hpcrl" || {{ echo "hpcrl: $HPCRL_PYTHON in the image '
        'cannot import hpcrl; install hpcrl in the image, or set slurm.python to its interpreter" >&2; '
        "exit 1; }",
    ]


def _module_lines(modules: Sequence[str]) -> list[str]:
    names = " ".join(shlex.quote(m) for m in modules)
    return [
        "# slurm.modules, before the Python environment (a venv made with a module's Python needs it loaded).",
        "# A non-login batch shell may lack the `module` function: source the usual init scripts first.",
        "if ! type module >/dev/null 2>&1; then",
        "  for hpcrl_init in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh /usr/share/lmod/lmod/init/bash; do",
        '    if [ -r "$hpcrl_init" ]; then . "$hpcrl_init"; break; fi',
        "  done",
        "fi",
        'type module >/dev/null 2>&1 || { echo "hpcrl: slurm.modules is set but this shell has no module command; '
        "source your site's module init in slurm.setup, or load the modules before sbatch\" >&2; exit 1; }",
        f'module load {names} || {{ echo "hpcrl: module load {names} failed (see above)" >&2; exit 1; }}',
    ]


def _container_lines(
    cfg: RunConfig, container: ContainerConfig, image: str, *, gpus: bool, extra_dirs: Sequence[str]
) -> list[str]:
    q = shlex.quote
    python = cfg.slurm.python or "python3"
    lines = [f"# slurm.container: every step runs in {_CONTROL_RE.sub(' ', image)} ({container.runtime}); hpcrl "
             "comes from the image", f"HPCRL_PYTHON={q(python)}"]  # fmt: skip
    for path in extra_dirs:
        if "," in path or ":" in path or _CONTROL_RE.search(path):
            raise ConfigError(
                f"sync.delta_dir {path!r} has a ',' or ':', which slurm.container's bind list cannot carry; "
                "choose a weight directory without them"
            )
        # A bind's source must exist before the container starts; the trainer would create it only inside.
        lines += [
            "# sync.delta_dir: the weight versions, outside the run dir; bound at the same path in every step",
            f'mkdir -p {q(path)} || {{ echo "hpcrl: cannot create sync.delta_dir" {q(path)} >&2; exit 1; }}',
        ]
    if container.runtime == "pyxis":
        # pyxis mounts nothing by default: the job's directory (where the config's relative paths start:
        # --container-workdir), the run dir and the weight directory are mounted where the host has them; the
        # job's directory first, so that a run dir inside it, mounted after, is not hidden by it.
        mounts = ",".join(
            ['"$PWD:$PWD"', '"$RUN_DIR:$RUN_DIR"', *(q(f"{p}:{p}") for p in extra_dirs), *map(q, container.binds)]
        )
        return lines + [
            f'hpcrl_pyxis=(--container-image={q(image)} --container-mounts={mounts} --container-workdir="$PWD")'
        ]
    binds = " ".join(['--bind "$RUN_DIR"', *(f"--bind {q(p)}" for p in [*extra_dirs, *container.binds])])
    return lines + [
        f'command -v {container.runtime} >/dev/null || {{ echo "hpcrl: slurm.container.runtime={container.runtime} '
        f'but this node has no {container.runtime} command (add its module to slurm.modules)" >&2; exit 1; }}',
        # --nv: the host's NVIDIA driver inside; the working directory is Apptainer's default mount.
        f"hpcrl_container=({container.runtime} exec{' --nv' if gpus else ''} {binds} {q(image)})",
    ]


def _python_lines(python: str) -> list[str]:
    q = shlex.quote
    if python.endswith("/activate"):
        return [f"source {q(python)} || exit 1", "HPCRL_PYTHON=python"]
    if python:
        # The venv's bin on PATH too, for anything the roles start by name.
        return [f"HPCRL_PYTHON={q(python)}", 'PATH="$(dirname "$HPCRL_PYTHON"):$PATH"']
    return [
        "# slurm.python is empty: the venv active at submission (sbatch exports the environment), else ./.venv",
        'if [ -n "${VIRTUAL_ENV:-}" ]; then HPCRL_PYTHON="$VIRTUAL_ENV/bin/python"',
        "elif [ -x .venv/bin/python ]; then HPCRL_PYTHON=.venv/bin/python",
        "else HPCRL_PYTHON=python3; fi",
        'PATH="$(dirname "$HPCRL_PYTHON"):$PATH"',
    ]
