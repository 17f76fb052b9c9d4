"""The same-host `/update_weights_from_tensor` request for one bucket, in the format each engine kind reads.

The embedded engine takes hpcrl's JSON handover (hpcrl/sync/handover.py: it never unpickles request data);
a stock SGLang server takes only its own pickled flattened bucket (hpcrl/sync/sglang_payload.py) and exits
on anything else. Used by the driver's push (hpcrl/sync/push.py) and by the MPI agent on an engine node
(hpcrl/sync/mpi.py), which hands what it received to its local engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from hpcrl.engine.client import EngineClient
from hpcrl.engine.protocol import UpdateWeightsFromTensor
from hpcrl.sync.handover import create_handover
from hpcrl.sync.sglang_payload import LOAD_FORMAT, sglang_bucket_payload


@contextlib.contextmanager
def tensor_update_request(
    bucket: Sequence[tuple[str, torch.Tensor]], *, engine_kind: str, tp_size: int = 1
) -> Iterator[UpdateWeightsFromTensor]:
    """The request for `bucket`; its buffer lives until the context exits (the engine maps it in place)."""
    if engine_kind == "sglang":
        with sglang_bucket_payload(bucket, tp_size=tp_size) as payloads:
            yield UpdateWeightsFromTensor(
                serialized_named_tensors=tuple(payloads), load_format=LOAD_FORMAT, flush_cache=False
            )
        return
    with create_handover(bucket) as payload:
        yield UpdateWeightsFromTensor(serialized_named_tensors=(payload,), flush_cache=False)


EachFn = Callable[[Callable[[EngineClient], Any], str], list[Any]]


class TensorSender:
    """The same-host transport of a push: every engine maps one buffer per bucket."""

    def __init__(self, each: EachFn, *, engine_kind: str, tp_size: int) -> None:
        self.each = each  # the push's fan-out: one call per engine, in parallel, failures named
        self.engine_kind, self.tp_size = engine_kind, tp_size

    def connect(self) -> None:
        pass

    def reconnect(self, engines: Sequence[EngineClient]) -> None:
        pass  # nothing to form: each bucket is handed over on its own

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        with tensor_update_request(bucket, engine_kind=self.engine_kind, tp_size=self.tp_size) as request:
            self.each(lambda e: e.update_weights_from_tensor(request), "update_weights_from_tensor")

    def close(self) -> None:
        pass
