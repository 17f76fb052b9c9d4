"""A push as buckets: consecutive runs of tensors of one dtype, each at most a byte bound.

A bucket is what one transport call carries (one HTTP request and its bytes); the dtypes are the ones every
format of the push can name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

Bucket = list[tuple[str, torch.Tensor]]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a weight travels in, by the name the wire uses (torch's without its `torch.` prefix)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire's name of `dtype`; ValueError for one that no format of a push carries."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {name} cannot travel in a weight update; use one of {', '.join(DTYPES)}")
    return name


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name (`torch.` prefix accepted); ValueError naming the valid ones."""
    name = name.removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported for weights; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Consecutive runs of tensors of one dtype, each at most bucket_bytes (a bigger tensor goes alone)."""
    bucket: Bucket = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def bucket_bytes(bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)
