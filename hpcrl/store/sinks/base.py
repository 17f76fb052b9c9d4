"""`SinkSet`: the configured sinks, each isolated so that its failure costs one log line and never the run."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from hpcrl.store.run_dir import write_file_atomically
from hpcrl.store.sinks.config import LoggingConfig

Say = Callable[[str], None]
DrawPlots = Callable[[Path], Sequence[Path]]
"""Draws a run dir's report plots and returns their files (the caller passes hpcrl.report's: store sits below it)."""

IDS_FILE = "sinks.json"
"""RUN_DIR/sinks.json: the wandb and MLflow run ids, so that a resumed run continues the same runs there."""

# sink -> (module that must import, the hpcrl extra that installs it, the class implementing the sink)
CLIENTS: dict[str, tuple[str, str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard", "hpcrl.store.sinks.tensorboard_sink:TensorBoardSink"),
    "wandb": ("wandb", "wandb", "hpcrl.store.sinks.wandb_sink:WandbSink"),
    "mlflow": ("mlflow", "mlflow", "hpcrl.store.sinks.mlflow_sink:MlflowSink"),
}


class Sink(Protocol):
    """One destination of the run's metrics. Calls may raise: the SinkSet drops a sink that does.

    `step` is the step as the console counts it, 1 for the first (the steps done); None for an event outside
    any step."""

    name: str

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def event(self, kind: str, step: int | None, detail: Mapping[str, Any]) -> None: ...

    def images(self, step: int | None, paths: Sequence[Path]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class SinkSetup:
    """What every sink starts from: the `logging` section, the run, and the ids that continue its runs."""

    cfg: LoggingConfig
    run_dir: Path
    run_name: str
    params: dict[str, Any]
    """The resolved run config, as the run's parameters."""
    ids: dict[str, str]
    """RUN_DIR/sinks.json's ids; a sink adds the id of the run it creates, so that a resumed run continues it."""


class BaseSink(ABC):
    """The part every sink shares: it opens from a SinkSetup and remembers the last row's step, where an event
    or an image without a step of its own is shown."""

    name: ClassVar[str]

    def __init__(self, setup: SinkSetup) -> None:
        self.last_step = 0
        self.open(setup)

    @abstractmethod
    def open(self, setup: SinkSetup) -> None:
        """Connect to the tool: create or continue the run there, with the config as its parameters."""

    @abstractmethod
    def write_row(self, step: int, metrics: Mapping[str, float]) -> None: ...

    @abstractmethod
    def event(self, kind: str, step: int | None, detail: Mapping[str, Any]) -> None: ...

    @abstractmethod
    def images(self, step: int | None, paths: Sequence[Path]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.write_row(step, metrics)
        self.last_step = step

    def step_of(self, step: int | None) -> int:
        """The step to show an event or image at: its own, else the last row's."""
        return self.last_step if step is None else step


def steps_done(step_index: int) -> int:
    """The step a user reads (console, checkpoint names, report, sinks) for metrics.h5's 0-based step index."""
    return step_index + 1


def pip_command(extras: Sequence[str]) -> str:
    """The one pip command that installs these hpcrl extras."""
    return f"pip install 'hpcrl[{','.join(dict.fromkeys(extras))}]'"


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_clients(cfg: LoggingConfig) -> dict[str, str]:
    """{sink: extra} for every configured sink whose client package is not installed."""
    return {name: CLIENTS[name][1] for name in cfg.enabled if not has_module(CLIENTS[name][0])}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def open_sinks(
    logging: LoggingConfig,
    run_dir: Path,
    *,
    run_name: str,
    params: Mapping[str, Any],
    draw_plots: DrawPlots | None = None,
    say: Say = _stderr,
) -> SinkSet | None:
    """The sinks of the `logging` section for the run `run_name` in `run_dir`, with the resolved config `params` as
    run parameters and, at the end, `draw_plots`' images; None when none is configured (or none opened)."""
    if not logging.enabled:
        return None
    missing = missing_clients(logging)
    if missing:
        names = ", ".join(f"logging.{name}" for name in missing)
        say(
            f"warning: {names} set, but the client is not installed: {pip_command(list(missing.values()))}; "
            "this run goes on without it (metrics.h5 keeps every metric)"
        )
    ids = _read_ids(run_dir)
    sinks: list[Sink] = []
    for name in logging.enabled:
        if name in missing:
            continue
        module_name, _, target = CLIENTS[name]
        module_path, class_name = target.split(":")
        try:
            sink_class = getattr(importlib.import_module(module_path), class_name)
            setup = SinkSetup(cfg=logging, run_dir=run_dir, run_name=run_name, params=dict(params), ids=ids)
            sinks.append(sink_class(setup))
        except Exception as err:  # noqa: BLE001 - a sink must never stop the run
            say(f"warning: logging.{name} could not start ({type(err).__name__}: {err}); this run goes on without it")
    if not sinks:
        return None
    _write_ids(run_dir, ids)
    return SinkSet(sinks, run_dir=run_dir, draw_plots=draw_plots, say=say)


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        data = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _write_ids(run_dir: Path, ids: Mapping[str, str]) -> None:
    if not ids:
        return
    write_file_atomically(run_dir / IDS_FILE, (json.dumps(dict(ids), indent=1, sort_keys=True) + "\n").encode())


class SinkSet:
    """Fans rows and events out to the sinks; a sink that raises is reported once and dropped.

    Steps come in as metrics.h5 stores them, the 0-based step index, and go out to the sinks as the console,
    the checkpoint names and `hpcrl report` count them: the steps done, 1 for the first step."""

    def __init__(
        self, sinks: Sequence[Sink], *, run_dir: Path, draw_plots: DrawPlots | None = None, say: Say = _stderr
    ) -> None:
        self.sinks = list(sinks)
        self.run_dir = run_dir
        self.draw_plots = draw_plots
        self.say = say
        self._last_step: int | None = None

    @property
    def names(self) -> list[str]:
        return [sink.name for sink in self.sinks]

    def _each(self, what: str, call: Callable[[Sink], object]) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as err:  # noqa: BLE001 - a sink must never stop the run
                self.sinks.remove(sink)
                self.say(
                    f"warning: logging.{sink.name} failed to {what} ({type(err).__name__}: {err}); it is off for the "
                    "rest of this run, which goes on (metrics.h5 keeps every metric)"
                )
                try:
                    sink.close()
                except Exception:  # noqa: BLE001, S110 - already reported; closing is a courtesy
                    pass

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """`step`: metrics.h5's 0-based step index of the row."""
        row = {key: float(value) for key, value in metrics.items()}
        done = steps_done(step)
        self._last_step = done
        self._each(f"log step {done}", lambda sink: sink.log(done, row))

    def event(self, kind: str, step: int | None, detail: Mapping[str, Any]) -> None:
        """`step`: metrics.h5's 0-based step index of the event, or None outside any step."""
        done = None if step is None else steps_done(step)
        self._each(f"log event {kind}", lambda sink: sink.event(kind, done, detail))
        if kind == "finished":
            self._send_report(done)

    def _send_report(self, step: int | None) -> None:
        """The report's plots (RUN_DIR/report/*.png) as images, when hpcrl[report] is installed."""
        if not self.sinks or self.draw_plots is None:
            return
        if not has_module("matplotlib"):
            self.say(f"note: the report's plots are not sent to {', '.join(self.names)}: {pip_command(['report'])}")
            return
        try:
            plots = self.draw_plots(self.run_dir)
        except Exception as err:  # noqa: BLE001 - the run is done; its record is metrics.h5
            self.say(f"warning: the report's plots could not be drawn for the sinks ({type(err).__name__}: {err})")
            return
        at = step if step is not None else self._last_step
        self._each("send the report's plots", lambda sink: sink.images(at, plots))

    def close(self) -> None:
        self._each("close", lambda sink: sink.close())
        self.sinks = []
