"""hpcrl's command line: `hpcrl <command> --help` explains each command.

hpcrl run experiments/quickstart.yaml          # GRPO end to end on this machine
hpcrl engine serve --model DIR --port 30000    # the embedded SGLang-contract engine
hpcrl model init-tiny DIR                      # a tiny Qwen3-architecture model for tests
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Sequence

from hpcrl.config_show import add_config_commands
from hpcrl.engine.embedded.serve_cli import add_engine_flags
from hpcrl.guard.cli import add_guard_commands
from hpcrl.report.cli import add_report_commands
from hpcrl.sessions.cli import add_session_commands
from hpcrl.slurm.cli import add_slurm_commands
from hpcrl.store.run_dir import path_arg

Command = Callable[[argparse.Namespace], int]


def _engine_serve(ns: argparse.Namespace) -> int:
    import os

    from hpcrl.engine.embedded.serve_cli import engine_config
    from hpcrl.engine.kernels_config import with_env_overrides

    if ns.onpolicy_logprobs:
        raise ValueError(
            "--onpolicy-logprobs was removed: it re-scored finished sequences, a relabel rather than on-policy; "
            "use --logprobs recompute for the re-score, or --batch-invariant (run config: engine.logprobs: recompute, "
            "engine.batch_invariant: true with train.logprobs: invariant)"
        )
    engine = engine_config(ns)
    kernels, overrides = with_env_overrides(engine.kernels, os.environ)
    # Checked before the heavy imports and the model load: a bad setting must not cost either.
    from hpcrl.engine.embedded.server import serve
    from hpcrl.engine.embedded.server_config import ServerConfig, resolve_api_key

    cfg = ServerConfig(
        model=ns.model,
        engine=dataclasses.replace(engine, kernels=kernels),
        kernel_overrides=tuple(overrides),
        host=ns.host,
        port=ns.port,
        api_key=resolve_api_key(api_key=ns.api_key, api_key_file=ns.api_key_file),
        random_seed=ns.random_seed,
        weight_version=ns.weight_version,
        ignore_sigterm=ns.ignore_sigterm,
    )
    if ns.parent_pid:
        _exit_with_parent(ns.parent_pid)
    serve(cfg)
    return 0


def _exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """An engine whose launcher was SIGKILLed must not live on holding its port and memory."""
    import os
    import signal
    import threading
    import time

    def watch() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGINT)  # SIGINT: also when the engine ignores SIGTERM
                time.sleep(10)
                os._exit(1)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="hpcrl-parent-watch", daemon=True).start()


def _model_init_tiny(ns: argparse.Namespace) -> int:
    from hpcrl.model.tiny import TinyModelSpec, init_tiny_model

    if not ns.moe and (ns.experts is not None or ns.experts_per_tok is not None):
        print("hpcrl model init-tiny: --experts and --experts-per-tok shape a --moe model; add --moe", file=sys.stderr)
        return 2
    if ns.moe and ns.experts is not None and ns.experts < 1:
        print("hpcrl model init-tiny: --experts must be >= 1 (a --moe model has experts)", file=sys.stderr)
        return 2
    spec = TinyModelSpec(
        num_layers=ns.layers,
        hidden_size=ns.hidden,
        intermediate_size=ns.intermediate,
        num_heads=ns.heads,
        num_kv_heads=ns.kv_heads,
        head_dim=ns.head_dim,
        max_position_embeddings=ns.max_positions,
        seed=ns.seed,
        num_experts=(8 if ns.experts is None else ns.experts) if ns.moe else 0,
        num_experts_per_tok=2 if ns.experts_per_tok is None else ns.experts_per_tok,
    )
    path = init_tiny_model(ns.dir, spec, overwrite=ns.overwrite)
    print(f"wrote a tiny Qwen3{'-MoE' if ns.moe else ''}-architecture model to {path}")
    return 0


def _run(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from hpcrl.driver import run
    from hpcrl.run_config import load_run_config
    from hpcrl.store.progress import set_verbose
    from hpcrl.store.run_dir import default_run_dir

    set_verbose(ns.verbose)
    cfg = load_run_config(ns.config, ns.overrides)
    run_dir = Path(ns.run_dir) if ns.run_dir else default_run_dir(cfg.name)
    print(f"hpcrl run: {cfg.name} -> {run_dir}", flush=True)
    return run(cfg, run_dir, restart=ns.restart)


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run GRPO end to end on this machine (engines and trainer as local processes)",
        description="Run GRPO from a YAML config: start the engines, optionally warm-start with SFT, then "
        "rollout -> reward -> train -> weight push for num_steps steps, logging to RUN_DIR/metrics.h5 and "
        "checkpointing to RUN_DIR/checkpoints/. Rerunning the same command resumes from the last checkpoint.",
        epilog="example: hpcrl run experiments/quickstart.yaml train.lr=1e-4 rollout.n_samples_per_prompt=8",
    )
    p.add_argument("config", help="YAML run config (see experiments/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 num_steps=10")
    p.add_argument(
        "--run-dir", type=path_arg, default=None, help="where the run lives (default: runs/<the config's name:>)"
    )
    p.add_argument(
        "--verbose", action="store_true", help="also print details for debugging (the first prompt's token ids)"
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="start over in RUN_DIR on purpose: its previous contents are moved into RUN_DIR/superseded-<time>/ "
        "(nothing is deleted); without it, a run dir that holds results but no checkpoint is refused",
    )
    p.set_defaults(func=_run)


def _engine_join(run_dir: str) -> int:
    from pathlib import Path

    from hpcrl.slurm.join import join_run

    return join_run(Path(run_dir))


def _role(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from hpcrl.slurm.roles import engines_role, mpi_agent_role, trainer_role

    run_dir = Path(ns.run_dir)
    if ns.role == "trainer":
        # The role sits below the run it drives: it gets the driver (rank 0) and the follower loop passed in.
        from hpcrl.driver import run
        from hpcrl.run.follower import follow_run

        return trainer_role(run_dir, drive=run, follow=follow_run)
    return engines_role(run_dir) if ns.role == "engines" else mpi_agent_role(run_dir)


def _add_role(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "role",
        help="what a task of a Slurm job runs (used by generated scripts)",
        description="Run one role of a Slurm job: `engines` (one task per engine node: start this node's "
        "engines, write rendezvous files, stop when the run is done) or `trainer` (one task per trainer "
        "rank: rank 0 drives the run, the others follow) or `mpi-agent` (MPI ranks 1..N with "
        "sync.transport=mpi: start this node's engines and load the weights rank 0 broadcasts). "
        "Reads RUN_DIR/config.yaml.",
    )
    p.add_argument("role", choices=["engines", "trainer", "mpi-agent"])
    p.add_argument("--run-dir", type=path_arg, required=True)
    p.set_defaults(func=_role)


def _add_engine(sub: argparse._SubParsersAction) -> None:
    engine = sub.add_parser("engine", help="rollout engines").add_subparsers(dest="engine_cmd", required=True)
    p = engine.add_parser(
        "serve",
        help="serve a Hugging Face model with the embedded engine (SGLang's HTTP contract)",
        description="Start the embedded rollout engine: an HTTP server that answers SGLang's RL endpoints "
        "(/generate, /pause_generation, /update_weights_from_distributed, ...) with continuous batching.",
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default 127.0.0.1: loopback only; any other address needs an API key)",
    )
    p.add_argument("--port", type=int, default=30000, help="TCP port, 1..65535")
    p.add_argument(
        "--api-key-file",
        default=None,
        help="file (mode 0600) holding the key that every endpoint requires as 'Authorization: Bearer KEY'; "
        "or set HPCRL_ENGINE_API_KEY",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the key itself, for a quick test at a terminal: every user of the node sees it in `ps`; "
        "prefer --api-key-file or HPCRL_ENGINE_API_KEY",
    )
    p.add_argument("--onpolicy-logprobs", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--random-seed", type=int, default=0, help="seed for requests that carry no sampling_seed")
    p.add_argument("--weight-version", default="default", help="initial weight version")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone (set by launchers)")
    p.add_argument(
        "--ignore-sigterm",
        action="store_true",
        help="keep serving on SIGTERM (Slurm TERMs all steps at once; stop with SIGINT)",
    )
    add_engine_flags(p)
    p.set_defaults(func=_engine_serve)

    p = engine.add_parser(
        "join",
        help="start one engine that joins a running run (sync.transport=disk_delta) through its run directory",
        description="Start one engine of the run's engine section on this node, bring it to the newest weight "
        "version in the run's weight directory and register it in RUN_DIR/engines/joined/; the run routes groups "
        "to it from its next weight push on. Leaves (registration removed first) on SIGTERM, SIGUSR2 or the run's "
        "end. In a Slurm job: hpcrl submit --engines-only --join RUN_DIR.",
    )
    p.add_argument("run_dir", type=path_arg, help="the running run's directory (shared with the trainer's nodes)")
    p.set_defaults(func=lambda ns: _engine_join(ns.run_dir))


def _add_model(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_cmd", required=True)
    p = model.add_parser(
        "init-tiny",
        help="write a tiny random Qwen3-architecture model with a character tokenizer (HF format)",
        description="Write a tiny Qwen3-architecture model (random weights) and a character-level tokenizer "
        "in Hugging Face format, loadable by hpcrl, transformers and SGLang.",
    )
    p.add_argument("dir", help="output directory")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE model (every layer a sparse expert block)")
    p.add_argument("--experts", type=int, default=None, help="experts per layer (with --moe; default 8)")
    p.add_argument(
        "--experts-per-tok", type=int, default=None, help="experts each token is routed to (with --moe; default 2)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    p.set_defaults(func=_model_init_tiny)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_run(sub)
    _add_role(sub)
    _add_engine(sub)
    _add_model(sub)
    add_guard_commands(sub)
    add_slurm_commands(sub)
    add_report_commands(sub)
    add_config_commands(sub)
    add_session_commands(sub)
    return parser


# An override's key starts with a letter: `-x=1` stays an (unknown) option, `train.lr=-1` is an override.
_OVERRIDE = re.compile(r"[A-Za-z_][\w.-]*=")


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args`, except that `key=value` overrides may also follow options, as the README writes them.

    argparse gives a positional `nargs="*"` only the words before the first option, so in
    `hpcrl run CONFIG --run-dir DIR train.lr=1e-4` it would reject `train.lr=1e-4`. The words it leaves over
    that look like overrides are appended, in order, to the command's overrides; anything else is an error.
    """
    ns, extras = parser.parse_known_args(argv)
    if not extras:
        return ns
    overrides = getattr(ns, "overrides", None)
    if overrides is None:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    strays = [word for word in extras if not _OVERRIDE.match(word)]
    if strays:
        command = " ".join(str(getattr(ns, key)) for key in ("cmd", "guard_cmd") if getattr(ns, key, None))
        parser.error(
            f"hpcrl {command}: {strays[0]!r} is neither an option of this command nor a key=value override "
            f"(e.g. train.lr=1e-4); see hpcrl {command} --help"
        )
    ns.overrides = [*overrides, *extras]
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parse_args(parser, argv)
    if ns.cmd == "run" or ns.cmd == "role":
        from hpcrl import preemption

        preemption.watch()  # before the heavy imports: a signal then must not kill the process
    try:
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        # ConfigError, DataError and RewardError are ValueErrors: user input that needs fixing.
        print(f"hpcrl: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        # RunError, EngineStartError, WeightSyncError, NonFiniteStepError: the run cannot go on.
        print(f"hpcrl: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        from hpcrl.store.metrics_file import StoreError

        if not isinstance(exc, StoreError):
            raise
        # A damaged, foreign or unwritable metrics.h5 or checkpoint: the message names the file.
        print(f"hpcrl: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
