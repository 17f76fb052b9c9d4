"""What one disk-delta push (sync.transport disk_delta) writes and costs on a real model shape: the share of bf16
weights that changed, the bytes against a full push, and the seconds to write it and to apply it, on this CPU.

    PYTHONPATH=. python tools/bench/delta_payload.py [--shape qwen3-0.6b|tiny] [--lr 1e-6 1e-5] [--steps 3]

The model is the shape's parameter list (hpcrl's own Qwen3, tied embeddings) with random weights, initialised as
transformers does (normal 0.02, norms 1). Training is Adam on random gradients, one parameter at a time (Adam
is elementwise, so this streams: no full optimizer state at once), on fp32 master weights that are pushed in
bf16, as a trainer with fp32 weights and bf16 engines does. A bf16 weight changes only when its master value
crosses a rounding boundary, so the changed share is what the learning rate against bf16's resolution decides;
Adam's step size (about lr per element, whatever the gradient's scale) makes random gradients a fair stand-in
for those of real tokens there, at the cost of a forward and backward pass this CPU cannot afford on 0.6B.

Per learning rate: version 1 (the weights after `--steps - 1` steps) is pushed as a snapshot, version 2 (one step
later) as a delta, through the real transport (`hpcrl/sync/disk_delta.py`) into a temporary directory; the delta
is then applied by the embedded engine's loader (`hpcrl/engine/embedded/delta_load.py`) to a copy of version 1,
and the result is checked to equal version 2 bit for bit.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from hpcrl.engine.embedded.delta_load import DeltaLoader  # noqa: E402
from hpcrl.model.qwen3 import CausalLM, ModelArgs  # noqa: E402
from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, ModelShape, build_tokenizer, qwen3_config  # noqa: E402
from hpcrl.sync.config import SyncConfig  # noqa: E402
from hpcrl.sync.disk_delta import DiskDeltaTransport  # noqa: E402
from hpcrl.sync.transport import TransportContext  # noqa: E402
from hpcrl.weightwire.buckets import buckets  # noqa: E402

SHAPES = {
    "qwen3-0.6b": QWEN3_0_6B_SHAPE,
    "tiny": ModelShape(
        vocab_size=151, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    ),
}
CHUNK = 1 << 24  # elements per Adam piece: bounds the fp32 state alive at once


def parameter_shapes(shape: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    tokenizer = build_tokenizer()
    config = qwen3_config(
        shape, vocab_size=shape.vocab_size, eos_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = CausalLM.without_init(ModelArgs.from_hf_config(config.to_dict()), "meta")
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def two_versions(
    shapes: list[tuple[str, tuple[int, ...]]], lr: float, steps: int, seed: int
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """The bf16 weights after steps-1 and after `steps` Adam steps on random gradients (fp32 masters)."""
    gen = torch.Generator().manual_seed(seed)
    before, after = [], []
    for name, shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        out_before = torch.empty(numel, dtype=torch.bfloat16)
        out_after = torch.empty(numel, dtype=torch.bfloat16)
        for start in range(0, numel, CHUNK):
            n = min(CHUNK, numel - start)
            master = torch.ones(n) if name.endswith("norm.weight") else torch.randn(n, generator=gen) * 0.02
            master.requires_grad_(True)
            opt = torch.optim.Adam([master], lr=lr)
            for step in range(steps):
                if step == steps - 1:
                    out_before[start : start + n] = master.detach().to(torch.bfloat16)
                master.grad = torch.randn(n, generator=gen)
                opt.step()
            out_after[start : start + n] = master.detach().to(torch.bfloat16)
            del master, opt
        before.append((name, out_before.view(shape)))
        after.append((name, out_after.view(shape)))
    return before, after


def delta_transport(directory: Path) -> tuple[DiskDeltaTransport, int]:
    """The real disk-delta transport writing into `directory`, connected, with no engine to tell (the caller applies
    the versions itself); and its bucket size in bytes."""
    cfg = SyncConfig(transport="disk_delta", delta_dir=str(directory), snapshot_every=1000)
    ctx = TransportContext(
        cfg=cfg, engines=[], device=torch.device("cpu"), pool=ThreadPoolExecutor(1), each=lambda fn, what: [],
        engine_kind="embedded", engine_tp_size=1,
    )  # fmt: skip
    transport = DiskDeltaTransport(ctx)
    transport.connect()
    return transport, int(cfg.bucket_mb * 2**20)


def measure(shape_name: str, lr: float, steps: int, directory: Path) -> dict[str, float]:
    shapes = parameter_shapes(SHAPES[shape_name])
    t0 = time.perf_counter()
    v1, v2 = two_versions(shapes, lr, steps, seed=0)
    train_s = time.perf_counter() - t0
    transport, bucket_bytes = delta_transport(directory)
    for version, named in ((1, v1), (2, v2)):
        transport.begin(version)
        for bucket in buckets(named, bucket_bytes):
            transport.send(bucket)
        transport.finish(version)
    metrics = transport.metrics()
    full = sum(t.numel() * t.element_size() for _, t in v2)
    params = {n: t.clone() for n, t in v1}
    del transport
    t0 = time.perf_counter()
    DeltaLoader().load(params, directory / "delta-00000002.json")  # a fresh loader rebuilds from snapshot 1 ...
    rebuild_s = time.perf_counter() - t0
    params = {n: t.clone() for n, t in v1}
    loader = DeltaLoader()
    loader.directory, loader.applied = directory, 1  # ... an engine serving version 1 applies the delta alone
    t0 = time.perf_counter()
    loader.load(params, directory / "delta-00000002.json")
    apply_s = time.perf_counter() - t0
    exact = all(torch.equal(params[n].view(torch.int16), t.view(torch.int16)) for n, t in v2)
    return {
        "params": float(sum(t.numel() for _, t in v2)),
        "changed_share": metrics["sync/delta_changed_share"],
        "delta_bytes": metrics["sync/delta_bytes"],
        "full_bytes": float(full),
        "write_s": metrics["sync/delta_write_s"],
        "apply_s": apply_s,
        "rebuild_s": rebuild_s,
        "train_s": train_s,
        "exact": float(exact),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--steps", type=int, default=3, help="Adam steps; the delta is between the last two")
    parser.add_argument("--dir", default=None, help="where to write the versions (default: a temporary directory)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the delta is between the last two)")
    print(f"shape {args.shape}, {args.steps} Adam steps, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")  # fmt: skip
    print("lr       params  changed  delta MB  full MB  ratio  write s  apply s  rebuild s  bit-exact")
    for lr in args.lr:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            r = measure(args.shape, lr, args.steps, Path(tmp))
        print(
            f"{lr:<8.0e} {r['params'] / 1e6:5.0f}M  {r['changed_share']:6.2%}  {r['delta_bytes'] / 2**20:8.1f}  "
            f"{r['full_bytes'] / 2**20:7.1f}  {r['full_bytes'] / max(r['delta_bytes'], 1):5.1f}x  "
            f"{r['write_s']:7.2f}  {r['apply_s']:7.2f}  {r['rebuild_s']:9.2f}  {'yes' if r['exact'] else 'NO'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
