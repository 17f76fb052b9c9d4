"""PNG plots of one run (``plot_run``) or several (``plot_compare``), for ``hpcrl report`` / ``hpcrl compare``.

matplotlib is imported inside the functions, and figures are plain ``matplotlib.figure.Figure`` objects
drawn by Agg: no pyplot, so no global backend switch and no figure registry that leaks in a notebook.

Long runs: a series with more than ``max_points`` steps is drawn as the mean of consecutive bins with a
min-max band, because a 10,000-step reward line is a solid blob at any sensible image width. Speed comes
mostly from elsewhere (tools/bench/report_speed.py): fixed margins instead of a layout engine, and one
collection for all thermal-pause intervals; binning saves little, as Agg already simplifies long paths.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from hpcrl.report import DEFAULT_MAX_POINTS
from hpcrl.report.run import RunData
from hpcrl.report.summary import parent_phase, phase_names

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 100
# Below this many steps every point gets a marker (a 6-step smoke run stays readable); above, markers clutter.
_MARKER_MAX_POINTS = 60
# A run at least this long gets a moving average drawn over its faint raw curve.
_SMOOTH_MIN_POINTS = 30
# Up to this many steps the phase times are stacked bars (one per step); beyond, a stacked area.
_BAR_MAX_POINTS = 120
# Event kinds drawn as vertical lines on the per-step plots: (colour, label).
EVENT_STYLE = {
    "preempted": ("tab:red", "preempted"),
    "resumed": ("tab:green", "resumed"),
    "engine_dead": ("tab:orange", "engine dead"),
    "engine_restarted": ("tab:olive", "engine restarted"),
    "engine_gave_up": ("black", "engines gave up"),
}
_MAX_EVENT_LINES = 200


# -- data reduction ----------------------------------------------------------------------------------


def binned(
    steps: np.ndarray, values: np.ndarray, max_points: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(x, mean, lo, hi)``: the raw series (lo = hi = None) or, past ``max_points``, per-bin mean/min/max."""
    n = values.shape[0]
    if n <= max_points:
        return steps.astype(np.float64), values, None, None
    size = math.ceil(n / max_points)
    pad = (-n) % size
    # NaN padding is ignored by the nan-reductions; an all-NaN bin (metric missing there) stays NaN, a gap.
    v = np.concatenate([values, np.full(pad, np.nan)]).reshape(-1, size)
    x = np.concatenate([steps.astype(np.float64), np.full(pad, np.nan)]).reshape(-1, size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "Mean of empty slice" for those gaps
        return np.nanmean(x, axis=1), np.nanmean(v, axis=1), np.nanmin(v, axis=1), np.nanmax(v, axis=1)


def moving_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` rows, ignoring NaN; NaN where a window holds no value."""
    finite = np.isfinite(values)
    sums = np.cumsum(np.where(finite, values, 0.0))
    counts = np.cumsum(finite)
    sums[window:] = sums[window:] - sums[:-window]
    counts[window:] = counts[window:] - counts[:-window]
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def bin_note(num_rows: int, max_points: int, template: str = " [means of {k} steps, min-max bands]") -> str:
    """The title note that says how a long run was reduced ("" for a run drawn point by point)."""
    return template.format(k=math.ceil(num_rows / max_points)) if num_rows > max_points else ""


# -- drawing helpers ---------------------------------------------------------------------------------


def _figure(
    nrows: int, ncols: int = 1, *, width: float = 10.0, row_height: float = 2.6, titled_axes: bool = False
) -> tuple[Figure, Any]:
    from matplotlib.figure import Figure

    height = 0.9 + row_height * nrows
    fig = Figure(figsize=(width, height))
    # Fixed margins in inches instead of a layout engine: constrained layout draws every figure twice and
    # took a third of the plotting time of a 10,000-step report; these margins fit the labels drawn here.
    fig.subplots_adjust(
        left=0.85 / width,
        right=1 - 0.25 / width,
        bottom=0.55 / height,
        top=1 - (0.7 if titled_axes else 0.45) / height,
        hspace=(0.6 if titled_axes else 0.35) / row_height,
        wspace=0.9 * ncols / width,
    )
    axes = fig.subplots(nrows, ncols, sharex=True, squeeze=False)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    return fig, axes


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    return path


SMOOTH_AUTO = -1
"""``smooth`` of plot_run/plot_compare: a moving mean over a 20th of the steps on runs of 30 steps or more."""


def draw_series(
    ax: Axes,
    steps: np.ndarray,
    values: np.ndarray,
    *,
    label: str,
    color: str | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    smooth: bool = True,
    raw_alpha: float = 0.35,
    reduce: Literal["mean", "max"] = "mean",
    smooth_window: int | None = None,
    smooth_min_points: int = _SMOOTH_MIN_POINTS,
) -> None:
    """One metric per step: raw (markers when short), raw + moving mean when long, bins past ``max_points``.

    ``reduce="max"`` draws each bin's maximum without a band, for peaks (temperatures) that a mean hides.
    ``smooth_window`` (default: a 20th of the steps) is fixed by ``plot_compare`` so that runs compare fairly.
    """
    n = values.shape[0]
    if n > max_points:
        x, mean, lo, hi = binned(steps, values, max_points)
        assert lo is not None and hi is not None
        if reduce == "max":
            ax.plot(x, hi, color=color, lw=1.2, label=label)
            return
        (line,) = ax.plot(x, mean, color=color, lw=1.2, label=label)
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
        return
    if smooth and n >= smooth_min_points:
        window = smooth_window or max(2, n // 20)
        (line,) = ax.plot(steps, values, color=color, lw=0.8, alpha=raw_alpha)
        mean = moving_mean(values, window)
        ax.plot(steps, mean, color=line.get_color(), lw=1.6, label=f"{label} ({window}-step mean)")
        return
    marker = "o" if n <= _MARKER_MAX_POINTS else None
    ax.plot(steps, values, color=color, lw=1.2, marker=marker, ms=3, label=label)


def mark_events(ax: Axes, events: Sequence[dict[str, Any]], *, legend: bool = True) -> None:
    """Vertical lines at the steps of preemptions, resumes and engine failures (one legend entry per kind)."""
    seen: set[str] = set()
    marked = [e for e in events if e["kind"] in EVENT_STYLE and e["step"] is not None][:_MAX_EVENT_LINES]
    for event in marked:
        color, label = EVENT_STYLE[event["kind"]]
        show = legend and label not in seen
        ax.axvline(event["step"], color=color, lw=1.0, ls="--", alpha=0.8, label=label if show else None)
        seen.add(label)


def _log_y(ax: Axes) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    # Compact labels ("2e-07") at 1, 2 and 5 of each decade: a gap that stays within one decade still gets
    # several labelled ticks, and "2 x 10^-7" would overflow the fixed left margin.
    compact = FuncFormatter(lambda v, _pos: f"{v:.0e}")
    ax.yaxis.set_major_formatter(compact)
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
    ax.yaxis.set_minor_formatter(compact)
    ax.tick_params(axis="y", which="minor", labelsize=8)


def _finish(ax: Axes, ylabel: str) -> None:
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)


# -- one run -----------------------------------------------------------------------------------------

_REWARD_PANELS = (
    ("mean reward", (("rollout/reward_mean", "mean reward of the step's samples"),)),
    ("response length (tokens)", (("rollout/response_len_mean", "mean"), ("rollout/response_len_max", "max"))),
    (
        "share of samples",
        (
            ("rollout/truncated_share", "truncated"),
            ("rollout/aborted_share", "aborted"),
            ("rollout/reward_failed_share", "reward failed"),
        ),
    ),
)
_REWARD_TITLES = {
    "mean reward": "reward",
    "response length (tokens)": "response length",
    "share of samples": "truncated or failed samples",
}
# Usually all zero: drawn only when non-zero somewhere, else they add a flat line on the axis.
_ONLY_IF_NONZERO = frozenset({"rollout/aborted_share", "rollout/reward_failed_share"})


def plot_reward(run: RunData, out_dir: Path, max_points: int, smooth: int = SMOOTH_AUTO) -> Path | None:
    panels = [(y, [(k, lab) for k, lab in series if k in run.metrics]) for y, series in _REWARD_PANELS]
    # A panel whose every series is 0 throughout (nothing truncated, aborted or failed) is left out.
    panels = [(y, series) for y, series in panels if any(not flat_zero(run.metrics[k]) for k, _ in series)]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for i, (ax, (ylabel, series)) in enumerate(zip(axes[:, 0], panels, strict=True)):
        for key, label in series:
            values = run.metrics[key]
            if key in _ONLY_IF_NONZERO and not np.nanmax(values, initial=0.0) > 0:
                continue
            _draw(ax, run.steps, values, label=label, max_points=max_points, smooth=smooth)
        mark_events(ax, run.events, legend=i == 0)
        _finish(ax, ylabel)
    axes[-1, 0].set_xlabel("step")
    what = ", ".join(_REWARD_TITLES[y] for y, _ in panels)
    fig.suptitle(f"{run.name}: {what} per step{bin_note(run.num_rows, max_points)}")
    return _save(fig, out_dir / "reward.png")


def timing_layers(run: RunData) -> list[tuple[str, np.ndarray]]:
    """Per-step seconds that add up to ``timing/total_s``, each second in one layer only.

    Some phases are timed inside others (``parent_phase``): logprob inside train, sync_pause, sync_send and
    sync_commit inside sync. A phase with parts is drawn as its parts plus "<phase> (rest)", never as a
    whole on top of them; the seconds no phase covers are "other".
    """

    def col(phase: str) -> np.ndarray:
        values = run.metrics[f"timing/{phase}_s"]
        return np.nan_to_num(values, nan=0.0)

    phases = [p for p in phase_names(run.metrics) if p != "total"]
    layers: list[tuple[str, np.ndarray]] = []
    for phase in phases:
        if parent_phase(phase, phases) is not None:
            continue
        parts = [p for p in phases if parent_phase(p, phases) == phase]
        if not parts:
            layers.append((phase, col(phase)))
            continue
        for part in parts:
            layers.append(("logprob (forward part of train)" if part == "logprob" else part, col(part)))
        rest = np.clip(col(phase) - np.sum([col(p) for p in parts], axis=0), 0.0, None)
        layers.append((f"{phase} (rest)", rest))
    if "timing/total_s" in run.metrics and layers:
        layers.append(("other", np.clip(col("total") - np.sum([v for _, v in layers], axis=0), 0.0, None)))
    return layers


def plot_timing(run: RunData, out_dir: Path, max_points: int, smooth: int = SMOOTH_AUTO) -> Path | None:
    layers = timing_layers(run)
    if not layers:
        return None
    fig, axes = _figure(1, row_height=4.0)
    ax = axes[0, 0]
    labels = [name for name, _ in layers]
    if run.num_rows <= _BAR_MAX_POINTS:
        # Bars, not an area: an area interpolates between steps, and a short run has few of them.
        bottom = np.zeros(run.num_rows)
        for (name, values), color in zip(layers, _colors(len(layers)), strict=True):
            ax.bar(run.steps, values, bottom=bottom, width=0.8, label=name, color=color)
            bottom = bottom + values
    else:
        x = binned(run.steps, run.steps.astype(np.float64), max_points)[0]
        ys = [binned(run.steps, values, max_points)[1] for _, values in layers]
        ax.stackplot(x, *ys, labels=labels, colors=_colors(len(layers)), alpha=0.9)
    mark_events(ax, run.events)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step")
    # Headroom above the stack for a legend in rows, which would otherwise cover the bottom layers.
    ax.set_ylim(0, max(float(np.nanmax(np.sum([v for _, v in layers], axis=0), initial=0.0)), 1e-9) * 1.4)
    ax.legend(loc="upper left", fontsize=8, ncols=4)
    note = bin_note(run.num_rows, max_points, " [means of {k} steps]")
    fig.suptitle(f"{run.name}: time per step by phase (seconds, stacked){note}")
    return _save(fig, out_dir / "timing.png")


def _colors(n: int) -> list[str]:
    """n distinct colours: the ten of matplotlib's default cycle, then their ten lighter shades (tab20)."""
    from matplotlib import colormaps

    pairs = [colormaps["tab20"](i) for i in range(20)]  # dark, light, dark, light, ...
    palette = [pairs[i] for i in range(0, 20, 2)] + [pairs[i] for i in range(1, 20, 2)]
    if n > len(palette):
        palette += [colormaps["turbo"](i / (n - len(palette))) for i in range(n - len(palette))]
    from matplotlib.colors import to_hex

    return [to_hex(c) for c in palette[:n]]


_GAP_SERIES = (
    ("train/train_rollout_logprob_abs_diff", "mean |trainer - engine| log-prob"),
    ("train/train_rollout_logprob_max_abs_diff", "max |trainer - engine| log-prob"),
    ("train/train_rollout_kl", "KL(engine || trainer)"),
)


def plot_logprob_gap(run: RunData, out_dir: Path, max_points: int, smooth: int = SMOOTH_AUTO) -> Path | None:
    series = [(k, label) for k, label in _GAP_SERIES if k in run.metrics]
    if not series:
        return None
    fig, axes = _figure(1, row_height=3.6)
    ax = axes[0, 0]
    for key, label in series:
        draw_series(ax, run.steps, run.metrics[key], label=label, max_points=max_points, smooth=False)
    values = np.concatenate([run.metrics[k] for k, _ in series])
    if (values[np.isfinite(values)] > 0).any():
        # Gaps span 1e-14 (KL) to 1e-1: only a log axis shows them together. Exact zeros drop out of it.
        _log_y(ax)
        scale = " (log scale; zeros not drawn)"
    else:
        scale = ": exactly 0, bit-identical"
    mark_events(ax, run.events)
    ax.set_xlabel("step")
    _finish(ax, "log-prob gap (nats per token)")
    fig.suptitle(f"{run.name}: trainer vs engine log-prob gap per step{scale}{bin_note(run.num_rows, max_points)}")
    return _save(fig, out_dir / "logprob_gap.png")


# Per metric key: the panel's title in words and its y-axis label (with the unit).
METRIC_LABELS: dict[str, tuple[str, str]] = {
    "train/loss": ("Training loss", "loss"),
    "train/pg_loss": ("Policy-gradient loss", "loss"),
    "train/entropy": ("Policy entropy", "nats per token"),
    "train/grad_norm": ("Gradient norm (before clipping)", "L2 norm"),
    "train/ppo_kl": ("KL between old and new policy (PPO)", "nats per token"),
    "train/pg_clipfrac": ("Tokens clipped by the PPO ratio", "share of tokens"),
    "rollout/tokens_per_s": ("Rollout throughput", "tokens/s"),
    "sync/seconds": ("Weight sync time", "seconds"),
    "timing/total_s": ("Step time", "seconds per step"),
    "rollout/zero_std_group_share": ("Groups without learning signal (equal rewards)", "share of groups"),
    "fleet/engines_live": ("Live engines", "engines"),
    "fleet/engines_joined": ("Engines that joined (from jobs of their own)", "engines per step"),
    "fleet/engines_left": ("Joined engines that left", "engines per step"),
    "eval/accuracy_greedy": ("greedy accuracy", "share of prompts"),
    "eval/pass_at_k": ("pass@k", "share of prompts"),
    "eval/mean_at_k": ("mean reward of k samples", "mean reward"),
}


def metric_label(key: str) -> tuple[str, str]:
    """(title, y label) of a metric key: words and unit where known, else the key with the unit its name says."""
    if key in METRIC_LABELS:
        return METRIC_LABELS[key]
    name = key.rsplit("/", 1)[-1]
    for suffix, unit in (("_s", "seconds"), ("_gb", "GB"), ("_share", "share"), ("_c", "degrees C")):
        if name.endswith(suffix):
            return key, unit
    return key, "value"


def flat_zero(values: np.ndarray) -> bool:
    """Whether a series is 0 (or missing) at every step: a panel of it shows nothing but a line on the axis."""
    finite = values[np.isfinite(values)]
    return not (finite != 0).any()


def _grid_plot(
    run: RunData,
    keys: Sequence[str],
    out_path: Path,
    title: str,
    max_points: int,
    ncols: int = 2,
    smooth: int = SMOOTH_AUTO,
) -> Path | None:
    present = [k for k in keys if k in run.metrics]
    keys = [k for k in present if not flat_zero(run.metrics[k])]
    zeros = [metric_label(k)[0] for k in present if k not in keys]
    if not keys:
        return None
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = _figure(nrows, ncols, width=12.0, row_height=2.4, titled_axes=True)
    for i, (ax, key) in enumerate(zip(axes.flat, keys, strict=False)):
        panel_title, ylabel = metric_label(key)
        _draw(ax, run.steps, run.metrics[key], label=panel_title, max_points=max_points, smooth=smooth)
        mark_events(ax, run.events, legend=i == 0)
        ax.set_title(panel_title, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        # The key is each panel's title: one legend, on the first panel, explains the events and the smoothing.
        if i == 0:
            ax.legend(loc="best", fontsize=7)
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    for column in axes.T:
        # The lowest drawn panel of each column carries the step axis (a hidden last panel would take it along).
        shown = [ax for ax in column if ax.get_visible()]
        if shown:
            shown[-1].xaxis.set_tick_params(labelbottom=True)
            shown[-1].set_xlabel("step")
    zero_note = f" (always 0, not drawn: {', '.join(zeros)})" if zeros else ""
    fig.suptitle(f"{run.name}: {title}{bin_note(run.num_rows, max_points)}{zero_note}")
    return _save(fig, out_path)


def _draw(ax: Axes, steps: np.ndarray, values: np.ndarray, *, smooth: int, **kw: Any) -> None:
    """draw_series with the report's smoothing choice: SMOOTH_AUTO, 0 (raw only) or a window of N steps."""
    if smooth == SMOOTH_AUTO:
        draw_series(ax, steps, values, **kw)
    elif smooth <= 1:
        draw_series(ax, steps, values, smooth=False, **kw)
    else:
        draw_series(ax, steps, values, smooth_window=smooth, smooth_min_points=smooth + 1, **kw)


TRAIN_KEYS = ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/ppo_kl", "train/pg_clipfrac")
THROUGHPUT_KEYS = ("rollout/tokens_per_s", "sync/seconds", "timing/total_s", "rollout/zero_std_group_share")


def plot_train(run: RunData, out_dir: Path, max_points: int, smooth: int = SMOOTH_AUTO) -> Path | None:
    title = "training diagnostics per step"
    return _grid_plot(run, TRAIN_KEYS, out_dir / "train.png", title, max_points, smooth=smooth)


def plot_throughput(run: RunData, out_dir: Path, max_points: int, smooth: int = SMOOTH_AUTO) -> Path | None:
    title = "throughput and time per step"
    return _grid_plot(run, THROUGHPUT_KEYS, out_dir / "throughput.png", title, max_points, smooth=smooth)


def pause_spans(run: RunData) -> list[tuple[float, float]]:
    """Thermal pauses as step intervals: from the pause/resume events, else from ``guard/paused_s > 0``."""
    spans: list[tuple[float, float]] = []
    open_at: dict[object, int] = {}
    last = float(run.steps[-1]) + 0.5 if run.num_rows else 0.0
    for event in run.events:
        if event["kind"] not in ("thermal_pause", "thermal_resume") or event["step"] is None:
            continue
        # Per node: its guard resumes when all its GPUs are cool, naming the hottest, not the one that paused.
        node = event["detail"].get("node")
        if event["kind"] == "thermal_pause":
            open_at.setdefault(node, event["step"])
        elif node in open_at:
            spans.append((open_at.pop(node) - 0.5, event["step"] + 0.5))
    # A pause without its resume is still going on: shade it to the last step.
    spans += [(start - 0.5, last) for start in open_at.values()]
    paused = run.column("guard/paused_s")
    if not spans and paused is not None:
        flags = np.concatenate([[False], np.nan_to_num(paused) > 0, [False]])
        edges = np.flatnonzero(np.diff(flags.astype(np.int8)))
        spans = [(run.steps[a] - 0.5, run.steps[b - 1] + 0.5) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    return _merge(spans)


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((float(start), float(stop)))
    return merged


def plot_thermal(run: RunData, out_dir: Path, max_points: int, smooth: int = SMOOTH_AUTO) -> Path | None:
    temps = run.keys_under("guard/peak_temp_c/")
    others = [k for k in run.keys_under("guard/") if k not in temps]
    has_events = any(e["kind"] in ("thermal_pause", "thermal_resume") for e in run.events)
    if not temps and not others and not has_events:
        return None
    spans = pause_spans(run)
    fig, axes = _figure(2 if others else 1, row_height=3.2)
    ax = axes[0, 0]
    for key in temps:
        label = key[len("guard/peak_temp_c/") :]
        draw_series(ax, run.steps, run.metrics[key], label=label, max_points=max_points, smooth=False, reduce="max")
    if not temps:
        ax.text(0.5, 0.5, "no guard/peak_temp_c/* recorded", transform=ax.transAxes, ha="center", va="center")
    for i, ax_i in enumerate(axes[:, 0]):
        if spans:
            # One collection for all intervals: hundreds of axvspan patches take a second to draw.
            ranges = [(start, stop - start) for start, stop in spans]
            pause_label = "thermal pause" if i == 0 else None
            ax_i.broken_barh(
                ranges, (0, 1), transform=ax_i.get_xaxis_transform(), color="tab:red", alpha=0.15, label=pause_label
            )
    _finish(ax, "peak GPU temperature (degrees C)")
    for key in others:
        draw_series(axes[1, 0], run.steps, run.metrics[key], label=key, max_points=max_points, smooth=False)
    if others:
        _finish(axes[1, 0], "guard/*")
    axes[-1, 0].set_xlabel("step")
    note = bin_note(run.num_rows, max_points, " [max of each {k} steps]")
    fig.suptitle(f"{run.name}: GPU temperature per step, {len(spans)} thermal pause interval(s) shaded{note}")
    return _save(fig, out_dir / "thermal.png")


def plot_async(run: RunData, out_dir: Path, max_points: int, smooth: int = SMOOTH_AUTO) -> Path | None:
    # rollout.mode=async logs buffer/* (queue, in flight, staleness, drops, waits: docs/async.md).
    buffer = run.keys_under("buffer/")
    staleness = sorted(k for k in run.metrics if "staleness" in k and not k.startswith(("queue/", "buffer/")))
    keys = [*buffer, *run.keys_under("queue/"), *staleness]
    title = "rollout queue and staleness per step"
    return _grid_plot(run, keys, out_dir / "async.png", title, max_points, smooth=smooth)


FLEET_KEYS = ("fleet/engines_live", "fleet/engines_joined", "fleet/engines_left")


def plot_fleet(run: RunData, out_dir: Path, max_points: int, smooth: int = SMOOTH_AUTO) -> Path | None:
    """Engines over time, for a run whose fleet changed (engines joined from other jobs, or left)."""
    live = run.metrics.get("fleet/engines_live")
    changed = any(k in run.metrics and not flat_zero(run.metrics[k]) for k in FLEET_KEYS[1:])
    if live is None or not (changed or np.unique(live[np.isfinite(live)]).size > 1):
        return None
    title = "engines over time"
    return _grid_plot(run, FLEET_KEYS, out_dir / "fleet.png", title, max_points, ncols=1, smooth=0)


def plot_eval(run: RunData, out_dir: Path, max_points: int, smooth: int = SMOOTH_AUTO) -> Path | None:
    """The held-out figures at the steps evaluation ran (markers joined by lines; the other rows are NaN).

    Accuracy and pass@k are shares of prompts (0 to 1); mean@k is a mean reward, on the reward's own scale, so
    it gets a panel of its own.
    """
    shares = [k for k in ("eval/accuracy_greedy", "eval/pass_at_k") if k in run.metrics]
    rewards = [k for k in ("eval/mean_at_k",) if k in run.metrics]
    panels = [group for group in (shares, rewards) if group]
    if not panels:
        return None
    ks = run.column("eval/k")
    k = int(np.nanmax(ks)) if ks is not None and np.isfinite(ks).any() else None
    fig, axes = _figure(len(panels), row_height=3.0)
    for i, (ax, keys) in enumerate(zip(axes[:, 0], panels, strict=True)):
        for key in keys:
            values = run.metrics[key]
            at = np.isfinite(values)
            label = metric_label(key)[0]
            label = label.replace("@k", f"@{k}").replace(" k ", f" {k} ") if k else label
            ax.plot(run.steps[at], values[at], marker="o", ms=3, lw=1.2, label=label)
        mark_events(ax, run.events, legend=i == 0)
        _finish(ax, metric_label(keys[0])[1])
    axes[-1, 0].set_xlabel("after step")
    fig.suptitle(f"{run.name}: evaluation on held-out prompts")
    return _save(fig, out_dir / "eval.png")


def plot_memory(run: RunData, out_dir: Path, max_points: int, smooth: int = SMOOTH_AUTO) -> Path | None:
    keys = run.keys_under("memory/")
    if not keys:
        return None
    fig, axes = _figure(1, row_height=3.6)
    ax = axes[0, 0]
    for key in keys:
        draw_series(ax, run.steps, run.metrics[key], label=key[len("memory/") :], max_points=max_points, smooth=False)
    ax.set_xlabel("step")
    _finish(ax, "memory (unit in the key)")
    fig.suptitle(f"{run.name}: memory per phase per step{bin_note(run.num_rows, max_points)}")
    return _save(fig, out_dir / "memory.png")


PLOTTERS = (
    plot_reward,
    plot_timing,
    plot_logprob_gap,
    plot_train,
    plot_throughput,
    plot_thermal,
    plot_async,
    plot_fleet,
    plot_eval,
    plot_memory,
)


def plot_run(
    run: RunData, out_dir: Path, *, max_points: int = DEFAULT_MAX_POINTS, smooth: int = SMOOTH_AUTO
) -> list[Path]:
    """Writes every plot the run has data for into ``out_dir``; returns their paths.

    ``smooth``: SMOOTH_AUTO (a moving mean over a 20th of the steps, on runs of 30 steps or more), 0 (raw
    values only) or N (a moving mean over N steps drawn over the raw values).
    """
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    paths = [plotter(run, out_dir, max_points, smooth) for plotter in PLOTTERS]
    return [p for p in paths if p is not None]


# -- several runs ------------------------------------------------------------------------------------

COMPARE_PANELS = (
    ("rollout/reward_mean", "Mean reward", "reward"),
    ("rollout/response_len_mean", "Mean response length", "tokens"),
    ("rollout/truncated_share", "Truncated responses", "share of samples"),
    ("train/train_rollout_logprob_abs_diff", "Log-prob gap, mean |trainer - engine|", "nats per token"),
    ("timing/total_s", "Step time", "seconds per step"),
    ("rollout/tokens_per_s", "Rollout throughput", "tokens/s"),
)


def plot_compare(
    runs: Sequence[RunData], out_dir: Path, *, max_points: int = DEFAULT_MAX_POINTS, smooth: int = SMOOTH_AUTO
) -> list[Path]:
    """One figure, one panel per metric, one curve per run (``compare.png``); all-zero metrics are left out."""
    panels = [
        (k, label, unit)
        for k, label, unit in COMPARE_PANELS
        if any((v := r.column(k)) is not None and not flat_zero(v) for r in runs)
    ]
    if not panels:
        return []
    fig, axes = _figure(math.ceil(len(panels) / 2), 2, width=13.0, row_height=2.8, titled_axes=True)
    longest = max(r.num_rows for r in runs)
    # One smoothing window for all runs: per-run windows would smooth a longer run more and bias the eye.
    window = max(2, longest // 20) if smooth == SMOOTH_AUTO else smooth
    colors = _colors(len(runs))
    for i, (ax, (key, label, unit)) in enumerate(zip(axes.flat, panels, strict=False)):
        positive = False
        for j, run in enumerate(runs):
            values = run.column(key)
            if values is None or not run.num_rows:
                continue
            draw_series(
                ax,
                run.steps,
                values,
                label=run.name,
                color=colors[j],
                max_points=max_points,
                raw_alpha=0.15,
                smooth=window > 1,
                smooth_window=window,
                smooth_min_points=_SMOOTH_MIN_POINTS if smooth == SMOOTH_AUTO else window + 1,
            )
            positive = positive or bool((values[np.isfinite(values)] > 0).any())
        if key == "train/train_rollout_logprob_abs_diff" and positive:
            _log_y(ax)
        ax.set_title(label, fontsize=10)
        ax.set_ylabel(unit, fontsize=8)
        if i == 0:
            ax.legend(loc="best", fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[-1, :]:
        ax.set_xlabel("step")
    fig.suptitle(f"{len(runs)} runs: " + ", ".join(r.name for r in runs) + bin_note(longest, max_points))
    return [_save(fig, out_dir / "compare.png")]
