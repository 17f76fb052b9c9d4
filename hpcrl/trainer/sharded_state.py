"""The torch backend's state under FSDP2, where parameters and AdamW moments are DTensor shards.

Weights leave a rank whole: a push gathers one tensor at a time as the transport's bucket loop reads them
(`GatheredWeights`), an export gathers one tensor at a time to rank 0's host memory. A checkpoint is not gathered:
each rank writes the pieces it holds (`local_pieces`, hpcrl/store/shards.py), and a rank of any rank count, under
either parallelism, reads back the box its own shard covers (`read_pieces`), from the files that overlap it alone.
Checkpoints of whole tensors (a DDP run's, or a sharded run's written before shard files) load too: each whole
tensor is cut into this rank's shard (`load_full`) with no collective.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hpcrl.model.hf import copy_config_and_tokenizer, publish_dir, staging_dir
from hpcrl.store.checkpoint import CheckpointError
from hpcrl.store.run_dir import RunDirError
from hpcrl.store.shards import ShardReader, write_shard


def gather_full(tensor: Tensor) -> Tensor:
    """The whole tensor: a DTensor's shards gathered (collective: every rank of its mesh must call it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class GatheredWeights(list[tuple[str, Tensor]]):
    """(name, tensor) pairs of a push whose sharded tensors are gathered one at a time, as they are iterated.

    A list (what a push is), of the sharded pairs: iterating it gathers each tensor whole in turn, so a push's
    bucket loop holds one bucket gathered, never the model. Every iteration is collective: rank 0 calls
    `before_pass` first, which tells the other ranks to iterate their own copy alongside (ranks.py). A pass left
    early (a consumer that stops at the first bad tensor) still gathers the rest, which the other ranks expect."""

    before_pass: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        if self.before_pass is not None:
            self.before_pass()
        pairs = super().__iter__()
        try:
            for name, tensor in pairs:
                yield name, gather_full(tensor)
        finally:
            for _, tensor in pairs:
                gather_full(tensor)


def host_state(named: Mapping[str, Tensor], keep: bool) -> dict[str, Tensor]:
    """Host copies of `named`, each gathered whole in turn; `keep` False (ranks other than 0) joins the gathers and
    keeps nothing."""
    out: dict[str, Tensor] = {}
    for name, tensor in named.items():
        whole = gather_full(tensor)
        if keep:
            out[name] = whole.detach().to("cpu", copy=True)
        del whole
    return out


def export_gathered(
    named: Mapping[str, Tensor], out_dir: Path, source_dir: Path, *, keep: bool, max_file_bytes: int
) -> Path:
    """Write `named` (sharded) as a Hugging Face directory, gathering one tensor at a time and writing each
    safetensors file (about `max_file_bytes`, the index naming them when there are several) as soon as it is full,
    so rank 0's host holds one file's tensors, never the model. Every rank calls it (`keep` True on rank 0 alone,
    which writes); the tensors are gathered in `named`'s order, as `host_state` gathers them."""
    files: list[list[str]] = [[]]
    size = 0
    for name, tensor in named.items():
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    tmp = staging_dir(out_dir) if keep else out_dir
    weight_map: dict[str, str] = {}
    for index, names in enumerate(files, start=1):
        file_name = "model.safetensors" if len(files) == 1 else f"model-{index:05d}-of-{len(files):05d}.safetensors"
        part = host_state({name: named[name] for name in names}, keep=keep)
        if keep:
            save_file({k: v.contiguous() for k, v in part.items()}, str(tmp / file_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file_name))
        del part
    if not keep:
        return out_dir
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for t in named.values())
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    copy_config_and_tokenizer(source_dir, tmp)
    return publish_dir(tmp, out_dir)


def _box(like: DTensor) -> tuple[list[int], list[int], bool]:
    """This rank's shard of `like` as a box of the whole tensor (offset, shape), and whether this rank is the one
    that writes it (the first replica under hybrid sharding, where several ranks hold the same piece)."""
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    coordinate = list(like.device_mesh.get_coordinate() or [])
    first = all(coordinate[d] == 0 for d, p in enumerate(like.placements) if isinstance(p, Replicate))
    return list(offset), list(shape), first


def local_pieces(named: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, list[int], list[int]]]:
    """The pieces of `named`'s sharded tensors this rank writes: {name: (host copy of its shard, whole shape,
    offset)}; no collective."""
    out: dict[str, tuple[Tensor, list[int], list[int]]] = {}
    for name, tensor in named.items():
        if isinstance(tensor, DTensor):
            offset, _, first = _box(tensor)
            if first:
                out[name] = (tensor.to_local().detach().to("cpu", copy=True), list(tensor.shape), offset)
    return out


def write_rank_shard(
    ckpt_dir: Path, rank: int, world: int, pieces: dict[str, tuple[Tensor, list[int], list[int]]]
) -> None:
    """Every rank writes its shard file for the next checkpoint (hpcrl/store/shards.py); all learn whether every
    file landed: rank 0 refuses the save if one did not, the others say why in their log and go on."""
    failure = ""
    # The run checks the weights a checkpoint gets for NaN and inf; sharded ones are checked here, piece by piece.
    bad = next((k for k, (t, _, _) in pieces.items() if k.startswith("model/") and not t.isfinite().all()), None)
    if bad is not None:
        failure = (
            f"parameter {bad.removeprefix('model/')!r} of the trainer holds NaN or inf; it was not checkpointed, "
            "and the last checkpoint is intact: lower train.lr, check the rewards, then rerun to resume"
        )
    else:
        try:
            write_shard(ckpt_dir, rank, world, pieces)
        except (CheckpointError, RunDirError, OSError) as exc:
            failure = str(exc)
    failed = torch.tensor([float(bool(failure))])
    if world > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failure and rank != 0:
        print(f"trainer rank {rank}: {failure}", file=sys.stderr, flush=True)
    if failed.item() and rank == 0:
        raise CheckpointError(
            failure
            or "a trainer rank could not write its shard of the checkpoint (its log in run_dir/logs/ says why); "
            "free space and rerun to resume from the previous checkpoint"
        )


def shard_likes(
    model: torch.nn.Module, ref_model: torch.nn.Module | None, optimizer: torch.optim.Optimizer
) -> dict[str, Tensor | None]:
    """What each tensor of a checkpoint is loaded into, by name (its shard's box decides what a rank reads)."""
    likes: dict[str, Tensor | None] = {f"model/{k}": v for k, v in model.state_dict().items()}
    if ref_model is not None:
        likes.update({f"ref_model/{k}": v for k, v in ref_model.state_dict().items()})
    # torch numbers the parameters of an optimizer state dict in order: a checkpoint's that fits this optimizer
    # numbers them as its own does (one that does not is refused when the optimizer loads it).
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in optimizer.state_dict()["param_groups"] for i in group["params"]]
    for key, param in zip(ids, params, strict=True):
        for moment in ("exp_avg", "exp_avg_sq"):
            likes[f"optimizer/state/{key}/{moment}"] = param
    return likes


def read_pieces(reader: ShardReader, likes: Mapping[str, Tensor | None]) -> dict[str, Tensor]:
    """Every tensor of a checkpoint's shard files, as this rank holds it: a DTensor of its shard where `likes` has a
    DTensor of that name (read from the overlapping files alone), else the whole tensor (one at a time)."""
    out: dict[str, Tensor] = {}
    for name in sorted(reader.names()):
        like = likes.get(name)
        if isinstance(like, DTensor) and list(like.shape) == reader.shape(name):
            offset, shape, _ = _box(like)
            local = reader.read(name, offset, shape).to(device=like.to_local().device, dtype=like.dtype)
            out[name] = DTensor.from_local(
                local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
            )
        else:
            whole = reader.shape(name)
            out[name] = reader.read(name, [0] * len(whole), whole)
    return out


def shard_like(whole: Tensor, like: Tensor) -> Tensor:
    """`whole` cut as `like` is sharded: a DTensor of this rank's shard on `like`'s mesh, device and dtype (no
    collective: every rank holds `whole`). A plain `like` gets `whole` itself."""
    if not isinstance(like, DTensor):
        return whole
    local = distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()
    local = local.to(device=like.to_local().device, dtype=like.dtype)
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


@torch.no_grad()
def load_full(module: torch.nn.Module, state: Mapping[str, Tensor], what: str, *, only: set[str] | None = None) -> None:
    """Load whole tensors into a module whose parameters may be sharded, strictly (the same names); `only`: the
    module's tensors a checkpoint holds (the others no step changes, and stay as loaded)."""
    own = {k: v for k, v in module.state_dict().items() if only is None or k in only}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"this checkpoint's {what} does not match the model (missing {missing[:5]}, unexpected {unexpected[:5]}); "
            "resume with the model.path the run was started with"
        )
    for name, tensor in own.items():
        whole = state[name]
        if tuple(whole.shape) != tuple(tensor.shape):
            raise ValueError(
                f"this checkpoint's {what} {name} has shape {list(whole.shape)}, the model's {list(tensor.shape)}; "
                "resume with the model.path the run was started with"
            )
        shard = whole if isinstance(whole, DTensor) else shard_like(whole, tensor)
        target = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        target.copy_(shard.to_local() if isinstance(shard, DTensor) else shard)


def shard_optimizer_state(state_dict: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A torch optimizer state dict of whole tensors (a checkpoint's) with each parameter's moments cut as that
    parameter is sharded, for `optimizer.load_state_dict`."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    by_id = dict(zip(ids, params, strict=False))
    out: dict[Any, Any] = {}
    for key, moments in state_dict["state"].items():
        param = by_id.get(key)
        out[key] = {
            k: shard_like(v, param)
            if param is not None and isinstance(v, Tensor) and not isinstance(v, DTensor) and v.shape == param.shape
            else v
            for k, v in moments.items()
        }
    return {**state_dict, "state": out}
