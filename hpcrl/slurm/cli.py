"""The Slurm commands of the hpcrl CLI: submit, sbatch, doctor.

hpcrl submit experiments/quickstart.yaml [key=value ...] [--run-dir DIR]
hpcrl sbatch experiments/quickstart.yaml -o sbatch/quickstart.sbatch [--run-dir DIR] [--base-dir DIR] [--dry-run]
hpcrl submit --engines-only --join RUN_DIR [slurm.key=value ...]   (engines joining a running disk_delta run)
hpcrl doctor [CONFIG [key=value ...]] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from hpcrl.store.run_dir import path_arg


def default_run_dir(name: str) -> str:
    # The same default as `hpcrl run` (runs/<name:>), so that a run moves between local and Slurm unchanged.
    from hpcrl.store.run_dir import default_run_dir as run_dir_of

    return str(run_dir_of(name))


def sbatch_command_line(
    config: str, overrides: Sequence[str], output: str | None, run_dir: str | None, base_dir: str | None = None
) -> list[str]:
    """The argv that regenerates a script (its header shows it; the drift test runs it)."""
    argv = ["hpcrl", "sbatch", config, *overrides]
    if output:
        argv += ["-o", output]
    if run_dir:
        argv += ["--run-dir", run_dir]
    if base_dir:
        argv += ["--base-dir", base_dir]
    return argv


def render_sbatch(
    config: str, overrides: Sequence[str], output: str | None, run_dir: str | None, base_dir: str | None = None
) -> str:
    """The text `hpcrl sbatch` writes for these arguments."""
    from hpcrl.run_config import load_run_config
    from hpcrl.slurm.render import render_script

    cfg = load_run_config(config, list(overrides))
    return render_script(
        cfg,
        run_dir or default_run_dir(cfg.name),
        command_line=sbatch_command_line(config, overrides, output, run_dir, base_dir),
        script_path=output,
        base_dir=base_dir,
    )


def _join_args(ns: argparse.Namespace) -> bool:
    """Whether this is an engines-only join (`--engines-only --join RUN_DIR`); its overrides are all positional."""
    if ns.join is None and not ns.engines_only:
        if ns.config is None:
            raise ValueError("a CONFIG is needed (or --engines-only --join RUN_DIR to add engines to a running run)")
        return False
    if ns.join is None or not ns.engines_only:
        raise ValueError("--engines-only and --join RUN_DIR go together: engines that join the run in RUN_DIR")
    if ns.config is not None:  # argparse took the first override for a config
        ns.overrides = [ns.config, *ns.overrides]
        ns.config = None
    return True


def _join_command_line(ns: argparse.Namespace, cmd: str) -> list[str]:
    argv = ["hpcrl", cmd, "--engines-only", "--join", ns.join, *ns.overrides]
    if getattr(ns, "output", None):
        argv += ["-o", ns.output]
    if getattr(ns, "base_dir", None):
        argv += ["--base-dir", ns.base_dir]
    return argv


def _submit_join(ns: argparse.Namespace) -> int:
    from hpcrl.slurm.join_script import render_join_script

    text = render_join_script(Path(ns.join), ns.overrides, command_line=_join_command_line(ns, "submit"))
    out = subprocess.run(["sbatch", "--parsable"], input=text, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch refused the join job: {out.stderr.strip() or out.stdout.strip()}")
    job = out.stdout.strip().split(";")[0]
    print(f"hpcrl submit: job {job} (engines joining the run in {Path(ns.join).absolute()})")
    print(f"  registrations: {Path(ns.join).absolute() / 'engines' / 'joined'}   leave: scancel {job}")
    return 0


def _sbatch(ns: argparse.Namespace) -> int:
    from hpcrl.run_config import load_run_config

    if _join_args(ns):
        from hpcrl.slurm.join_script import render_join_script

        text = render_join_script(
            Path(ns.join), ns.overrides, command_line=_join_command_line(ns, "sbatch"), base_dir=ns.base_dir
        )
        if _write_script(ns, text, "join"):
            print(f"wrote {ns.output}; submit it (from any directory) with: sbatch {Path(ns.output).absolute()}")
        return 0
    from hpcrl.slurm.render import check_mpi_launch, job_log_dir, nodes_python

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = render_sbatch(ns.config, ns.overrides, ns.output, ns.run_dir, ns.base_dir)
    cfg = load_run_config(ns.config, list(ns.overrides))
    notes = [str(note.message) for note in caught] + check_mpi_launch(cfg, nodes_python(cfg))
    for note in notes:
        print(f"hpcrl sbatch: warning: {note}", file=sys.stderr)
    if not _write_script(ns, text, Path(ns.config).stem):
        return 0
    log_dir = job_log_dir(cfg, os.path.abspath(ns.base_dir or os.getcwd()))
    if log_dir is not None:
        # Slurm does not create the job log's directory: a job whose log cannot be opened fails without a word.
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    print(f"wrote {ns.output}; submit it (from any directory) with: sbatch {Path(ns.output).absolute()}")
    return 0


def _write_script(ns: argparse.Namespace, text: str, stem: str) -> bool:
    """Print the script, or write it to -o (then True); bash -n checks it first."""
    # bash -n: the rendered shell parses (quoting bugs show here, on a laptop, not in the queue).
    check = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"the rendered script does not parse (a bug in hpcrl, please report): {check.stderr}")
    if ns.dry_run or not ns.output:
        sys.stdout.write(text)
        sys.stdout.flush()
        if ns.dry_run:
            print(f"hpcrl sbatch: dry run: the script is valid ({len(text.splitlines())} lines)", file=sys.stderr)
        return False
    out = Path(ns.output)
    if out.is_dir():
        raise ValueError(f"-o {out} is a directory; give the script's file name, e.g. -o {out / (stem + '.sbatch')}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"cannot write {out}: {exc.strerror or exc}; choose another -o path") from None
    return True


def _submit(ns: argparse.Namespace) -> int:
    from hpcrl.run_config import load_run_config
    from hpcrl.slurm.render import check_placement

    if _join_args(ns):
        return _submit_join(ns)
    cfg = load_run_config(ns.config, ns.overrides)
    for note in check_placement(cfg):
        print(f"hpcrl submit: warning: {note}", file=sys.stderr)
    try:
        from hpcrl.slurm.executor import submit_run
    except ImportError as exc:
        raise RuntimeError(f"hpcrl submit needs submitit ({exc}); install it: pip install 'hpcrl[slurm]'") from exc
    run_dir = Path(ns.run_dir or default_run_dir(cfg.name)).absolute()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job = submit_run(cfg, run_dir)  # sync.transport=mpi: it checks the MPI launch (errors, warnings)
    for warning in caught:
        print(f"hpcrl submit: warning: {warning.message}", file=sys.stderr)
    layout = (
        f"{cfg.slurm.trainer.nodes} node(s), engines and trainer colocated"
        if cfg.slurm.colocate
        else f"{cfg.slurm.engines.nodes} engine node(s) + {cfg.slurm.trainer.nodes} trainer node(s)"
    )
    print(f"hpcrl submit: job {job.job_id} ({cfg.name}: {layout})")
    print(f"  run dir:   {run_dir}")
    print(f"  job log:   {job.paths.stdout} (batch shell and every step; appended to on requeue)")
    print(f"  role logs: {run_dir / 'logs'}")
    print(f"  script:    {job.paths.submission_file}")
    print(f"  watch:     squeue -j {job.job_id}; sacct -j {job.job_id}   cancel: scancel {job.job_id}")
    return 0


def _doctor(ns: argparse.Namespace) -> int:
    from hpcrl.slurm.doctor import run_doctor

    cfg = None
    if ns.config is not None:
        from hpcrl.run_config import load_run_config

        cfg = load_run_config(ns.config, ns.overrides)
    elif ns.overrides:
        raise ValueError(f"hpcrl doctor: overrides {ns.overrides} need a CONFIG before them")
    return run_doctor(Path(ns.run_dir), cfg)


def add_slurm_commands(sub: argparse._SubParsersAction) -> None:
    """Register `submit`, `sbatch` and `doctor` on the hpcrl CLI."""
    p = sub.add_parser(
        "submit",
        help="submit the run as one Slurm job (het group 0: engines, 1: trainer) through submitit",
        description="Submit the run as one Slurm job: the slurm section sizes het group 0 (engines) and het group "
        "1 (trainer ranks), or one component with slurm.colocate=true. Writes RUN_DIR/config.yaml, submits with "
        "submitit (logs in RUN_DIR/slurm/) and prints the job id. The job requeues itself when preempted and resumes.",
        epilog="example: hpcrl submit experiments/quickstart.yaml slurm.partition=gpu slurm.time_limit=04:00:00",
    )
    _add_config_args(p)
    p.set_defaults(func=_submit)

    p = sub.add_parser(
        "sbatch",
        help="write the run's standalone Slurm batch script (plain sbatch runs it; no hpcrl needed to submit)",
        description="Render the run's batch script: #SBATCH components, the resolved config (written to "
        "RUN_DIR/config.yaml when the job starts, unless the run dir has one) and the srun steps of the roles.",
        epilog="example: hpcrl sbatch experiments/quickstart.yaml -o sbatch/quickstart.sbatch && "
        "sbatch sbatch/quickstart.sbatch",
    )
    _add_config_args(p)
    p.add_argument("-o", "--output", type=path_arg, default=None, help="script to write (default: print it)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the script; write nothing")
    p.add_argument(
        "--base-dir",
        default=None,
        help="the directory the job runs in, where the config's relative paths start (default: the current one); "
        "the script names it and every other path absolutely, so it can be submitted from anywhere",
    )
    p.set_defaults(func=_sbatch)

    p = sub.add_parser(
        "doctor",
        help="check what this machine has for hpcrl: Slurm, MPI, GPUs/NVML, sglang, megatron-core, a writable run dir",
        description="Check the commands and packages hpcrl can use and print what is missing with the fix, and the "
        "one pip command that adds the missing extras. Given a CONFIG: also the extras its features need (a dataset "
        "file, a logging sink, engine.kind=sglang, ...). Exits 0 when a local run (hpcrl run) of it can work; Slurm, "
        "MPI, GPUs, sglang and megatron-core are otherwise optional.",
        epilog="example: hpcrl doctor experiments/cluster-example.yaml",
    )
    p.add_argument("config", nargs="?", default=None, help="YAML run config whose features to check (optional)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. logging.tensorboard=true")
    p.add_argument("--run-dir", type=path_arg, default="runs", help="directory runs will be written to (default: runs)")
    p.set_defaults(func=_doctor)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="YAML run config (see experiments/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. slurm.trainer.nodes=2 num_steps=10")
    p.add_argument("--run-dir", type=path_arg, default=None, help="where the run lives (default: runs/<config name>)")
    p.add_argument(
        "--engines-only",
        action="store_true",
        help="a job of engines only, that join the running run given by --join (sync.transport=disk_delta)",
    )
    p.add_argument(
        "--join",
        type=path_arg,
        default=None,
        metavar="RUN_DIR",
        help="with --engines-only: the running run to join; its config.yaml is used, only slurm.* overrides apply",
    )
