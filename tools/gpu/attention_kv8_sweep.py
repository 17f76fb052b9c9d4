"""The decode-attention kernel alone with a bfloat16 and an 8-bit (e4m3) K/V cache, over launch configs.

    PYTHONPATH=. python3 tools/gpu/attention_kv8_sweep.py [--batch 256] [--attn-len 384]

Qwen3-0.6B's attention shape (16 heads, 8 KV heads, head_dim 128), one layer, every row at the same length;
CUDA events, median of 50. Prints ms and GB/s of K/V read (the bytes the kernel must move) per config, the
output's max difference from the bfloat16 cache's, and the fastest config of each cache as
HPCRL_ENGINE_ATTN_CONFIG / HPCRL_ENGINE_ATTN_CONFIG_KV8 would take it.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from decode_microbench import cuda_ms  # noqa: E402 - a sibling script: this folder is on sys.path when run

from hpcrl.engine.embedded import kernels  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--attn-len", type=int, default=384)
    ns = p.parse_args()
    torch.manual_seed(0)
    b, nh, nkv, hd, max_len = ns.batch, 16, 8, 128, 640
    dev = torch.device("cuda")
    k16 = torch.randn(b, nkv, max_len, hd, device=dev, dtype=torch.bfloat16)
    v16 = torch.randn(b, nkv, max_len, hd, device=dev, dtype=torch.bfloat16)
    caches = {
        "bfloat16": (k16, v16),
        "fp8_e4m3": (k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn)),
    }
    q = torch.randn(b, (nh + 2 * nkv) * hd, device=dev, dtype=torch.bfloat16)
    pos = torch.full((b,), ns.attn_len - 1, device=dev, dtype=torch.long)
    scale = hd**-0.5
    outs: dict[str, torch.Tensor] = {}
    best: dict[str, tuple[float, tuple[int, ...]]] = {}
    print(f"batch {b}, attention length {ns.attn_len}, one layer; config = BLOCK_N,warps,stages,use_dot")
    print("| cache | config | ms | GB/s of K/V | max abs diff vs bf16 cache |")
    print("|---|---|---:|---:|---:|")
    for name, (kc, vc) in caches.items():
        kv_bytes = 2 * b * nkv * ns.attn_len * hd * kc.element_size()
        for cfg in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (0, 1)):
            out = torch.empty(b, nh * hd, device=dev, dtype=torch.bfloat16)

            def run(cfg: tuple[int, ...] = cfg, out: torch.Tensor = out, kc: torch.Tensor = kc,
                    vc: torch.Tensor = vc) -> None:  # fmt: skip
                kernels.decode_attention(q, kc, vc, pos, out, nh, nkv, hd, scale, config=cfg)

            try:
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                print(f"| {name} | {cfg} | failed: {type(exc).__name__} | | |")
                continue
            ms = cuda_ms(run, reps=50, warmup=0)  # warmed up above
            ref = outs.setdefault("bfloat16", out.clone()) if name == "bfloat16" else outs["bfloat16"]
            diff = (out.float() - ref.float()).abs().max().item()
            print(f"| {name} | {','.join(map(str, cfg))} | {ms:.4f} | {kv_bytes / ms / 1e6:,.0f} | {diff:.3g} |")
            if name not in best or ms < best[name][0]:
                best[name] = (ms, cfg)
    for name, (ms, cfg) in best.items():
        print(f"best {name}: {','.join(map(str, cfg))} {ms:.4f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
