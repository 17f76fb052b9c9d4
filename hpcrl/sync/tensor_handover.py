"""The same-host `/update_weights_from_tensor` request for one bucket, in the format each engine kind reads.

The embedded engine takes hpcrl's JSON handover (hpcrl/weightwire/handover.py: it never unpickles request data);
a stock SGLang server takes only its own pickled flattened bucket (hpcrl/weightwire/sglang_payload.py) and exits
on anything else. Used by the driver's push (hpcrl/sync/push.py) and by the MPI agent on an engine node
(hpcrl/sync/mpi.py), which hands what it received to its local engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from hpcrl.engine.protocol.control import UpdateWeightsFromTensor
from hpcrl.sync.transport import Transport, TransportContext
from hpcrl.weightwire.buckets import Bucket
from hpcrl.weightwire.handover import create_handover
from hpcrl.weightwire.sglang_payload import LOAD_FORMAT, sglang_bucket_payload


@contextlib.contextmanager
def tensor_update_request(
    bucket: Sequence[tuple[str, torch.Tensor]], *, engine_kind: str, tp_size: int = 1, apply_strategy: str = "replace"
) -> Iterator[UpdateWeightsFromTensor]:
    """The request for `bucket`; its buffer lives until the context exits (the engine maps it in place)."""
    if engine_kind == "sglang":
        with sglang_bucket_payload(bucket, tp_size=tp_size) as payloads:
            yield UpdateWeightsFromTensor(
                serialized_named_tensors=tuple(payloads), load_format=LOAD_FORMAT, flush_cache=False
            )
        return
    with create_handover(bucket) as payload:
        yield UpdateWeightsFromTensor(
            serialized_named_tensors=(payload,), flush_cache=False, apply_strategy=apply_strategy
        )


class TensorSender(Transport):
    """The same-host transport of a push: every engine maps one buffer per bucket (nothing to form: each bucket
    is handed over on its own)."""

    def __init__(self, ctx: TransportContext) -> None:
        self.each = ctx.each  # the push's fan-out: one call per engine, in parallel, failures named
        self.engine_kind, self.tp_size = ctx.engine_kind, ctx.engine_tp_size
        self.apply_strategy = ctx.apply_strategy

    def send(self, bucket: Bucket) -> None:
        with tensor_update_request(
            bucket, engine_kind=self.engine_kind, tp_size=self.tp_size, apply_strategy=self.apply_strategy
        ) as request:
            self.each(lambda e: e.update_weights_from_tensor(request), "update_weights_from_tensor")
