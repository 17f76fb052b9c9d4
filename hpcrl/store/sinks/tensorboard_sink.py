"""TensorBoard event files: a scalar per metric per step, events and the config as text, the report's plots."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcrl.store.sinks.base import BaseSink, SinkSetup

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class TensorBoardSink(BaseSink):
    name = "tensorboard"

    def open(self, setup: SinkSetup) -> None:
        from torch.utils.tensorboard import SummaryWriter

        tensorboard = setup.cfg.tensorboard
        self.log_dir = setup.run_dir / "tensorboard" if tensorboard is True else Path(str(tensorboard))
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        config = json.dumps(setup.params, indent=2, sort_keys=False)
        # Markdown: four spaces keep the JSON's indentation as a code block.
        self._writer.add_text("config", "\n".join("    " + line for line in config.splitlines()), 0)

    def write_row(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def event(self, kind: str, step: int | None, detail: Mapping[str, Any]) -> None:
        self._writer.add_text(f"events/{kind}", json.dumps(dict(detail), sort_keys=True), self.step_of(step))
        self._writer.flush()  # events are rare, and often the last thing a job writes

    def images(self, step: int | None, paths: Sequence[Path]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        at = self.step_of(step)
        file_writer = self._writer._get_file_writer()
        for path in paths:
            data = path.read_bytes()
            width, height = png_size(data)
            # The PNG goes in as it is: TensorBoard shows encoded images, so nothing decodes and re-encodes it.
            image = Summary.Image(height=height, width=width, colorspace=4, encoded_image_string=data)
            file_writer.add_summary(Summary(value=[Summary.Value(tag=f"report/{path.stem}", image=image)]), at)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)
