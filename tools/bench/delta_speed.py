"""How fast a disk-delta push (sync.transport disk_delta) writes and applies, on this CPU, against a plain save of
the same tensors (torch.save and safetensors, each fsynced) as the floor a file transport can hope for.

    PYTHONPATH=. python tools/bench/delta_speed.py [--layers 28] [--share 0.02 0.15] [--before main]

The weights have the Qwen3-0.6B shape (`--layers` fewer layers keeps every tensor's size and shrinks the model; 28
is the real one, 596 M parameters), random bf16 (normal 0.02, norms 1). Version 1 goes out as a snapshot; version
2 changes `--share` of the elements by one unit in the last place, up or down, as a small Adam step does to bf16
weights (tools/bench/delta_payload.py measures the shares real learning rates give: about 2% at 1e-6, 15% at 1e-5),
and goes out as a delta. Both are written by the real transport (hpcrl/sync/disk_delta.py) into a temporary
directory and applied by the embedded engine's loader (hpcrl/engine/embedded/delta_load.py) to CPU tensors: the
snapshot by a fresh loader, the delta by one that holds version 1; the result is checked to equal version 2 bit
for bit. `--before REF` runs the same measurement with the hpcrl of git revision REF (in a subprocess, from
`git archive`) first, for a before/after table in one run. On 2 idle cores the full shape takes about 1.5
minutes, 6 with `--before main` (fewer `--layers`: less).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__" and "--child" not in sys.argv and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def make_versions(layers: int, share: float, seed: int) -> tuple[list[tuple[str, torch.Tensor]], ...]:
    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from delta_payload import parameter_shapes

    shapes = parameter_shapes(dataclasses.replace(QWEN3_0_6B_SHAPE, num_layers=layers))
    gen = torch.Generator().manual_seed(seed)
    v1, v2 = [], []
    for name, shape in shapes:
        base = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
        old = base.to(torch.bfloat16)
        del base
        step = (torch.rand(shape, generator=gen) < share).to(torch.int16)
        step *= torch.randint(0, 2, shape, generator=gen, dtype=torch.int16) * 2 - 1  # one ulp up or down
        v1.append((name, old))
        v2.append((name, (old.view(torch.int16) + step).view(torch.bfloat16)))
    return v1, v2


def baselines(named: list[tuple[str, torch.Tensor]], directory: Path) -> dict[str, float]:
    from safetensors.torch import load_file, save_file

    from hpcrl.store.direct_io import fsync_path

    tensors = dict(named)
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    torch.save(tensors, directory / "w.pt")
    fsync_path(directory / "w.pt")
    out["torch_save_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sum(t.sum().item() for t in torch.load(directory / "w.pt").values())
    out["torch_load_s"] = time.perf_counter() - t0
    (directory / "w.pt").unlink()
    t0 = time.perf_counter()
    save_file(tensors, str(directory / "w.safetensors"))
    fsync_path(directory / "w.safetensors")
    out["safetensors_save_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sum(t.sum().item() for t in load_file(str(directory / "w.safetensors")).values())  # read it all (mmap)
    out["safetensors_load_s"] = time.perf_counter() - t0
    (directory / "w.safetensors").unlink()
    return out


def measure(layers: int, share: float, directory: Path, with_baselines: bool) -> dict[str, float]:
    from hpcrl.engine.embedded.delta_load import DeltaLoader
    from hpcrl.weightwire.buckets import buckets

    # isort: split
    # After hpcrl, whose package (under --before the revision's, first on PYTHONPATH) is then the one delta_payload's
    # transport imports from, although delta_payload puts this checkout on the path.
    from delta_payload import delta_transport

    v1, v2 = make_versions(layers, share, seed=0)
    out: dict[str, float] = {
        "params": float(sum(t.numel() for _, t in v1)),
        "model_bytes": float(sum(t.numel() * t.element_size() for _, t in v1)),
    }
    if with_baselines:
        out.update(baselines(v1, directory))
    transport, bucket_bytes = delta_transport(directory)
    for version, named, key in ((1, v1, "snapshot"), (2, v2, "delta")):
        transport.begin(version)
        for bucket in buckets(named, bucket_bytes):
            transport.send(bucket)
        transport.finish(version)
        metrics = transport.metrics()
        out[f"{key}_write_s"] = metrics["sync/delta_write_s"]
        out[f"{key}_bytes"] = metrics["sync/snapshot_bytes" if key == "snapshot" else "sync/delta_bytes"]
        if key == "delta":
            out["changed_share"] = metrics["sync/delta_changed_share"]
    transport.close()
    del transport
    params = {n: torch.zeros_like(t) for n, t in v1}
    t0 = time.perf_counter()
    DeltaLoader().load(params, directory / "snapshot-00000001.json")
    out["snapshot_apply_s"] = time.perf_counter() - t0
    loader = DeltaLoader()
    loader.directory, loader.applied = directory, 1
    t0 = time.perf_counter()
    loader.load(params, directory / "delta-00000002.json")
    out["delta_apply_s"] = time.perf_counter() - t0
    out["exact"] = float(all(torch.equal(params[n].view(torch.int16), t.view(torch.int16)) for n, t in v2))
    return out


def run_before(ref: str, layers: int, share: float, tmp: Path) -> dict[str, float]:
    """The same measurement with the hpcrl of git revision `ref`, in a subprocess."""
    tree = tmp / "before"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "hpcrl"], check=True, capture_output=True)
    with tarfile.open(fileobj=__import__("io").BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO / 'tools' / 'bench'}"}
    args = [sys.executable, __file__, "--child", "--layers", str(layers), "--share", str(share), "--dir", str(tmp)]
    done = subprocess.run(args, check=True, capture_output=True, text=True, env=env)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def rate(nbytes: float, seconds: float) -> str:
    return f"{seconds:7.2f} s {nbytes / 2**20 / max(seconds, 1e-9):7.0f} MB/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the Qwen3-0.6B shape (28: all)")
    parser.add_argument("--share", type=float, nargs="+", default=[0.02, 0.15], help="changed share per delta")
    parser.add_argument("--before", default=None, help="git revision whose hpcrl to measure first (e.g. main)")
    parser.add_argument("--dir", default=None, help="where to write the versions (default: a temporary directory)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            print(json.dumps(measure(args.layers, args.share[0], Path(tmp), with_baselines=False)))
        return
    load = os.getloadavg()[0]
    print(f"Qwen3-0.6B shape with {args.layers} layers, bf16, {os.cpu_count()} CPUs, load average {load:.1f}, "
          f"torch {torch.__version__}")  # fmt: skip
    for share in args.share:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            before = run_before(args.before, args.layers, share, Path(tmp)) if args.before else None
            (Path(tmp) / "now").mkdir()
            r = measure(args.layers, share, Path(tmp) / "now", with_baselines=True)
        size = r["model_bytes"]
        print(f"\nshare {share:.0%}: {r['params'] / 1e6:.0f} M parameters, {size / 2**20:.0f} MB; changed "
              f"{r['changed_share']:.2%}, snapshot {r['snapshot_bytes'] / 2**20:.0f} MB, delta "
              f"{r['delta_bytes'] / 2**20:.1f} MB; bit-exact {'yes' if r['exact'] else 'NO'}")  # fmt: skip
        print(f"  {'':26}{'seconds':>9} {'model MB/s':>12}")
        print(f"  {'torch.save + fsync':26}{rate(size, r['torch_save_s'])}")
        print(f"  {'safetensors save + fsync':26}{rate(size, r['safetensors_save_s'])}")
        print(f"  {'torch.load':26}{rate(size, r['torch_load_s'])}")
        print(f"  {'safetensors load':26}{rate(size, r['safetensors_load_s'])}")
        for label, res in (("before", before), ("now", r)):
            if res is None:
                continue
            for key in ("snapshot_write", "snapshot_apply", "delta_write", "delta_apply"):
                what = f"{key.replace('_', ' ')} ({label})"
                print(f"  {what:26}{rate(size, res[key + '_s'])}")
            if label == "before":
                print(f"  {'  (before: snapshot':26} {res['snapshot_bytes'] / 2**20:.0f} MB, delta "
                      f"{res['delta_bytes'] / 2**20:.1f} MB, bit-exact {'yes' if res['exact'] else 'NO'})")  # fmt: skip
        sys.stdout.flush()
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
