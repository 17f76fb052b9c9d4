"""Sampling-support replay against stock SGLang 0.5.16 on one H200: the log-prob gap of the
torch trainer against SGLang with and without replay, from the same rollout, and the memory the supports take.

  python3 tools/gpu/sglang_replay_gap.py --out $OUT      # after `source .sglang/activate.sh ...`

SGLang (the Qwen3-0.6B shape with its 151,936-token vocabulary, random weights, bf16, triton attention)
samples 256 x 512 tokens at temperature 1 with top_k=64, top_p=0.95, returning each token's support and its
support-renormalised log-prob through hpcrl's client, as a rollout does. The trainer (hpcrl's torch model on
the same weights, bf16) then scores every sampled token twice: over the full vocabulary (what it did before
replay) and over the token's support (replay); each is compared with SGLang's log-prob. The supports' size is
that of hpcrl's ragged form (int64 offsets + int32 ids), against a dense bool [tokens x vocab] mask.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/srg"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--port", type=int, default=31011)
    p.add_argument("--engine", choices=["sglang", "embedded"], default="sglang", help="embedded: a CPU dry run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tiny", action="store_true", help="hpcrl's tiny model instead of the 0.6B shape (dry run)")
    ns = p.parse_args()
    from hpcrl.engine.client import EngineClient
    from hpcrl.engine.protocol.requests import SamplingParams
    from hpcrl.model.hf import load_model
    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, TinyModelSpec, init_shaped_model, init_tiny_model
    from hpcrl.samples.support import TokenSupports
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.logprobs import support_token_logprobs, token_logprobs

    ns.out.mkdir(parents=True, exist_ok=True)
    model_dir = ns.workdir / ("tiny" if ns.tiny else "qwen3-0.6b-shape")
    if not (model_dir / "config.json").exists():
        if ns.tiny:
            init_tiny_model(model_dir, TinyModelSpec())
        else:  # Qwen3-0.6B's shape with its vocabulary of 151,936 (the supports must cut into a real one)
            init_shaped_model(model_dir, QWEN3_0_6B_SHAPE, dtype=ns.dtype, device=ns.device)
    embedded = [
        sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model_dir), "--port", str(ns.port),
        "--device", ns.device, "--dtype", ns.dtype, "--max-running-requests", str(ns.num_seqs),
        "--context-length", str(ns.prompt_len + ns.max_new_tokens + 8),
    ]  # fmt: skip
    cmd = embedded if ns.engine == "embedded" else [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--port", str(ns.port),
        "--dtype", ns.dtype, "--attention-backend", "triton", "--sampling-backend", "pytorch",
        "--grammar-backend", "none", "--skip-server-warmup", "--mem-fraction-static", "0.4",
        "--random-seed", "0", "--max-running-requests", str(ns.num_seqs),
        "--context-length", str(ns.prompt_len + ns.max_new_tokens + 8),
    ]  # fmt: skip
    log = ns.workdir / "sglang.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    report: dict[str, object] = {}
    try:
        client = EngineClient(f"http://127.0.0.1:{ns.port}", timeout_s=900, max_retries=0)
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise SystemExit("sglang exited:\n" + log.read_text(errors="replace")[-3000:])
            try:
                if client.health():
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.perf_counter() - t0 > 400:
                raise SystemExit("sglang not healthy after 400 s")
            time.sleep(1)
        report["startup_s"] = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(1234)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        prompts = torch.randint(3, vocab, (ns.num_seqs, ns.prompt_len), generator=gen).tolist()
        params = [
            SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=1.0, top_k=ns.top_k, top_p=ns.top_p,
                           sampling_seed=1000 + i, ignore_eos=True)
            for i in range(ns.num_seqs)
        ]  # fmt: skip
        t0 = time.perf_counter()
        results = client.generate(prompts, params, return_logprob=True, return_sampling_mask=True)
        report["generate_s"] = time.perf_counter() - t0
        assert isinstance(results, list)
        supports = [TokenSupports.from_lists(r.sampling_mask or []) for r in results]
        for r, s in zip(results, supports, strict=True):
            s.check_tokens(r.output_ids, where=r.rid or "?")
        tokens = sum(len(r.output_ids) for r in results)
        sizes = torch.cat([torch.from_numpy(s.sizes()) for s in supports]).double()
        report |= {
            "tokens": tokens, "support_size_mean": float(sizes.mean()), "support_size_max": float(sizes.max()),
            "supports_bytes": sum(s.offsets.nbytes + s.ids.nbytes for s in supports),
            "dense_mask_bytes": tokens * vocab,
        }  # fmt: skip
    finally:
        os.killpg(proc.pid, 9)
    from hpcrl.model.hf import parse_dtype

    model = load_model(model_dir, dtype=parse_dtype(ns.dtype), device=ns.device).eval()
    full_diff, replay_diff, n = 0.0, 0.0, 0
    with torch.no_grad():
        for lo in range(0, ns.num_seqs, 16):
            chunk = results[lo : lo + 16]
            batch = TrainBatch.from_sequences(
                [prompts[lo + i] for i in range(len(chunk))], [r.output_ids for r in chunk],
                rollout_logprobs=[r.support_logprobs for r in chunk], supports=supports[lo : lo + 16],
            ).to(torch.device(ns.device))  # fmt: skip
            logits = model(batch.input_ids)[:, :-1]
            targets = batch.input_ids[:, 1:]
            full, _ = token_logprobs(logits, targets)
            sup_ids, sup_valid = batch.padded_supports()  # type: ignore[misc]
            replay, _ = support_token_logprobs(logits, targets, sup_ids, sup_valid)
            mask = batch.loss_mask
            full_diff += float((full - batch.rollout_logprobs).abs()[mask].sum())
            replay_diff += float((replay - batch.rollout_logprobs).abs()[mask].sum())
            n += int(mask.sum())
    report |= {"gap_full_vocabulary": full_diff / n, "gap_replay": replay_diff / n, "scored_tokens": n}
    print(
        f"{ns.engine}, {ns.num_seqs} x {ns.max_new_tokens} tokens, top_k={ns.top_k} top_p={ns.top_p}: gap without "
        f"replay (full vocabulary) {report['gap_full_vocabulary']:.3e}, with replay {report['gap_replay']:.3e}; "
        f"support size mean {report['support_size_mean']:.1f}, max {report['support_size_max']:.0f}; supports "
        f"{report['supports_bytes'] / 2**20:.1f} MiB vs a dense mask {report['dense_mask_bytes'] / 2**30:.1f} GiB",
        flush=True,
    )
    (ns.out / "sglang_replay_gap.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
