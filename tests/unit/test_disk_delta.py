"""sync.transport=disk_delta: weight versions as files (what changed since the version before, and snapshots) that a
real embedded engine patches its weights from, bit for bit; and the faults: a corrupt delta, a writer killed
midway, a full disk."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcrl.engine import contract as C
from hpcrl.engine.client import EngineClient
from hpcrl.engine.contract import GET_WEIGHTS_BY_NAME
from hpcrl.engine.embedded.delta_load import DeltaLoader
from hpcrl.engine.protocol.control import UpdateWeightsFromDelta
from hpcrl.model.hf import load_model
from hpcrl.run_config import load_run_config
from hpcrl.store import load_metrics
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.disk_delta import DiskDeltaError, DiskDeltaTransport
from hpcrl.sync.errors import WeightSyncError
from hpcrl.sync.push import WeightSync
from hpcrl.sync.transport import TransportContext
from hpcrl.weightwire.delta import PROBE, DeltaFormatError, published
from tests.conftest import EngineProcess, start_engine
from tests.support import hpcrl


class Trainer:
    """The tiny model's weights under Adam on random gradients: each step changes a realistic share of bf16 bits."""

    def __init__(self, model_dir: Path, lr: float = 1e-3, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.params = {
            n: p.detach().clone().requires_grad_(True) for n, p in load_model(model_dir).state_dict().items()
        }
        self.opt = torch.optim.Adam(self.params.values(), lr=lr)

    def step(self) -> None:
        for p in self.params.values():
            p.grad = torch.randn_like(p)
        self.opt.step()

    def pushed(self, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().to(dtype, copy=True)) for n, p in self.params.items()]


@pytest.fixture(scope="module")
def bf16_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    eng = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine"), "--dtype", "bfloat16")
    yield eng
    eng.stop()


def engine_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    client = EngineClient(url)
    return {n: torch.tensor(client.call(GET_WEIGHTS_BY_NAME, {"name": n, "truncate_size": 10**7})) for n in names}


def assert_engine_holds(url: str, expected: list[tuple[str, torch.Tensor]]) -> None:
    got = engine_weights(url, [n for n, _ in expected])
    for name, tensor in expected:
        # bf16 -> float64 (JSON) is exact: equal floats are equal bits, NaN aside (none here).
        assert torch.equal(got[name], tensor.float().flatten().double()), name


def delta_sync(engine: EngineProcess, directory: Path, **cfg: Any) -> WeightSync:
    config = SyncConfig(transport="disk_delta", delta_dir=str(directory), bucket_mb=0.05, **cfg)
    return WeightSync(config, [EngineClient(engine.url)], device=torch.device("cpu"))


def test_engine_weights_after_50_delta_pushes_equal_the_trainers_bitwise(
    bf16_engine: EngineProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = Trainer(tiny_model_dir)
    sync = delta_sync(bf16_engine, tmp_path / "weights", snapshot_every=20, keep_snapshots=2)
    sync.connect()
    try:
        shares = []
        for version in range(1, 51):
            trainer.step()
            metrics = sync.push(trainer.pushed(), version)
            shares.append(metrics["sync/delta_changed_share"])
        # A full push (apply strategy replace) loads exactly these tensors: the engine holds them bit for bit.
        assert_engine_holds(bf16_engine.url, trainer.pushed())
    finally:
        sync.close()
    assert EngineClient(bf16_engine.url).weight_version() == 50
    # Snapshots at 1, 21, 41 (every 20 versions), two kept; the deltas up to the oldest kept one removed.
    have = published(tmp_path / "weights")
    assert have == {"delta": list(range(22, 51)), "snapshot": [21, 41]}
    assert shares[0] == 1.0 and all(0 < s < 1 for s in shares[1:])
    assert metrics["sync/delta_bytes"] < metrics["sync/bytes"] and metrics["sync/engine_apply_s"] > 0
    assert metrics["sync/delta_write_s"] > 0


def test_a_corrupt_delta_is_never_applied_and_the_engine_recovers_from_a_snapshot(
    bf16_engine: EngineProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = Trainer(tiny_model_dir, seed=1)
    directory = tmp_path / "weights"
    sync = delta_sync(bf16_engine, directory)
    sync.connect()
    try:
        for version in (1, 2):
            trainer.step()
            sync.push(trainer.pushed(), version)
        v2 = trainer.pushed()
        # A delta corrupted on its way to the engine: a byte flipped after the manifest was written.
        transport = sync.transport
        assert isinstance(transport, DiskDeltaTransport)
        real_each = transport.each
        flipped: list[str] = []

        def flip_then_load(fn: Any, what: str) -> list[Any]:
            if not flipped:
                data = directory / "delta-00000003.bin"
                raw = bytearray(data.read_bytes())
                raw[len(raw) // 2] ^= 0x10
                data.write_bytes(bytes(raw))
                flipped.append(data.name)
                # Asked for the corrupt delta, the engine refuses it whole: its weights stay version 2.
                with pytest.raises(WeightSyncError, match="fails its checksum"):
                    real_each(fn, what)
                assert_engine_holds(bf16_engine.url, v2)
                raise WeightSyncError("the engine refused delta 3")
            return real_each(fn, what)

        transport.each = flip_then_load
        trainer.step()
        sync.push(trainer.pushed(), 3)
        assert flipped == ["delta-00000003.bin"]
        assert (directory / "snapshot-00000003.json").exists()  # written for the recovery
        assert_engine_holds(bf16_engine.url, trainer.pushed())
        transport.each = real_each
        trainer.step()
        sync.push(trainer.pushed(), 4)  # and the deltas go on from the snapshot
        assert_engine_holds(bf16_engine.url, trainer.pushed())
    finally:
        sync.close()


KILLED_WRITER = """
import json, os, signal, sys, torch
from concurrent.futures import ThreadPoolExecutor
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.disk_delta import DiskDeltaTransport
from hpcrl.sync.transport import TransportContext
from hpcrl.weightwire.buckets import buckets
torch.manual_seed(0)
weights = [(name, torch.randn(shape).to(torch.bfloat16)) for name, shape in json.loads(sys.argv[1])]
ctx = TransportContext(cfg=SyncConfig(transport="disk_delta", delta_dir=sys.argv[2]), engines=[],
    device=torch.device("cpu"), pool=ThreadPoolExecutor(1), each=lambda fn, what: [], engine_kind="embedded",
    engine_tp_size=1)
t = DiskDeltaTransport(ctx)
t.connect()
for version in (1, 2, 3):
    weights = [(name, w + 0.01 * torch.randn(w.shape)) for name, w in weights]
    t.begin(version)
    parts = list(buckets(weights, 4096))
    for i, bucket in enumerate(parts):
        if version == 3 and i == len(parts) // 2:
            os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies in the middle of writing version 3
        t.send(bucket)
    t.finish(version)
"""


def test_a_writer_killed_midway_publishes_nothing_and_the_next_run_starts_over(
    bf16_engine: EngineProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "weights"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    shapes = json.dumps([(n, list(t.shape)) for n, t in Trainer(tiny_model_dir).pushed()])
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, shapes, str(directory)], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert published(directory) == {"delta": [2], "snapshot": [1]}  # no manifest of 3: version 3 does not exist
    assert any(p.name.endswith(".tmp") for p in directory.iterdir())  # its half-written data
    client = EngineClient(bf16_engine.url)
    with pytest.raises(Exception, match="lacks the deltas"):
        client.call(
            C.UPDATE_WEIGHTS_FROM_DELTA, UpdateWeightsFromDelta(manifest=str(directory / "delta-00000003.json"))
        )
    # The resumed run (a new process: no kept bits) removes what the killed one left and starts with a snapshot.
    trainer = Trainer(tiny_model_dir, seed=3)
    trainer.step()
    sync = delta_sync(bf16_engine, directory)
    sync.connect()
    try:
        sync.push(trainer.pushed(), 3)
        trainer.step()
        sync.push(trainer.pushed(), 4)
    finally:
        sync.close()
    assert_engine_holds(bf16_engine.url, trainer.pushed())
    assert published(directory) == {"delta": [2, 4], "snapshot": [1, 3]}
    assert not any(p.name.endswith(".tmp") for p in directory.iterdir())


def test_a_full_disk_is_a_clear_error_and_loses_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "weights"
    trainer = Trainer(tiny_model_dir, lr=1e-2, seed=4)
    loader, params = DeltaLoader(), {n: t.clone() for n, t in trainer.pushed(torch.float32)}
    applied: list[str] = []

    def each(fn: Any, what: str) -> list[Any]:
        applied.append(what)
        return []

    ctx = TransportContext(
        cfg=SyncConfig(transport="disk_delta", delta_dir=str(directory)), engines=[], device=torch.device("cpu"),
        pool=ThreadPoolExecutor(1), each=each, engine_kind="embedded", engine_tp_size=1,
    )  # fmt: skip
    transport = DiskDeltaTransport(ctx)
    transport.connect()

    def push(version: int) -> None:
        transport.begin(version)
        transport.send(trainer.pushed(torch.float32))
        transport.finish(version)

    push(1)
    v1 = trainer.pushed(torch.float32)
    trainer.step()
    # A file system with room for 1 KiB more: what a full disk does to a writer (EFBIG here, ENOSPC there).
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        with pytest.raises(DiskDeltaError, match="free space there or set sync.delta_dir") as failure:
            push(2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert isinstance(failure.value.__cause__, OSError) and failure.value.__cause__.errno == errno.EFBIG
    assert "Nothing of it was published" in str(failure.value)
    assert applied == ["loading snapshot-00000001.json"]  # version 2 never reached an engine
    # Nothing half-written is left, and version 1 is whole: an engine rebuilds from it bit for bit.
    assert published(directory) == {"delta": [], "snapshot": [1]}
    assert sorted(p.name for p in directory.iterdir()) == ["snapshot-00000001.bin", "snapshot-00000001.json"]
    loader.load(params, directory / "snapshot-00000001.json")
    for name, tensor in v1:
        assert torch.equal(params[name].view(torch.int32), tensor.view(torch.int32)), name
    # With room again, the next push starts over with a snapshot.
    push(2)
    assert published(directory)["snapshot"] == [1, 2]
    loader.load(params, directory / "snapshot-00000002.json")
    for name, tensor in trainer.pushed(torch.float32):
        assert torch.equal(params[name].view(torch.int32), tensor.view(torch.int32)), name


def test_the_loader_applies_versions_strictly_in_order(tiny_model_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "weights"
    trainer = Trainer(tiny_model_dir, lr=1e-4, seed=5)
    ctx = TransportContext(
        cfg=SyncConfig(transport="disk_delta", delta_dir=str(directory), snapshot_every=3), engines=[],
        device=torch.device("cpu"), pool=ThreadPoolExecutor(1), each=lambda fn, what: [], engine_kind="embedded",
        engine_tp_size=1,
    )  # fmt: skip
    transport = DiskDeltaTransport(ctx)
    transport.connect()
    versions = {}
    for version in range(1, 8):
        trainer.step()
        transport.begin(version)
        transport.send(trainer.pushed())
        transport.finish(version)
        versions[version] = trainer.pushed()
    manifest = json.loads((directory / "delta-00000005.json").read_text())
    assert manifest["base_version"] == 4 and {t["encoding"] for t in manifest["tensors"]} <= {"xor", "index", "same"}
    params = {n: torch.zeros_like(t) for n, t in versions[1]}
    loader = DeltaLoader()
    # A fresh engine rebuilds from the newest snapshot before the target (4), then deltas 5 and 6.
    done = loader.load(params, directory / "delta-00000006.json")
    assert done["applied"] == ["snapshot-00000004.json", "delta-00000005.json", "delta-00000006.json"]
    assert loader.load(params, directory / "delta-00000006.json")["applied"] == []  # already there
    assert loader.load(params, directory / "delta-00000007.json")["applied"] == ["delta-00000007.json"]
    for name, tensor in versions[7]:
        assert torch.equal(params[name], tensor), name
    # A delta on another base is refused before anything is written.
    loader.applied = 5
    before = {n: t.clone() for n, t in params.items()}
    with pytest.raises(DeltaFormatError, match="applies on version 6; this engine holds 5"):
        loader._apply(params, directory / "delta-00000007.json")
    assert all(torch.equal(before[n], params[n]) for n in params)


def test_disk_delta_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only apply to sync.transport disk_delta"):
        SyncConfig(transport="distributed", snapshot_every=5)
    with pytest.raises(ValueError, match="snapshot_every must be >= 1"):
        SyncConfig(transport="disk_delta", snapshot_every=0)
    ctx = TransportContext(
        cfg=SyncConfig(transport="disk_delta"), engines=[], device=torch.device("cpu"), pool=ThreadPoolExecutor(1),
        each=lambda fn, what: [], engine_kind="sglang", engine_tp_size=1,
    )  # fmt: skip
    with pytest.raises(WeightSyncError, match="disk_delta with SGLang engines needs the run directory"):
        DiskDeltaTransport(ctx)
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {path: m}\n")
    assert load_run_config(cfg, ["sync.transport=disk_delta", "engine.kind=sglang"]).engine.kind == "sglang"


def test_a_quickstart_run_over_disk_delta_clears_a_killed_writers_leftovers_and_finishes(workdir: Path) -> None:
    weights = workdir / "run" / "weights"
    weights.mkdir(parents=True)
    # What a trainer killed while writing leaves: a temporary file, data without a manifest.
    (weights / ".delta-00000002.bin.tmp").write_bytes(b"half")
    (weights / "delta-00000002.bin").write_bytes(b"no manifest")
    steps = ["num_steps=3", "sft.num_steps=0", "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4"]
    hpcrl("run", "qs.yaml", *steps, "rollout.max_new_tokens=6", "sync.transport=disk_delta", "--run-dir", "run",
          cwd=workdir)  # fmt: skip
    assert sorted(p.name for p in weights.iterdir()) == [PROBE] + [
        f"{kind}-{v:08d}.{ext}" for kind, v in (("delta", 2), ("delta", 3), ("snapshot", 1)) for ext in ("bin", "json")
    ]  # the leftovers are gone; the shared-directory probe the run wrote at its start stays
    metrics = load_metrics(workdir / "run" / "metrics.h5")
    # The first push is a snapshot; later ones write what changed (the untrained tiny model's rewards are all
    # equal, so its steps may change nothing: the 50-push test above has real changes).
    share = metrics["sync/delta_changed_share"]
    assert share[0] == 1.0 and ((0 <= share[1:]) & (share[1:] < 1)).all()
    assert (metrics["sync/delta_bytes"][1:] < metrics["sync/bytes"][1:]).all()
    assert (metrics["sync/engine_apply_s"] > 0).all() and (metrics["sync/delta_write_s"] > 0).all()


def test_encodings_follow_the_changed_share_and_a_snapshot_is_checked_whether_raw_or_compressed(
    tmp_path: Path,
) -> None:
    import zlib

    from hpcrl.sync.disk_delta import VersionFile
    from hpcrl.weightwire.delta import INDEX_SHARE, bits, crc32, encode, read_manifest, read_payloads

    gen = torch.Generator().manual_seed(0)
    old = (torch.randn(4099, 64, generator=gen) * 0.02).to(torch.bfloat16)
    params = {"w": torch.zeros_like(old)}
    for share, want in ((INDEX_SHARE / 4, "index"), (INDEX_SHARE * 4, "xor")):
        step = (torch.rand(old.shape, generator=gen) < share).to(torch.int16)
        new = (old.view(torch.int16) + step).view(torch.bfloat16)
        encoding, _, changed = encode(bits(old), bits(new))
        assert (encoding, changed) == (want, int(step.sum()))
    assert encode(None, bits(old))[0] == "raw"

    # A raw snapshot (what the transport writes) and a zlib one (what earlier writers wrote) load bit for bit.
    for version, encoding in ((1, "raw"), (2, "full")):
        file = VersionFile(tmp_path, "snapshot", version, None)
        payload = bits(old).tobytes() if encoding == "raw" else zlib.compress(bits(old).tobytes())
        file.add("w", "bfloat16", list(old.shape), encoding, payload, crc32(bits(old)), old.numel())
        file.commit()
        params["w"].zero_()
        DeltaLoader().load(params, tmp_path / f"snapshot-0000000{version}.json")
        assert torch.equal(params["w"].view(torch.int16), old.view(torch.int16)), encoding

    # One flipped bit in a raw snapshot: refused before anything is written.
    data = tmp_path / "snapshot-00000001.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    data.write_bytes(bytes(raw))
    params["w"].zero_()
    with pytest.raises(DeltaFormatError, match="fails its checksum"):
        DeltaLoader().load(params, tmp_path / "snapshot-00000001.json")
    assert not params["w"].view(torch.int16).any()
    with pytest.raises(DeltaFormatError, match="fails its checksum"):
        read_payloads(tmp_path / "snapshot-00000001.json", read_manifest(tmp_path / "snapshot-00000001.json"))
