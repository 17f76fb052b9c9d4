"""``build_report`` and ``build_compare``: read runs, write the markdown and the plots into a folder."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcrl.report import DEFAULT_MAX_POINTS, DEFAULT_WINDOW, METRICS_FILE
from hpcrl.report import plots as plotting
from hpcrl.report.run import load_run, resolve_metrics_path
from hpcrl.report.summary import Comparison, Summary, compare, render_compare_markdown, render_markdown, summarize
from hpcrl.store.metrics import StoreError


@dataclass(frozen=True, slots=True)
class ReportResult:
    summary: Summary
    markdown: str
    markdown_path: Path
    plots: list[Path]


def _prepare_out_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise StoreError(
            f"cannot create the output folder {out_dir} ({error}); pass -o DIR somewhere writable"
        ) from error
    if not os.access(out_dir, os.W_OK):
        raise StoreError(f"the output folder {out_dir} is not writable; pass -o DIR somewhere writable")


def build_report(
    run_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    window: int = DEFAULT_WINDOW,
    plots: bool = True,
    max_points: int = DEFAULT_MAX_POINTS,
    smooth: int | None = None,
) -> ReportResult:
    """Reads a run, writes ``report.md`` and the PNG plots into ``out_dir`` (default ``RUN_DIR/report``).

    ``smooth``: None (a moving mean over a 20th of the steps on runs of 30 steps or more), 0 (raw values only)
    or N (a moving mean over N steps, drawn over the raw values).
    """
    run = load_run(run_path)
    out = Path(out_dir) if out_dir is not None else run.path.parent / "report"
    _prepare_out_dir(out)
    summary = summarize(run, window=window)
    plot_paths: list[Path] = []
    if plots and run.num_rows:
        plot_paths = plotting.plot_run(
            run, out, max_points=max_points, smooth=plotting.SMOOTH_AUTO if smooth is None else smooth
        )
    markdown = render_markdown(summary, run.attrs, plot_paths)
    markdown_path = out / "report.md"
    markdown_path.write_text(markdown)
    return ReportResult(summary=summary, markdown=markdown, markdown_path=markdown_path, plots=plot_paths)


def unique_names(paths: Sequence[Path]) -> list[str]:
    """Short, distinct labels for runs: the directory name, with parents added until they differ."""
    parts = [list((p.parent if p.name == METRICS_FILE else p).resolve().parts) for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]


@dataclass(frozen=True, slots=True)
class CompareResult:
    comparison: Comparison
    markdown: str
    markdown_path: Path
    plots: list[Path]


def build_compare(
    run_paths: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    window: int = DEFAULT_WINDOW,
    plots: bool = True,
    max_points: int = DEFAULT_MAX_POINTS,
    smooth: int | None = None,
) -> CompareResult:
    """Reads several runs, writes ``compare.md`` and ``compare.png`` (overlaid curves) into ``out_dir``."""
    metrics_paths = [resolve_metrics_path(p) for p in run_paths]
    if len(set(p.resolve() for p in metrics_paths)) != len(metrics_paths):
        raise ValueError("the same run is given twice; pass each run directory once")
    names = unique_names(metrics_paths)
    runs = [load_run(p, name=name) for p, name in zip(metrics_paths, names, strict=True)]
    out = Path(out_dir)
    _prepare_out_dir(out)
    comparison = compare(runs, window=window)
    plot_paths: list[Path] = []
    if plots and any(r.num_rows for r in runs):
        plot_paths = plotting.plot_compare(
            runs, out, max_points=max_points, smooth=plotting.SMOOTH_AUTO if smooth is None else smooth
        )
    markdown = render_compare_markdown(comparison, metrics_paths, plot_paths)
    markdown_path = out / "compare.md"
    markdown_path.write_text(markdown)
    return CompareResult(comparison=comparison, markdown=markdown, markdown_path=markdown_path, plots=plot_paths)


__all__ = ["CompareResult", "ReportResult", "build_compare", "build_report", "unique_names"]
