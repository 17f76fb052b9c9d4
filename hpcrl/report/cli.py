"""``hpcrl report`` and ``hpcrl compare``: read runs from their metrics.h5 (also while they still run).

    hpcrl report RUN_DIR [-o DIR] [--window N] [--no-plots]
    hpcrl compare RUN_DIR RUN_DIR [...] [-o DIR] [--window N] [--no-plots]
    python -m hpcrl.report.cli report RUN_DIR     # the same, without the hpcrl entry point

``add_report_commands(sub)`` registers both on hpcrl's own parser; the commands print their errors
(missing, truncated or foreign files; no matplotlib) as one line and return exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# hpcrl.report itself imports nothing, so that building hpcrl's parser imports neither numpy nor h5py.
from hpcrl.report import DEFAULT_MAX_POINTS, DEFAULT_WINDOW
from hpcrl.store.run_dir import path_arg

_WINDOW_HELP = (
    "N of the 'first N / last N steps' means (default %(default)s); capped at half the recorded steps so that "
    "the two windows never overlap"
)
_MAX_POINTS_HELP = (
    "past this many steps a curve is drawn as the mean of consecutive bins with a min-max band (default: %(default)s)"
)
_REPORT_EPILOG = """\
RUN_DIR is a run directory (the --run-dir of `hpcrl run`) or the path of its metrics.h5. The summary:
mean of the first N and the last N steps of the raw reward, response length, truncated share and
trainer-engine log-prob gap; the largest step-to-step reward change; median seconds per phase; rollout
tokens/s; weight-sync seconds; counts and total time of preemptions, engine restarts and thermal pauses.
Plots (only those the run has data for): reward.png, timing.png, logprob_gap.png, train.png,
throughput.png, thermal.png (GPU temperatures, pauses shaded), async.png (queue, staleness), fleet.png
(engines over time, when engines joined or left), memory.png.

The run may still be running: the report sees every step the writer has flushed (every 10 steps or 5 s).

examples:
  hpcrl report runs/quickstart
  hpcrl report runs/quickstart -o /tmp/qs-report --window 20
  hpcrl report /scratch/me/run42/metrics.h5 --no-plots     # text only, no matplotlib needed
"""
_COMPARE_EPILOG = """\
A table of first-N / last-N means per metric (one column per run, plus mean and standard deviation over
the runs), the largest step-to-step reward change of each run, and compare.png with the curves overlaid.
N is the same for all runs, capped by the shortest run. Runs are named by their directory (parent
folders are added when two names clash).

examples:
  hpcrl compare runs/qs0 runs/qs1 runs/qs2 -o runs/qs-seeds
  hpcrl compare runs/lr1e-4 runs/lr5e-4 --window 50
"""


def _report(ns: argparse.Namespace) -> int:
    from hpcrl.report.build import build_report

    result = build_report(
        ns.run_dir, ns.output, window=ns.window, plots=not ns.no_plots, max_points=ns.max_points, smooth=ns.smooth
    )
    print(result.markdown, end="")
    _print_written(result.markdown_path, result.plots)
    return 0


def _compare(ns: argparse.Namespace) -> int:
    from hpcrl.report.build import build_compare

    if len(ns.run_dirs) < 2:
        raise ValueError("compare needs at least two runs; for one run use `hpcrl report RUN_DIR`")
    result = build_compare(
        ns.run_dirs, ns.output, window=ns.window, plots=not ns.no_plots, max_points=ns.max_points, smooth=ns.smooth
    )
    print(result.markdown, end="")
    _print_written(result.markdown_path, result.plots)
    return 0


def _print_written(markdown_path: Path, plots: Sequence[Path]) -> None:
    names = [p.name for p in [markdown_path, *plots]]
    print(f"\nwrote {len(names)} file{'s' if len(names) > 1 else ''} to {markdown_path.parent}: {', '.join(names)}")


def _guarded(command: str, func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wraps a command so that expected failures print one line naming the problem and the fix."""

    def run(ns: argparse.Namespace) -> int:
        from hpcrl.store.metrics import StoreError

        try:
            return func(ns)
        except (StoreError, ValueError, ModuleNotFoundError, OSError) as error:
            print(f"hpcrl {command}: error: {_explain(error)}", file=sys.stderr)
            return 1

    return run


def _explain(error: BaseException) -> str:
    if isinstance(error, ModuleNotFoundError) and error.name and error.name.split(".")[0] == "matplotlib":
        return "plots need matplotlib: pip install 'hpcrl[report]', or pass --no-plots for the text summary only"
    return str(error)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _output_dir(text: str) -> Path:
    return Path(path_arg(text))


def _add_common(p: argparse.ArgumentParser, output_default: Path | None, output_help: str) -> None:
    p.add_argument("-o", "--output", type=_output_dir, default=output_default, metavar="DIR", help=output_help)
    p.add_argument("--window", type=_positive_int, default=DEFAULT_WINDOW, metavar="N", help=_WINDOW_HELP)
    p.add_argument("--no-plots", action="store_true", help="write the markdown only (no matplotlib needed)")
    p.add_argument("--max-points", type=_positive_int, default=DEFAULT_MAX_POINTS, metavar="N", help=_MAX_POINTS_HELP)
    p.add_argument(
        "--smooth",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="draw a moving mean over N steps on the raw values; 0 draws raw values only (default: a 20th of "
        "the steps, on runs of 30 steps or more)",
    )


def add_report_commands(sub: argparse._SubParsersAction) -> None:
    """Registers ``report`` and ``compare`` on hpcrl's subcommand parser."""
    formatter = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "report",
        help="summary and plots of one run from its metrics.h5 (also while it runs)",
        description="Summarise one run from its metrics.h5: text on stdout, report.md and PNG plots in a folder.",
        epilog=_REPORT_EPILOG,
        formatter_class=formatter,
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory, or the path of its metrics.h5")
    _add_common(p, None, "folder for report.md and the plots (default: RUN_DIR/report)")
    p.set_defaults(func=_guarded("report", _report))

    p = sub.add_parser(
        "compare",
        help="several runs (e.g. seeds) side by side: table of first/last-N means and overlaid curves",
        description="Compare runs from their metrics.h5 files: a markdown table and compare.png.",
        epilog=_COMPARE_EPILOG,
        formatter_class=formatter,
    )
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="two or more run directories")
    _add_common(p, Path("compare"), "folder for compare.md and compare.png (default: ./compare)")
    p.set_defaults(func=_guarded("compare", _compare))


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m hpcrl.report.cli``): the same commands without the hpcrl entry point."""
    parser = argparse.ArgumentParser(
        prog="hpcrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_report_commands(parser.add_subparsers(dest="cmd", required=True))
    ns = parser.parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
