"""Checkpoints: bit-exact tensors, optimizer and RNG state without pickle, atomic save, corruption skipped."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import threading
import warnings
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import hpcrl.store.checkpoint as checkpoint_module
import hpcrl.store.direct_io as direct_io_module
from hpcrl.store.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    remove_temp_files,
    save_checkpoint,
)
from hpcrl.store.metrics import MetricsWriter, StoreError
from hpcrl.store.state_tree import capture_rng_state, flatten_state, restore_rng_state, unflatten_state

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype.is_floating_point:
        # Compares bits, so NaN payloads and -0.0 count.
        width = _SAME_WIDTH_INT[expected.element_size()]
        assert torch.equal(actual.view(width), expected.view(width))
    else:
        assert torch.equal(actual, expected)


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(3, 5, generator=generator) * 100
    tensors: dict[str, torch.Tensor] = {
        "bf16.special": torch.tensor([float("nan"), -0.0, float("inf"), 1e-40, 3.0], dtype=torch.bfloat16),
        "complex": torch.randn(2, 2, dtype=torch.complex64, generator=generator),
        "float8": values.to(torch.float8_e4m3fn),
    }
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        tensors[f"model.layers.0/{dtype}"] = values.to(dtype)
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        tensors[f"int/{dtype}"] = values.to(dtype)
    tensors["uint8"] = values.abs().to(torch.uint8)
    tensors["bool"] = values > 0
    for name, tensor in list(tensors.items()):
        tensors[f"{name}/scalar"] = tensor.reshape(-1)[0].clone()
        tensors[f"{name}/empty"] = tensor.reshape(-1)[:0].reshape(0, 1)
    # Names HDF5 would otherwise read as paths or escapes.
    tensors.update({".": torch.ones(1), "..": torch.ones(2), "a/../b": torch.zeros(1), "%2E": torch.ones(3)})
    return tensors


def test_every_dtype_round_trips_bit_exact(tmp_path: Path) -> None:
    tensors = sample_tensors()
    state = {"data_cursor": 17, "weight_version": 4, "lr": 1e-5, "name": "run ☃", "nested": [None, True, {"a": []}]}
    state["params"] = list(range(20_000))  # over HDF5's 64 KiB compact attribute limit
    path = save_checkpoint(tmp_path / "checkpoints", 7, tensors, state)
    assert path == tmp_path / "checkpoints" / "step_00000008.h5"  # named by the steps done: index 7 is step 8
    checkpoint = load_checkpoint(path)
    assert checkpoint.step == 7 and checkpoint.path == path and checkpoint.state == state
    assert set(checkpoint.tensors) == set(tensors)
    for name, tensor in tensors.items():
        assert_bit_equal(checkpoint.tensors[name], tensor)
    with h5py.File(path, "r") as f:  # any HDF5 reader sees every tensor's bytes in /blob, where the index says
        (bf16,) = [e for e in json.loads(f.attrs["tensors_json"]) if e["name"] == "bf16.special"]
        assert bf16["dtype"] == "bfloat16" and bf16["shape"] == [5]
        raw = f["blob"][bf16["offset"] : bf16["offset"] + 10]
        assert raw.tobytes() == tensors["bf16.special"].view(torch.int16).numpy().tobytes()
        assert json.loads(f.attrs["state_json"]) == state and f.attrs["step"] == 7


def test_a_checkpoint_written_before_format_version_2_still_loads() -> None:
    # Written by hpcrl at d7dfaee (format 1: a dataset per tensor, BLAKE2b) from sample_tensors() and this state.
    old = Path(__file__).parents[1] / "data" / "checkpoint_v1" / "step_00000003.h5"
    with h5py.File(old, "r") as f:
        assert f.attrs["hpcrl_format_version"] == 1 and "tensors" in f
    checkpoint = load_checkpoint(old)
    assert checkpoint.step == 3
    assert checkpoint.state == {"data": {"cursor": 17}, "weights": {"version": "3"}, "name": "run ☃"}
    tensors = sample_tensors()
    assert set(checkpoint.tensors) == set(tensors)
    for name, tensor in tensors.items():
        assert_bit_equal(checkpoint.tensors[name], tensor)


def test_a_format_2_checkpoint_written_before_the_blob_was_aligned_still_loads() -> None:
    # Written by hpcrl at 52c66f9 (format 2, before O_DIRECT) from sample_tensors() plus "big" and this state.
    old = Path(__file__).parents[1] / "data" / "checkpoint_v2_unaligned" / "step_00000004.h5"
    with h5py.File(old, "r") as f:
        assert f.attrs["hpcrl_format_version"] == 2 and f["blob"].id.get_offset() % 4096 != 0
    checkpoint = load_checkpoint(old)
    assert checkpoint.step == 4
    assert checkpoint.state == {"data": {"cursor": 17}, "weights": {"version": "4"}, "name": "run ☃"}
    tensors = sample_tensors() | {"big": torch.arange(3000, dtype=torch.float32)}
    assert set(checkpoint.tensors) == set(tensors)
    for name, tensor in tensors.items():
        assert_bit_equal(checkpoint.tensors[name], tensor)


class WriteLog:
    """Records every pwritev as (O_DIRECT or not, offset, bytes written); can cut direct writes short or fail."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, short_every: int = 0, fail_direct_at: int = 0) -> None:
        self.writes: list[tuple[bool, int, int]] = []
        self.short_every, self.fail_direct_at = short_every, fail_direct_at
        self.num_direct_calls, self.lock = 0, threading.Lock()  # direct writes run in several threads
        self.real_pwritev = os.pwritev
        monkeypatch.setattr(os, "pwritev", self.pwritev)

    def pwritev(self, fd: int, views: list[memoryview], offset: int) -> int:
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        with self.lock:
            self.num_direct_calls += direct
            call = self.num_direct_calls
        if direct and call == self.fail_direct_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if direct and self.short_every and call % self.short_every == 0:
            views = [views[0][:4096]]  # as at a file size limit: the kernel wrote whole blocks, not all
        written = self.real_pwritev(fd, views, offset)
        with self.lock:
            self.writes.append((direct, offset, written))
        return written

    def direct(self) -> list[tuple[bool, int, int]]:
        return [write for write in self.writes if write[0]]


def odd_sized_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    # 60,027 bytes: seven 8 KiB chunks of whole 4 KiB blocks, then a partial block.
    sizes = {"a": 1, "b": 5000, "c": 3333, "d": 6666, "empty": 0}
    tensors = {name: torch.randn(size, generator=generator) for name, size in sizes.items()}
    return tensors | {"bytes": torch.arange(27, dtype=torch.uint8)}


def test_the_blob_goes_around_the_page_cache_and_short_direct_writes_finish_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct_io_module, "_DIRECT_CHUNK_BYTES", 8192)
    tensors = odd_sized_tensors()
    blob_nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    log = WriteLog(monkeypatch, short_every=3)
    checkpoint = load_checkpoint(save_checkpoint(tmp_path, 1, tensors, {}))
    for name, tensor in tensors.items():
        assert_bit_equal(checkpoint.tensors[name], tensor)
    with h5py.File(checkpoint.path, "r") as f:
        blob_offset = f["blob"].id.get_offset()
    assert blob_offset % 4096 == 0  # what O_DIRECT needs, set by the file's alignment
    direct = log.direct()
    assert len(direct) == 7 and all(offset % 4096 == 0 and written % 4096 == 0 for _, offset, written in direct)
    # The blocks the short writes left, and the partial last block, went through the page cache; together
    # every byte of the blob was written exactly once.
    in_blob = [(offset, n) for _, offset, n in log.writes if blob_offset <= offset < blob_offset + blob_nbytes]
    blob_writes = sorted(in_blob)
    assert blob_writes[0][0] == blob_offset
    assert all(a + n == b for (a, n), (b, _) in zip(blob_writes, blob_writes[1:], strict=False))
    assert sum(n for _, n in blob_writes) == blob_nbytes and len(blob_writes) == 7 + 2 + 1


def test_reads_go_around_the_page_cache_and_a_short_direct_read_goes_on_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct_io_module, "_DIRECT_CHUNK_BYTES", 8192)
    monkeypatch.setattr(checkpoint_module, "_RUN_BYTES", 10_000)  # several runs, the first checked early
    tensors = odd_sized_tensors()
    path = save_checkpoint(tmp_path, 1, tensors, {})
    real_preadv, direct_reads = os.preadv, []

    def short_third_direct_read(fd: int, views: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            direct_reads.append(offset)
            if len(direct_reads) == 3:  # reads run in order of offset: the third one stops half way
                return real_preadv(fd, [views[0][:4096]], offset)
        return real_preadv(fd, views, offset)

    monkeypatch.setattr(os, "preadv", short_third_direct_read)
    checkpoint = load_checkpoint(path)
    assert len(direct_reads) >= 3
    for name, tensor in tensors.items():
        assert_bit_equal(checkpoint.tensors[name], tensor)
    with open(path, "r+b") as f:  # a flipped byte after the short read is still caught
        with h5py.File(path, "r") as h5:
            byte_offset = h5["blob"].id.get_offset() + 50_000
        f.seek(byte_offset)
        byte = f.read(1)
        f.seek(byte_offset)
        f.write(bytes([byte[0] ^ 1]))
    direct_reads.clear()
    with pytest.raises(CheckpointError, match="tensor 'd' of checkpoint .* fails its checksum"):
        load_checkpoint(path)


def test_a_file_system_that_refuses_o_direct_gets_the_buffered_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refuse_direct_open(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    tensors = odd_sized_tensors()
    with monkeypatch.context() as patch:
        patch.setattr(os, "open", refuse_direct_open)
        log = WriteLog(patch)
        checkpoint = load_checkpoint(save_checkpoint(tmp_path, 1, tensors, {}))
    assert log.writes and not log.direct()
    for name, tensor in tensors.items():
        assert_bit_equal(checkpoint.tensors[name], tensor)
    with monkeypatch.context() as patch:  # one that opens with O_DIRECT and refuses the first write
        log = WriteLog(patch)
        real_pwritev = log.real_pwritev

        def refuse_direct_write(fd: int, views: list[memoryview], offset: int) -> int:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return real_pwritev(fd, views, offset)

        log.real_pwritev = refuse_direct_write
        checkpoint = load_checkpoint(save_checkpoint(tmp_path, 2, tensors, {}))
    assert not log.direct() and sum(n for _, _, n in log.writes) >= 60_027
    for name, tensor in tensors.items():
        assert_bit_equal(checkpoint.tensors[name], tensor)


def test_a_write_that_fails_part_way_through_the_blob_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(direct_io_module, "_DIRECT_CHUNK_BYTES", 8192)
    tensors = odd_sized_tensors()
    save_checkpoint(tmp_path, 1, tensors, {"step": 1})
    with monkeypatch.context() as patch:
        log = WriteLog(patch, fail_direct_at=4)  # the disk fills up after three chunks
        with pytest.raises(CheckpointError, match=r"step_00000003.h5 \(No space left on device\).*previous checkpoint"):
            save_checkpoint(tmp_path, 2, {k: v + 1 for k, v in tensors.items()}, {"step": 2})
    assert len(log.direct()) >= 3
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000002.h5"]  # no temporary file either
    checkpoint = load_checkpoint(tmp_path / "step_00000002.h5")
    assert checkpoint.state == {"step": 1}
    for name, tensor in tensors.items():
        assert_bit_equal(checkpoint.tensors[name], tensor)


def test_reads_and_writes_split_into_many_calls_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 0.6B model's state has more tensors than one pwritev/preadv takes (1,024) and is read in runs of
    # 64 MiB; shrink both limits so that a small state crosses them.
    monkeypatch.setattr(direct_io_module, "_IOV_MAX", 3)
    monkeypatch.setattr(checkpoint_module, "_RUN_BYTES", 100)
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def short(call: Any) -> Any:  # the kernel may move fewer bytes than asked (signals, size limits)
        return lambda fd, views, offset: call(fd, [views[0][: max(1, len(views[0]) // 2)]], offset)

    monkeypatch.setattr(os, "pwritev", short(real_pwritev))
    monkeypatch.setattr(os, "preadv", short(real_preadv))
    tensors = sample_tensors()
    checkpoint = load_checkpoint(save_checkpoint(tmp_path, 1, tensors, {}))
    for name, tensor in tensors.items():
        assert_bit_equal(checkpoint.tensors[name], tensor)


def test_damaged_checksums_and_index_are_named(tmp_path: Path) -> None:
    weights = {"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.float64)}
    path = save_checkpoint(tmp_path, 1, weights, {})
    with h5py.File(path, "r") as f:
        crc_offset = f["crc32"].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(crc_offset + 4)  # the second tensor's checksum
        f.write(b"\0\0\0\0")
    with pytest.raises(CheckpointError, match="tensor 'b' of checkpoint .* fails its checksum.*corrupt"):
        load_checkpoint(path)
    path = save_checkpoint(tmp_path, 2, weights, {})
    with h5py.File(path, "r+") as f:  # an index that claims more bytes than the file holds
        entries = json.loads(f.attrs["tensors_json"])
        entries[1]["shape"] = [10**12]
        f.attrs["tensors_json"] = json.dumps(entries)
    with pytest.raises(CheckpointError, match="damaged entry for tensor 'b'.*corrupt"):
        load_checkpoint(path)


def test_state_must_be_plain_json(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"non-string key 0.*flatten_state"):
        save_checkpoint(tmp_path, 1, {}, {"optimizer": {0: 1.0}})
    with pytest.raises(TypeError, match=r"state\['betas'\] is a tuple"):
        save_checkpoint(tmp_path, 1, {}, {"betas": (0.9, 0.95)})
    with pytest.raises(TypeError, match="tensors go in `tensors`"):
        save_checkpoint(tmp_path, 1, {}, {"x": torch.ones(1)})
    with pytest.raises(TypeError, match="'w' is a ndarray"):
        save_checkpoint(tmp_path, 1, {"w": np.ones(2)}, {})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []


def test_flatten_state_round_trips_structure_and_key_types() -> None:
    nested = {
        "state": {0: {"step": torch.tensor(3.0)}, "0": {"step": torch.tensor(4.0)}},
        "groups": [{"betas": (0.9, 0.999), "params": [0, 1], "fused": None, "lr": torch.tensor(0.1)}],
        True: "bool key",
        2.5: np.float64(1.5),
        None: [],
    }
    tensors, skeleton = flatten_state(nested, prefix="optimizer/")
    skeleton = json.loads(json.dumps(skeleton))  # as stored in state_json
    assert all(name.startswith("optimizer/") for name in tensors)
    restored = unflatten_state(tensors, skeleton)
    assert list(restored) == list(nested)
    assert restored["state"][0]["step"] is tensors["optimizer/state/0/step"]
    assert restored["state"]["0"]["step"].item() == 4.0
    assert restored["groups"][0]["betas"] == (0.9, 0.999)
    assert restored["groups"][0]["params"] == [0, 1]
    assert restored[True] == "bool key" and restored[2.5] == 1.5 and restored[None] == []
    with pytest.raises(TypeError, match="set at /x"):
        flatten_state({"x": {1, 2}})
    with pytest.raises(KeyError, match="'missing'"):
        unflatten_state({}, {"tensor": "missing"})


def make_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


def test_adamw_state_round_trips_and_next_step_is_identical(tmp_path: Path) -> None:
    model, optimizer = make_model_and_optimizer()
    train_step(model, optimizer, seed=1)
    optimizer_tensors, optimizer_skeleton = flatten_state(optimizer.state_dict(), prefix="optimizer/")
    model_tensors = {f"model/{name}": tensor for name, tensor in model.state_dict().items()}
    save_checkpoint(tmp_path, 1, model_tensors | optimizer_tensors, {"optimizer": optimizer_skeleton})

    checkpoint = load_latest_checkpoint(tmp_path)
    assert checkpoint is not None
    resumed_model, resumed_optimizer = make_model_and_optimizer()
    prefix = len("model/")
    resumed_model.load_state_dict(
        {name[prefix:]: t for name, t in checkpoint.tensors.items() if name[:prefix] == "model/"}
    )
    resumed_optimizer.load_state_dict(unflatten_state(checkpoint.tensors, checkpoint.state["optimizer"]))
    assert resumed_optimizer.param_groups[0]["betas"] == (0.9, 0.95)

    train_step(model, optimizer, seed=2)
    train_step(resumed_model, resumed_optimizer, seed=2)
    for expected, actual in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(expected, actual)
    assert optimizer.state_dict()["state"][0]["step"] == resumed_optimizer.state_dict()["state"][0]["step"] == 2


def draw_random_values() -> list[float]:
    return [
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        float(np.random.randn()),
        torch.rand(1).item(),
    ]


def test_rng_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached Gaussian in both generators, which the state must carry
    np.random.randn()
    tensors, state = capture_rng_state()
    expected = draw_random_values()
    save_checkpoint(tmp_path, 0, tensors | {"model/w": torch.ones(2)}, {"rng": state})
    draw_random_values()

    checkpoint = load_checkpoint(tmp_path / "step_00000001.h5")
    restore_rng_state(checkpoint.tensors, checkpoint.state["rng"])
    assert draw_random_values() == expected


def test_corrupt_latest_checkpoint_is_skipped_with_a_warning(tmp_path: Path) -> None:
    weights = {"w": torch.arange(4096, dtype=torch.float32)}
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, weights, {"step": step}, keep_last=3)
    flipped, truncated = tmp_path / "step_00000004.h5", tmp_path / "step_00000003.h5"
    with h5py.File(flipped, "r") as f:
        data_offset_bytes = f["blob"].id.get_offset()
    with open(flipped, "r+b") as f:
        f.seek(data_offset_bytes + 1000)
        byte = f.read(1)
        f.seek(data_offset_bytes + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    truncated.write_bytes(truncated.read_bytes()[:9000])

    with pytest.raises(CheckpointError, match="'w'.*fails its checksum"):
        load_checkpoint(flipped)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(truncated)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint = load_latest_checkpoint(tmp_path)
    assert checkpoint is not None and checkpoint.step == 1 and checkpoint.state == {"step": 1}
    assert torch.equal(checkpoint.tensors["w"], weights["w"])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "step_00000004.h5" in messages[0] and "checksum" in messages[0]
    assert "step_00000003.h5" in messages[1] and "truncated" in messages[1]


def test_load_checkpoint_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "step_00000001.h5")
    (tmp_path / "step_00000001.h5").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(tmp_path / "step_00000001.h5")
    with MetricsWriter(tmp_path / "metrics.h5") as writer:
        writer.log(0, {"train/loss": 1.0})
    with pytest.raises(CheckpointError, match="not an hpcrl checkpoint"):
        load_checkpoint(tmp_path / "metrics.h5")
    assert issubclass(CheckpointError, StoreError)
    path = save_checkpoint(tmp_path / "ckpt", 5, {}, {})
    renamed = path.rename(path.with_name("step_00000009.h5"))  # neither 6 (steps done) nor 5 (index)
    with pytest.raises(CheckpointError, match="records step 5"):
        load_checkpoint(renamed)


def test_temp_files_of_killed_writers_are_ignored_and_removed(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {})
    leftover = tmp_path / ".step_00000003.h5.tmp"
    leftover.write_bytes(b"half a checkpoint")
    assert list_checkpoints(tmp_path) == [tmp_path / "step_00000002.h5"]
    latest = load_latest_checkpoint(tmp_path)
    assert latest is not None and latest.step == 1
    assert remove_temp_files(tmp_path) == [leftover]
    assert not leftover.exists() and remove_temp_files(tmp_path) == []
    assert remove_temp_files(tmp_path / "missing") == []
    # A save that fails part way leaves neither a temporary nor a final file.
    with pytest.raises(TypeError, match="'bad' has layout"):
        save_checkpoint(tmp_path, 2, {"w": torch.ones(2), "bad": torch.eye(2).to_sparse()}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002.h5"]


def test_keep_last_and_abandoned_timeline(tmp_path: Path) -> None:
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"w": torch.full((2,), float(step))}, {}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000005.h5", "step_00000006.h5"]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        save_checkpoint(tmp_path, 6, {}, {}, keep_last=0)
    # Resumed from step 4 (say step 5 failed its checksum): the next save at step 5 replaces it, and a save
    # at an earlier step removes the later checkpoints of the abandoned timeline.
    with pytest.warns(RuntimeWarning, match=r"\['step_00000005.h5', 'step_00000006.h5'\].*abandoned"):
        save_checkpoint(tmp_path, 3, {"w": torch.zeros(2)}, {}, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004.h5"]
    assert load_latest_checkpoint(tmp_path / "missing") is None


def test_large_step_numbers_sort_numerically(tmp_path: Path) -> None:
    for step in (99_999_998, 99_999_999):  # steps done 99,999,999 and 100,000,000
        save_checkpoint(tmp_path, step, {}, {}, keep_last=5)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_99999999.h5", "step_100000000.h5"]
    latest = load_latest_checkpoint(tmp_path)
    assert latest is not None and latest.step == 99_999_999
