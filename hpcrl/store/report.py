"""Post-hoc analysis of runs from their ``metrics.h5``: ``hpcrl report`` and ``hpcrl compare``.

    hpcrl report runs/quickstart                    # summary on stdout; report.md + PNGs in runs/quickstart/report/
    hpcrl compare runs/qs0 runs/qs1 runs/qs2 -o cmp # side by side: compare.md + compare.png in cmp/

Everything here works on NumPy arrays from ``load_metrics`` (no pandas), reads a run that is still being
written (SWMR, through ``hpcrl.store.metrics``) and never imports torch. Plots live in ``hpcrl.store.plots``
and import matplotlib only when asked for, so a text summary works on a login node without it.

Window means: "first N" / "last N" are the NaN-ignoring means of a metric over the first and the last N
rows. N is capped at half the rows so that the two windows never overlap (a 6-step run uses 3).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl.store.metrics import StoreError, load_events, load_metrics, load_root_attrs

METRICS_FILE = "metrics.h5"
DEFAULT_WINDOW = 10
# Past this many steps, plots draw bin means with min-max bands (hpcrl.store.plots).
DEFAULT_MAX_POINTS = 1000

# (metric key, label) of the learning table, in the order the issue asks for.
WINDOW_METRICS: tuple[tuple[str, str], ...] = (
    ("rollout/reward_mean", "reward (raw, mean per step)"),
    ("rollout/response_len_mean", "response length (tokens)"),
    ("rollout/truncated_share", "truncated share"),
    ("train/train_rollout_logprob_abs_diff", "log-prob gap (mean abs, trainer vs engine)"),
    # GRPO learns nothing from a group whose samples all got the same reward: the share of such groups.
    ("rollout/zero_std_group_share", "groups with zero reward std"),
)
REWARD_KEY = "rollout/reward_mean"
_LIVE_READ_RETRY_S = 5.0
_WRITER_OUTSIDE_SWMR = "while it is being written"
# timing/logprob_s is the forward pass inside timing/train_s: listed, never added to train.
PHASE_ORDER = ("rollout", "reward", "logprob", "train", "sync", "checkpoint", "total")


# -- reading -----------------------------------------------------------------------------------------


def resolve_metrics_path(path: str | os.PathLike[str]) -> Path:
    """Accepts a run directory or its ``metrics.h5`` and returns the metrics file's path."""
    path = Path(path)
    if path.is_dir():
        metrics = path / METRICS_FILE
        if not metrics.exists():
            raise StoreError(
                f"{path} is a directory without {METRICS_FILE}; pass an hpcrl run directory (the --run-dir of "
                "`hpcrl run`) or the path of a metrics.h5"
            )
        return metrics
    if not path.exists():
        raise StoreError(f"{path} does not exist; pass an hpcrl run directory or the path of its {METRICS_FILE}")
    return path


@dataclass(frozen=True, slots=True)
class RunData:
    """Everything one ``metrics.h5`` holds, read once: metric columns, events and root attributes."""

    name: str
    path: Path
    metrics: dict[str, np.ndarray]
    events: list[dict[str, Any]]
    attrs: dict[str, Any]

    @property
    def steps(self) -> np.ndarray:
        return self.metrics["step"]

    @property
    def num_rows(self) -> int:
        return int(self.steps.shape[0])

    def column(self, key: str) -> np.ndarray | None:
        """The values of a metric key, or None when the run never logged it."""
        return None if key == "step" else self.metrics.get(key)

    def keys_under(self, prefix: str) -> list[str]:
        """Metric keys below a group, e.g. ``keys_under("guard/")``, sorted."""
        return sorted(k for k in self.metrics if k.startswith(prefix))

    def config(self) -> dict[str, Any]:
        """The resolved run config from the root attributes ({} when absent or unreadable)."""
        text = self.attrs.get("config")
        if not isinstance(text, str):
            return {}
        import yaml

        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError:
            # The config only labels the report (planned steps): a damaged one must not stop it.
            return {}
        return loaded if isinstance(loaded, dict) else {}


def run_name(path: Path) -> str:
    """The run's name: its directory (the parent of ``metrics.h5``)."""
    return (path.parent if path.name == METRICS_FILE else path).name or str(path)


def load_run(path: str | os.PathLike[str], *, name: str | None = None) -> RunData:
    """Reads a run directory (or its ``metrics.h5``); works while the run is still writing."""
    metrics_path = resolve_metrics_path(path)
    deadline_s = time.monotonic() + _LIVE_READ_RETRY_S
    while True:
        try:
            return RunData(
                name=name or run_name(metrics_path),
                path=metrics_path,
                metrics=load_metrics(metrics_path),
                events=load_events(metrics_path),
                attrs=load_root_attrs(metrics_path),
            )
        except StoreError as error:
            # A live writer leaves SWMR for milliseconds to add a key or an event; the store's readers give
            # up at once when they open the file in that window (HDF5 then says "not already open for SWMR
            # writing", which they do not treat as retryable), so a report of a running job retries here.
            if _WRITER_OUTSIDE_SWMR not in str(error) or time.monotonic() > deadline_s:
                raise
        time.sleep(0.05)


# -- numbers -----------------------------------------------------------------------------------------


def nanmean(values: np.ndarray) -> float | None:
    """Mean over the finite-or-inf entries, ignoring NaN (missing); None when nothing is left."""
    if values.size == 0 or np.isnan(values).all():
        return None
    return float(np.nanmean(values))


def nanmedian(values: np.ndarray) -> float | None:
    if values.size == 0 or np.isnan(values).all():
        return None
    return float(np.nanmedian(values))


def window_size(num_rows: int, window: int) -> int:
    """The N of "first N / last N": at most half the rows, so the two windows never overlap."""
    if window < 1:
        raise ValueError(f"window must be >= 1 step, got {window}")
    return max(1, min(window, num_rows // 2)) if num_rows else 0


@dataclass(frozen=True, slots=True)
class WindowMeans:
    first: float | None
    last: float | None

    @property
    def change(self) -> float | None:
        return None if self.first is None or self.last is None else self.last - self.first


def window_means(values: np.ndarray | None, n: int) -> WindowMeans:
    if values is None or n == 0:
        return WindowMeans(None, None)
    return WindowMeans(nanmean(values[:n]), nanmean(values[-n:]))


@dataclass(frozen=True, slots=True)
class StepChange:
    """The largest change of a metric between two consecutive rows: ``value[step] - value[previous row]``."""

    step: int
    change: float


def largest_step_change(steps: np.ndarray, values: np.ndarray | None) -> StepChange | None:
    if values is None or values.size < 2:
        return None
    diffs = np.diff(values)
    finite = np.isfinite(diffs)
    if not finite.any():
        return None
    # argmax over |diff| among finite diffs: NaN (a missing row) or inf would hide the real jumps.
    index = int(np.argmax(np.where(finite, np.abs(diffs), -1.0)))
    return StepChange(step=int(steps[index + 1]), change=float(diffs[index]))


@dataclass(frozen=True, slots=True)
class Interruption:
    """How often something stopped the run, and for how long (None when the records cannot tell)."""

    count: int
    total_s: float | None = None
    # False for kinds that have no duration (resumes, NaN-skipped steps): the report leaves the time blank.
    timed: bool = True


def _events_of(events: Iterable[Mapping[str, Any]], *kinds: str) -> list[Mapping[str, Any]]:
    return [e for e in events if e["kind"] in kinds]


def _same(event: Mapping[str, Any]) -> object:
    return None


def _node_of(event: Mapping[str, Any]) -> object:
    # A node's guard pauses when any of its GPUs is hot and resumes when all are cool; the resume event
    # names the hottest GPU at that moment, not the one that paused, so pauses pair up by node.
    return event["detail"].get("node")


def _engine_of(event: Mapping[str, Any]) -> object:
    return event["detail"].get("engine")


def _paired_downtime_s(
    events: Sequence[Mapping[str, Any]], start: str, end: str, ident: Callable[[Mapping[str, Any]], object]
) -> float | None:
    """Seconds from each ``start`` event to the next ``end`` event of the same ``ident`` (GPU, engine)."""
    open_since: dict[object, float] = {}
    total_s = 0.0
    paired = False
    for event in events:
        if event["kind"] == start:
            open_since.setdefault(ident(event), event["time_s"])
        elif event["kind"] == end and ident(event) in open_since:
            total_s += event["time_s"] - open_since.pop(ident(event))
            paired = True
    return total_s if paired else None


def thermal_pauses(events: Sequence[Mapping[str, Any]]) -> Interruption:
    pauses = _events_of(events, "thermal_pause")
    if not pauses:
        return Interruption(0, None)
    # The guard records each pause's length on its resume event; pair the event times when it does not.
    durations = [e["detail"].get("duration_s") for e in _events_of(events, "thermal_resume")]
    if durations and all(isinstance(d, int | float) for d in durations):
        return Interruption(len(pauses), float(sum(durations)))
    return Interruption(len(pauses), _paired_downtime_s(events, "thermal_pause", "thermal_resume", _node_of))


def interruptions(events: Sequence[Mapping[str, Any]], metrics: Mapping[str, np.ndarray]) -> dict[str, Interruption]:
    """Counts and total times: preemptions (preempted -> resumed), engine restarts (dead -> restarted), pauses."""
    nan_rows = metrics.get("train/nan_skipped")
    num_nan = int(np.count_nonzero(nan_rows > 0)) if nan_rows is not None else len(_events_of(events, "nan_skipped"))
    return {
        "preemptions": Interruption(
            len(_events_of(events, "preempted")), _paired_downtime_s(events, "preempted", "resumed", _same)
        ),
        "resumes": Interruption(len(_events_of(events, "resumed")), timed=False),
        "engine restarts": Interruption(
            len(_events_of(events, "engine_restarted")),
            _paired_downtime_s(events, "engine_dead", "engine_restarted", _engine_of),
        ),
        "engine restarts failed": Interruption(len(_events_of(events, "engine_restart_failed")), timed=False),
        "engines given up": Interruption(len(_events_of(events, "engine_gave_up")), timed=False),
        "thermal pauses": thermal_pauses(events),
        "thermal overheat (run stopped)": Interruption(len(_events_of(events, "thermal_overheat")), timed=False),
        "NaN-skipped steps": Interruption(num_nan, timed=False),
        "checkpoints skipped": Interruption(len(_events_of(events, "checkpoint_skipped")), timed=False),
    }


@dataclass(frozen=True, slots=True)
class Summary:
    """The numbers of ``hpcrl report``; every value is None when the run did not record it."""

    name: str
    path: Path
    num_rows: int
    first_step: int | None
    last_step: int | None
    planned_steps: int | None
    status: str
    window: int
    means: dict[str, WindowMeans]
    reward_change: StepChange | None
    phase_median_s: dict[str, float | None]
    tokens_per_s_median: float | None
    sync_median_s: float | None
    sync_total_s: float | None
    sync_bytes_median: float | None
    interruptions: dict[str, Interruption]
    # Optional sections (guard/*, queue/*, staleness, memory/*): label -> value, only what was recorded.
    extras: dict[str, float | None] = field(default_factory=dict)


def _phase_names(metrics: Mapping[str, np.ndarray]) -> list[str]:
    found = [k[len("timing/") : -len("_s")] for k in metrics if k.startswith("timing/") and k.endswith("_s")]
    known = [p for p in PHASE_ORDER if p in found]
    # Phases a future driver adds (e.g. "guard") go between the known ones and the total.
    others = sorted(p for p in found if p not in PHASE_ORDER)
    if "total" in known:
        known.remove("total")
        return [*known, *others, "total"]
    return [*known, *others]


def _status(run: RunData) -> str:
    ends = ("finished", "preempted", "resumed", "engine_gave_up", "thermal_overheat")
    kinds = [e["kind"] for e in run.events if e["kind"] in ends]
    last = kinds[-1] if kinds else None
    if last == "finished":
        return "finished"
    if last == "preempted":
        return "preempted (waiting for requeue, or not resumed)"
    if last == "engine_gave_up":
        return "failed (engines gave up)"
    if last == "thermal_overheat":
        return "failed (a GPU did not cool down: thermal_overheat)"
    return "not finished (still running, or stopped without a 'finished' event)"


def _extras(run: RunData) -> dict[str, float | None]:
    extras: dict[str, float | None] = {}
    paused = run.column("guard/paused_s")
    if paused is not None:
        extras["thermal pause seconds (guard/paused_s, sum)"] = float(np.nansum(paused))
    temps = run.keys_under("guard/peak_temp_c/")
    if temps:
        peaks = [np.nanmax(run.metrics[k]) for k in temps if not np.isnan(run.metrics[k]).all()]
        extras["peak GPU temperature (C)"] = float(max(peaks)) if peaks else None
    for key in [
        *run.keys_under("queue/"),
        *(k for k in run.metrics if "staleness" in k and not k.startswith("queue/")),
    ]:
        extras[f"{key} (median)"] = nanmedian(run.metrics[key])
    for key in run.keys_under("memory/"):
        values = run.metrics[key]
        extras[f"{key} (max)"] = None if np.isnan(values).all() else float(np.nanmax(values))
    return extras


def summarize(run: RunData, *, window: int = DEFAULT_WINDOW) -> Summary:
    """Computes the report's numbers from the run's columns (see the module docstring for the windows)."""
    n = window_size(run.num_rows, window)
    planned = run.config().get("num_steps")
    sync_s = run.column("sync/seconds")
    with warnings.catch_warnings():
        # All-NaN slices are handled (None); numpy's RuntimeWarnings about them are noise here.
        warnings.simplefilter("ignore", RuntimeWarning)
        return Summary(
            name=run.name,
            path=run.path,
            num_rows=run.num_rows,
            first_step=int(run.steps[0]) if run.num_rows else None,
            last_step=int(run.steps[-1]) if run.num_rows else None,
            planned_steps=planned if isinstance(planned, int) else None,
            status=_status(run),
            window=n,
            means={key: window_means(run.column(key), n) for key, _ in WINDOW_METRICS},
            reward_change=largest_step_change(run.steps, run.column(REWARD_KEY)),
            phase_median_s={p: nanmedian(run.metrics[f"timing/{p}_s"]) for p in _phase_names(run.metrics)},
            tokens_per_s_median=_median_of(run.column("rollout/tokens_per_s")),
            sync_median_s=_median_of(sync_s),
            sync_total_s=None if sync_s is None or np.isnan(sync_s).all() else float(np.nansum(sync_s)),
            sync_bytes_median=_median_of(run.column("sync/bytes")),
            interruptions=interruptions(run.events, run.metrics),
            extras=_extras(run),
        )


def _median_of(values: np.ndarray | None) -> float | None:
    return None if values is None else nanmedian(values)


# -- markdown ----------------------------------------------------------------------------------------


def fmt(value: float | None, *, signed: bool = False) -> str:
    """A number as the report prints it: 4 significant digits, scientific when tiny or huge, "-" if none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    sign = "+" if signed else ""
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e9):
        return f"{value:{sign}.3e}"
    if abs(value) >= 1000:
        # Token rates and byte counts: whole numbers read better than 1.668e+04.
        return f"{value:{sign}.0f}"
    return f"{value:{sign}.4g}"


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 120:
        hours, rest = divmod(int(round(value)), 3600)
        return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{fmt(value)} s"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table padded to aligned columns, so that it also reads well as plain text."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _header_lines(summary: Summary, attrs: Mapping[str, Any]) -> list[str]:
    steps = "no steps recorded yet"
    if summary.num_rows:
        steps = f"steps {summary.first_step}-{summary.last_step} ({summary.num_rows} rows"
        steps += f" of {summary.planned_steps} planned)" if summary.planned_steps is not None else ")"
    lines = [f"# hpcrl report: {summary.name}", "", f"- file: `{summary.path}`", f"- {steps}; {summary.status}"]
    provenance = [f"{name} {attrs[name]}" for name in ("git_commit", "hosts", "versions") if name in attrs]
    if provenance:
        lines.append("- " + "; ".join(provenance))
    return lines


def _learning_lines(summary: Summary) -> list[str]:
    n = summary.window
    rows = [
        [
            label,
            fmt(summary.means[key].first),
            fmt(summary.means[key].last),
            fmt(summary.means[key].change, signed=True),
        ]
        for key, label in WINDOW_METRICS
    ]
    table = markdown_table(["metric", f"first {n}", f"last {n}", "change"], rows)
    lines = ["", f"## Learning: mean of the first {n} vs the last {n} steps", "", table]
    jump = summary.reward_change
    if jump is not None and jump.change != 0:
        lines += ["", f"Largest step-to-step reward change: {fmt(jump.change, signed=True)} at step {jump.step}."]
    elif jump is not None:
        lines += ["", "The reward did not change between steps."]
    return lines


def _timing_lines(summary: Summary) -> list[str]:
    total = summary.phase_median_s.get("total")
    rows = []
    for phase, median in summary.phase_median_s.items():
        share = "" if total in (None, 0) or median is None or phase == "total" else f"{100 * median / total:.0f}%"
        label = "logprob (forward, inside train)" if phase == "logprob" else phase
        rows.append([label, fmt(median), share])
    lines = ["", "## Seconds per step (median over steps)", ""]
    lines.append(markdown_table(["phase", "median s", "of total"], rows) if rows else "No timing/* metrics recorded.")
    lines += [
        "",
        f"- rollout tokens/s (median over steps): {fmt(summary.tokens_per_s_median)}",
        f"- weight sync: median {fmt(summary.sync_median_s)} s per step, {fmt_seconds(summary.sync_total_s)} in all, "
        f"{fmt(None if summary.sync_bytes_median is None else summary.sync_bytes_median / 1e6)} MB per push",
    ]
    return lines


def _interruption_lines(summary: Summary) -> list[str]:
    rows = [
        [label, str(i.count), fmt_seconds(i.total_s) if i.count and i.timed else ""]
        for label, i in summary.interruptions.items()
    ]
    lines = ["", "## Interruptions", "", markdown_table(["event", "count", "total time"], rows)]
    if summary.extras:
        extras = [[label, fmt(value)] for label, value in summary.extras.items()]
        lines += ["", "## Recorded extras", "", markdown_table(["metric", "value"], extras)]
    return lines


def render_markdown(summary: Summary, attrs: Mapping[str, Any], plots: Sequence[Path] = ()) -> str:
    """The report as markdown; the plots are linked relative to the report's folder."""
    lines = _header_lines(summary, attrs)
    if summary.num_rows:
        lines += [*_learning_lines(summary), *_timing_lines(summary)]
    lines += _interruption_lines(summary)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


# -- report and compare ------------------------------------------------------------------------------


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
) -> ReportResult:
    """Reads a run, writes ``report.md`` and the PNG plots into ``out_dir`` (default ``RUN_DIR/report``)."""
    run = load_run(run_path)
    out = Path(out_dir) if out_dir is not None else run.path.parent / "report"
    _prepare_out_dir(out)
    summary = summarize(run, window=window)
    plot_paths: list[Path] = []
    if plots and run.num_rows:
        from hpcrl.store import plots as plotting

        plot_paths = plotting.plot_run(run, out, max_points=max_points)
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


# (metric key, label) of the comparison table: each gives a first-N and a last-N row.
COMPARE_METRICS: tuple[tuple[str, str], ...] = (
    *WINDOW_METRICS,
    ("train/entropy", "entropy"),
    ("timing/total_s", "seconds per step"),
    ("rollout/tokens_per_s", "rollout tokens/s"),
)


@dataclass(frozen=True, slots=True)
class Comparison:
    names: list[str]
    window: int
    # (metric label, "first N" | "last N") -> one value per run
    means: dict[tuple[str, str], list[float | None]]
    reward_changes: list[StepChange | None]
    num_rows: list[int]
    summaries: list[Summary]


def compare(runs: Sequence[RunData], *, window: int = DEFAULT_WINDOW) -> Comparison:
    """First-N / last-N means per metric, with one N for all runs (the shortest run caps it)."""
    if not runs:
        raise ValueError("compare needs at least one run")
    n = min(window_size(r.num_rows, window) for r in runs)
    means: dict[tuple[str, str], list[float | None]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for key, label in COMPARE_METRICS:
            per_run = [window_means(r.column(key), n) for r in runs]
            if all(m.first is None and m.last is None for m in per_run):
                continue
            means[(label, f"first {n}")] = [m.first for m in per_run]
            means[(label, f"last {n}")] = [m.last for m in per_run]
    return Comparison(
        names=[r.name for r in runs],
        window=n,
        means=means,
        reward_changes=[largest_step_change(r.steps, r.column(REWARD_KEY)) for r in runs],
        num_rows=[r.num_rows for r in runs],
        summaries=[summarize(r, window=window) for r in runs],
    )


def _across(values: Sequence[float | None]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < 2:
        return "-"
    return f"{fmt(float(np.mean(finite)))} ± {fmt(float(np.std(finite, ddof=1)))}"


def _step_change_cell(change: StepChange | None) -> str:
    if change is None:
        return "-"
    return "0 (flat)" if change.change == 0 else f"{fmt(change.change, signed=True)} at step {change.step}"


def render_compare_markdown(comparison: Comparison, paths: Sequence[Path], plots: Sequence[Path] = ()) -> str:
    header = ["metric", "window", *comparison.names, "mean ± sd over runs"]
    rows = [["steps recorded", "", *map(str, comparison.num_rows), ""]]
    for (label, which), values in comparison.means.items():
        rows.append([label, which, *map(fmt, values), _across(values)])
    rows.append(
        [
            "largest step-to-step reward change",
            "",
            *(_step_change_cell(c) for c in comparison.reward_changes),
            "",
        ]
    )
    for label in ("preemptions", "engine restarts", "thermal pauses"):
        counts = [s.interruptions[label].count for s in comparison.summaries]
        if any(counts):
            rows.append([label, "", *map(str, counts), ""])
    lines = [f"# hpcrl compare: {len(paths)} runs", ""]
    lines += [
        f"- {name}: `{path}` ({s.status})"
        for name, path, s in zip(comparison.names, paths, comparison.summaries, strict=True)
    ]
    lines += ["", markdown_table(header, rows)]
    if plots:
        lines += ["", "## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots)]
    return "\n".join(lines) + "\n"


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
        from hpcrl.store import plots as plotting

        plot_paths = plotting.plot_compare(runs, out, max_points=max_points)
    markdown = render_compare_markdown(comparison, metrics_paths, plot_paths)
    markdown_path = out / "compare.md"
    markdown_path.write_text(markdown)
    return CompareResult(comparison=comparison, markdown=markdown, markdown_path=markdown_path, plots=plot_paths)


__all__ = [
    "DEFAULT_WINDOW",
    "CompareResult",
    "Comparison",
    "Interruption",
    "ReportResult",
    "RunData",
    "StepChange",
    "Summary",
    "WindowMeans",
    "build_compare",
    "build_report",
    "compare",
    "fmt",
    "largest_step_change",
    "load_run",
    "render_markdown",
    "resolve_metrics_path",
    "summarize",
    "window_size",
]
