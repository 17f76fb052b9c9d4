"""Two GPUs of one host: the weight push from a trainer GPU to an engine GPU over NCCL.

    PYTHONPATH=. python3 tools/gpu/push_two_gpus.py --out $OUT

Trainer side in this process on cuda:0 (hpcrl's WeightSync: pause -> buckets -> version -> continue),
an embedded engine process on cuda:1, Qwen3-0.6B-shaped random weights in bf16 (1.19 GB). Each
(bucket_mb, flattened) configuration pushes --repeats times; the baseline, in the same run, is a plain
NCCL broadcast of the same bytes between the two GPUs by two bare processes. Prints a table and writes
$OUT/push_two_gpus.json. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 ...), also in the children.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = ("timing/sync_pause_s", "timing/sync_send_s", "timing/sync_commit_s")
sys.path.insert(0, str(REPO))
os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})


def baseline_worker(rank: int, nbytes: int, repeats: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{rank}")
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def nccl_baseline(nbytes: int, repeats: int) -> list[float]:
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    out = "/tmp/hpcrl-nccl-baseline.json"
    mp.spawn(baseline_worker, args=(nbytes, repeats, free_port(), out), nprocs=2, join=True)
    return json.loads(Path(out).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/hpcrl-gpu-out")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[64, 256, 2048])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "qwen3-4b"],
                    help="model shape; the larger one shows how the session's fixed costs amortize")  # fmt: skip
    ns = ap.parse_args()
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    from hpcrl.engine.client import EngineClient
    from hpcrl.model.hf import load_model
    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, init_shaped_model
    from hpcrl.sync.config import SyncConfig
    from hpcrl.sync.push import WeightSync
    from tests.conftest import free_port

    shape = QWEN3_0_6B_SHAPE
    if ns.shape == "qwen3-4b":
        shape = dataclasses.replace(QWEN3_0_6B_SHAPE, hidden_size=2560, intermediate_size=9728, num_layers=36,
                                    num_heads=32)  # fmt: skip
    model_dir = init_shaped_model(f"/tmp/hpcrl-x2/{ns.shape}", shape, device="cuda:0", overwrite=True)
    named = [(n, t) for n, t in load_model(model_dir, dtype=torch.bfloat16, device="cuda:0").state_dict().items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(f"model: {len(named)} tensors, {nbytes / 2**30:.2f} GiB bf16", flush=True)

    port = free_port()
    log = open(out_dir / "engine.log", "wb")  # noqa: SIM115 - lives as long as the engine
    engine = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model_dir), "--port", str(port),
         "--device", "cuda:1", "--dtype", "bfloat16", "--max-running-requests", "16", "--context-length", "512"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=300)
    results: dict[str, object] = {"bytes": nbytes, "configs": []}
    try:
        client.wait_until_ready(180)
        probe = [1, 2, 3, 4]
        for bucket_mb in ns.bucket_mb:
            for flattened in (True, False):
                sync = WeightSync(
                    SyncConfig(transport="distributed", bucket_mb=bucket_mb, flattened=flattened),
                    [client],
                    device=torch.device("cuda:0"),
                )
                sync.connect()
                times = []
                phases: dict[str, list[float]] = {k: [] for k in PHASES}
                for i in range(ns.repeats + 1):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    m = sync.push(named, version=i + 1)
                    torch.cuda.synchronize()  # the sends have left this GPU
                    if i:  # the first push pays NCCL's connection setup
                        times.append(time.perf_counter() - t0)
                        for k in PHASES:
                            phases[k].append(m[k])
                sync.close()
                med = statistics.median(times)
                split = {k.removeprefix("timing/sync_"): statistics.median(v) for k, v in phases.items()}
                row = {"bucket_mb": bucket_mb, "flattened": flattened, "push_s": times, "median_s": med,
                       "gb_per_s": nbytes / med / 1e9, "num_buckets": m["sync/num_buckets"],
                       "phases_s": split}  # fmt: skip
                results["configs"].append(row)  # type: ignore[union-attr]
                print(f"push bucket_mb={bucket_mb:>6} flattened={flattened!s:>5}: median {med * 1e3:.1f} ms "
                      f"({nbytes / med / 1e9:.1f} GB/s, {m['sync/num_buckets']:.0f} buckets; "
                      + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in split.items()) + ")", flush=True)  # fmt: skip
        # The engine really has the pushed weights: a weight read back equals the trainer's.
        name, tensor = named[5]
        got = torch.tensor(client.get_weights_by_name(name, truncate_size=8)).flatten()
        results["weights_match"] = bool(torch.allclose(got, tensor.float().flatten()[:8].cpu()))
        gen = client.generate(probe, None, return_logprob=True)
        results["generate_ok"] = len(gen.output_ids) > 0  # type: ignore[union-attr]
    finally:
        engine.terminate()
        engine.wait(30)
    base = nccl_baseline(nbytes, ns.repeats)
    bmed = statistics.median(base)
    results["nccl_broadcast_s"] = base
    results["nccl_gb_per_s"] = nbytes / bmed / 1e9
    best = min(results["configs"], key=lambda r: r["median_s"])  # type: ignore[arg-type,index]
    results["best_share_of_nccl"] = bmed / best["median_s"]
    print(
        f"\nplain NCCL broadcast of the same {nbytes / 2**30:.2f} GiB: median {bmed:.3f} s "
        f"({nbytes / bmed / 1e9:.1f} GB/s)"
    )
    print("| bucket_mb | flattened | push median s | GB/s | share of NCCL broadcast |\n|---|---|---|---|---|")
    for r in results["configs"]:  # type: ignore[union-attr]
        print(f"| {r['bucket_mb']:g} | {r['flattened']} | {r['median_s']:.3f} | {r['gb_per_s']:.1f} | "
              f"{bmed / r['median_s']:.0%} |")  # fmt: skip
    print(
        f"best: {results['best_share_of_nccl']:.0%} of the broadcast (target >= 80%); "
        f"weights match: {results['weights_match']}"
    )
    (out_dir / f"push_two_gpus_{ns.shape}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
