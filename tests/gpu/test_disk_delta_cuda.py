"""Disk-delta versions applied to weights on a GPU: the embedded engine's loader patches CUDA parameters in place,
bit for bit what the trainer pushed, with the parameters' storage (what captured graphs hold) unmoved."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hpcrl.engine.embedded.delta_load import DeltaLoader
from hpcrl.sync.config import SyncConfig
from hpcrl.sync.disk_delta import DiskDeltaTransport
from hpcrl.sync.transport import TransportContext

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_parameters_after_delta_pushes_equal_the_trainers_bitwise(tmp_path: Path) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    masters = {
        "embed": torch.randn(4096, 256, device="cuda", generator=gen) * 0.02,
        "proj": torch.randn(512, 256, device="cuda", generator=gen) * 0.02,
        "norm": torch.ones(256, device="cuda"),
    }
    ctx = TransportContext(
        cfg=SyncConfig(transport="disk_delta", delta_dir=str(tmp_path), snapshot_every=4), engines=[],
        device=torch.device("cuda"), pool=ThreadPoolExecutor(1), each=lambda fn, what: [], engine_kind="embedded",
        engine_tp_size=1,
    )  # fmt: skip
    transport = DiskDeltaTransport(ctx)
    transport.connect()
    params = {n: torch.zeros_like(m, dtype=torch.bfloat16) for n, m in masters.items()}
    addresses = {n: p.data_ptr() for n, p in params.items()}
    loader = DeltaLoader()
    for version in range(1, 11):
        for lr, m in zip((1e-5, 1e-4, 1e-3), masters.values(), strict=False):
            m.add_(torch.randn(m.shape, device="cuda", generator=gen).sign() * lr)
        pushed = [(n, m.to(torch.bfloat16)) for n, m in masters.items()]
        transport.begin(version)
        transport.send(pushed)
        transport.finish(version)
        loader.load(params, tmp_path / (f"delta-{version:08d}.json" if version > 1 else "snapshot-00000001.json"))
        for name, tensor in pushed:
            assert torch.equal(params[name].view(torch.int16), tensor.view(torch.int16)), (version, name)
    assert {n: p.data_ptr() for n, p in params.items()} == addresses
