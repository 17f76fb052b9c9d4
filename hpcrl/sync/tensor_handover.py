"""The same-host `/update_weights_from_tensor` request for one bucket, in the format each engine kind reads.

The embedded engine takes hpcrl's JSON handover (hpcrl/sync/handover.py: it never unpickles request data);
a stock SGLang server takes only its own pickled flattened bucket (hpcrl/sync/sglang_payload.py) and exits
on anything else. Used by the driver's push (hpcrl/sync/push.py) and by the MPI agent on an engine node
(hpcrl/sync/mpi.py), which hands what it received to its local engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

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
