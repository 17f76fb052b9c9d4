"""The numbers of ``hpcrl report`` / ``hpcrl compare`` and their markdown, from ``RunData``.

Window means: "first N" / "last N" are the NaN-ignoring means of a metric over the first and the last N
rows. N is capped at half the rows so that the two windows never overlap (a 6-step run uses 3).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl.report import DEFAULT_WINDOW
from hpcrl.report.run import RunData

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
# The driver's phases in step order, with the parts that are timed inside a phase (see parent_phase).
PHASE_ORDER = (
    "rollout", "reward", "logprob", "train", "sync", "sync_pause", "sync_send", "sync_commit", "checkpoint", "total",
)  # fmt: skip


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
        # Engines of other jobs (docs/fleet.md): those that joined, and those that left again (cancelled, died).
        "engines joined": Interruption(len(_events_of(events, "engine_joined")), timed=False),
        "engines left": Interruption(len(_events_of(events, "engine_left")), timed=False),
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
    # The evaluated rows (eval.every_steps): (step, {eval key: value}), in step order.
    evaluations: list[tuple[int, dict[str, float]]] = field(default_factory=list)


EVAL_METRICS: tuple[tuple[str, str], ...] = (
    ("eval/accuracy_greedy", "greedy accuracy"),
    ("eval/pass_at_k", "pass@k"),
    ("eval/mean_at_k", "mean reward@k"),
)


def evaluations(run: RunData) -> list[tuple[int, dict[str, float]]]:
    """The rows where evaluation ran (its metrics are NaN on the other rows)."""
    first = run.column(EVAL_METRICS[0][0])
    if first is None:
        return []
    rows = []
    for i in np.flatnonzero(np.isfinite(first)):
        values = {k: float(run.metrics[k][i]) for k, _ in EVAL_METRICS if k in run.metrics}
        if "eval/k" in run.metrics:
            values["eval/k"] = float(run.metrics["eval/k"][i])
        rows.append((int(run.steps[i]), values))
    return rows


def parent_phase(phase: str, phases: Collection[str]) -> str | None:
    """The phase that ``phase`` is timed inside, or None: logprob is inside train, ``sync_send`` inside sync.

    A part's seconds are already in its parent's: a stack or a sum of phases must count them once.
    """
    if phase == "logprob":
        return "train" if "train" in phases else None
    parents = [p for p in phases if phase.startswith(p + "_")]
    return max(parents, key=len) if parents else None


def phase_names(metrics: Collection[str]) -> list[str]:
    """The phases of the ``timing/<phase>_s`` keys: the driver's in its order, each followed by its parts
    (``parent_phase``), then phases a future driver adds (e.g. "guard"), and "total" last."""
    found = [k[len("timing/") : -len("_s")] for k in metrics if k.startswith("timing/") and k.endswith("_s")]

    def order(phase: str) -> tuple[int, str]:
        return (PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER), phase)

    tops = sorted((p for p in found if p != "total" and parent_phase(p, found) is None), key=order)
    names: list[str] = []
    for top in tops:
        names += [top, *sorted((p for p in found if parent_phase(p, found) == top), key=order)]
    return [*names, "total"] if "total" in found else names


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
            phase_median_s={p: nanmedian(run.metrics[f"timing/{p}_s"]) for p in phase_names(run.metrics)},
            tokens_per_s_median=_median_of(run.column("rollout/tokens_per_s")),
            sync_median_s=_median_of(sync_s),
            sync_total_s=None if sync_s is None or np.isnan(sync_s).all() else float(np.nansum(sync_s)),
            sync_bytes_median=_median_of(run.column("sync/bytes")),
            interruptions=interruptions(run.events, run.metrics),
            extras=_extras(run),
            evaluations=evaluations(run),
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
        parent = parent_phase(phase, summary.phase_median_s)
        label = "logprob (forward, inside train)" if phase == "logprob" else phase
        label += f" (part of {parent})" if parent is not None and phase != "logprob" else ""
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


def _eval_lines(summary: Summary, max_rows: int = 12) -> list[str]:
    rows = summary.evaluations
    if not rows:
        return []
    k = int(rows[-1][1].get("eval/k", 0)) or "k"
    shown = rows if len(rows) <= max_rows else [*rows[: max_rows // 2], *rows[-max_rows // 2 :]]
    table = markdown_table(
        ["after step", *(label.replace("@k", f"@{k}") for _, label in EVAL_METRICS)],
        [[str(step), *(fmt(v.get(key)) for key, _ in EVAL_METRICS)] for step, v in shown],
    )
    note = f" ({len(rows) - len(shown)} rows in the middle left out)" if len(shown) < len(rows) else ""
    return ["", f"## Evaluation: held-out prompts, {len(rows)} evaluations{note}", "", table]


def render_markdown(summary: Summary, attrs: Mapping[str, Any], plots: Sequence[Path] = ()) -> str:
    """The report as markdown; the plots are linked relative to the report's folder."""
    lines = _header_lines(summary, attrs)
    if summary.num_rows:
        lines += [*_learning_lines(summary), *_eval_lines(summary), *_timing_lines(summary)]
    lines += _interruption_lines(summary)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


# -- several runs ------------------------------------------------------------------------------------


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
    for key, label in EVAL_METRICS:
        last = [s.evaluations[-1][1].get(key) if s.evaluations else None for s in comparison.summaries]
        if any(v is not None for v in last):
            rows.append([f"eval {label}", "last evaluation", *map(fmt, last), _across(last)])
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


__all__ = [
    "Comparison",
    "Interruption",
    "StepChange",
    "Summary",
    "WindowMeans",
    "compare",
    "evaluations",
    "fmt",
    "largest_step_change",
    "render_compare_markdown",
    "render_markdown",
    "summarize",
    "window_size",
]
