#!/usr/bin/env python3
"""A reduced Qwen3-30B-A3B on one GPU: stock SGLang 0.5.16 (with routed-expert capture) and hpcrl's embedded engine
sample from it, returning each token's routed experts; the torch trainer then scores every sampled token with the
engine's routes replayed and without.

    source .sglang/activate.sh .sglang/sglang-site.tar.xz     # SGLang on the GPU machine
    python3 tools/gpu/moe_gpu.py --out $OUT                     # ~5 min on one H100 (SGLang's start ~150 s of it)
    python3 tools/gpu/moe_gpu.py --out /tmp/m --tiny --device cpu --dtype float32 --engines embedded   # CPU dry run

The model: Qwen3-30B-A3B's layer shape (128 experts, top-8, norm_topk_prob, hidden 2048, expert width 768, 32 query
/ 4 key-value heads of 128, vocabulary 151,936) with 4 decoder layers instead of 48, random weights (std 0.02),
bf16, an untied head as the real model's (SGLang's Qwen3-MoE never ties it), ~3.1 B parameters (6.2 GB). Each engine
decodes --num-seqs x --max-new-tokens tokens (default 64 x 256, random 64-token prompts, temperature 1, ignore_eos)
in one /generate after a short warm-up; decode tok/s is output tokens over that request's wall time. For each
engine's samples the trainer (hpcrl's model on the same weights, bf16, the grouped-GEMM expert path) computes the
sampled tokens' log-probs twice: its own routes (route agreement measured against the engine's: the share of token x
layer top-k sets that are equal) and the engine's routes forced (R3).
The gap is |trainer - engine| per sampled token, max and mean. Results: a table on stdout and moe_gpu.json in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_heads": 32,
    "num_kv_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "vocab_size": 151936,
}
TINY = {**SHAPE, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "vocab_size": 99}  # fmt: skip


def make_model(model_dir: Path, shape: dict[str, int], layers: int, dtype: str, device: str) -> Path:
    """A random Qwen3-MoE directory of `shape` (the character tokenizer; prompts are token ids)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from hpcrl.model.hf import parse_dtype
    from hpcrl.model.qwen3 import CausalLM, ModelArgs
    from hpcrl.model.tiny import TinyModelSpec, build_tokenizer, qwen3_moe_config

    config_file = model_dir / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("tie_word_embeddings") is False:
        return model_dir
    spec = TinyModelSpec(num_layers=layers, max_position_embeddings=4096,
                         **{k: v for k, v in shape.items() if k != "vocab_size"})  # fmt: skip
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = qwen3_moe_config(spec, vocab_size=shape["vocab_size"], eos_id=eos, pad_id=tokenizer.pad_token_id)
    model = CausalLM.without_init(ModelArgs.from_hf_config(config.to_dict()), device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    torch_dtype = parse_dtype(dtype)
    state = {k: v.detach().to(torch_dtype).cpu().contiguous() for k, v in model.state_dict().items()}
    del model
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.dtype = torch_dtype
    config.save_pretrained(tmp)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
    shutil.rmtree(model_dir, ignore_errors=True)  # a tied checkpoint from an older run of this script
    os.rename(tmp, model_dir)
    return model_dir


def server_command(ns: argparse.Namespace, engine: str, model_dir: Path, port: int) -> list[str]:
    context = str(ns.prompt_len + ns.max_new_tokens + 16)
    if engine == "embedded":
        return [sys.executable, "-m", "hpcrl.cli", "engine", "serve", "--model", str(model_dir), "--port", str(port),
                "--device", ns.device, "--dtype", ns.dtype, "--max-running-requests", str(ns.num_seqs),
                "--context-length", context]  # fmt: skip
    return [ns.python, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--port", str(port),
            "--host", "127.0.0.1", "--dtype", ns.dtype, "--attention-backend", "triton", "--sampling-backend",
            "pytorch", "--grammar-backend", "none", "--skip-server-warmup", "--mem-fraction-static",
            str(ns.mem_fraction), "--random-seed", "0", "--max-running-requests", str(ns.num_seqs),
            "--max-total-tokens", str(ns.num_seqs * int(context)), "--context-length", context,
            "--enable-return-routed-experts"]  # fmt: skip


def sample(ns: argparse.Namespace, engine: str, model_dir: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """Start `engine`, decode every prompt with routes and log-probs, stop it: its results and timings."""
    from hpcrl.engine.client import EngineClient
    from hpcrl.engine.protocol.requests import SamplingParams

    port = ns.port + (0 if engine == "sglang" else 1)
    log = ns.workdir / f"{engine}.log"
    proc = subprocess.Popen(server_command(ns, engine, model_dir, port), stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=600, max_retries=0)
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{engine} exited during start-up:\n" + log.read_text(errors="replace")[-4000:])
            try:
                if client.health():
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.perf_counter() - t0 > ns.startup_timeout_s:
                raise SystemExit(f"{engine} not healthy after {ns.startup_timeout_s:.0f} s; see {log}")
            time.sleep(1)
        startup_s = time.perf_counter() - t0
        print(f"{engine}: up after {startup_s:.0f} s", flush=True)
        warm = [SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, sampling_seed=i) for i in range(4)]
        client.generate(prompts[:4], warm, return_logprob=True, return_routed_experts=True)
        params = [SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=1.0, ignore_eos=True,
                                 sampling_seed=1000 + i) for i in range(len(prompts))]  # fmt: skip
        t0 = time.perf_counter()
        results = client.generate(prompts, params, return_logprob=True, return_routed_experts=True)
        generate_s = time.perf_counter() - t0
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert isinstance(results, list)
    tokens = sum(len(r.output_ids) for r in results)
    print(f"{engine}: {tokens} tokens in {generate_s:.1f} s = {tokens / generate_s:.0f} tok/s", flush=True)
    return {"results": results, "startup_s": startup_s, "generate_s": generate_s, "tokens": tokens}


def score(
    ns: argparse.Namespace, model: Any, prompts: list[list[int]], run: dict[str, Any], url: str
) -> dict[str, Any]:
    """The trainer's log-probs of the engine's samples, own routes and replayed: gaps and route agreement."""
    from hpcrl.model import moe
    from hpcrl.rollout.generate import routed_experts
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.logprobs import token_logprobs

    args = model.args.moe
    shape = (len(args.sparse_layers), args.top_k)
    results = run["results"]
    routes = [routed_experts(r, len(p), shape, url) for p, r in zip(prompts, results, strict=True)]
    out: dict[str, Any] = {"routes_shape_first": list(routes[0].shape)}
    gaps: dict[str, list[torch.Tensor]] = {"own": [], "replay": []}
    agree = total = 0
    with torch.no_grad():
        for lo in range(0, len(prompts), ns.score_batch):
            sl = slice(lo, lo + ns.score_batch)
            batch = TrainBatch.from_sequences(
                prompts[sl], [r.output_ids for r in results[sl]],
                rollout_logprobs=[r.output_token_logprobs for r in results[sl]], routed_experts=routes[sl],
            ).to(torch.device(ns.device))  # fmt: skip
            targets = batch.input_ids[:, 1:]
            assert batch.routed_experts is not None
            model.routing.replay = batch.routed_experts
            for mode in ("own", "replay"):
                model.routing.force = mode == "replay"
                logits = model(batch.input_ids)[:, :-1]
                lp, _ = token_logprobs(logits.float(), targets)
                gaps[mode].append((lp - batch.rollout_logprobs).abs()[batch.loss_mask].float().cpu())
                if mode == "own":
                    # Sampled tokens only: the rows whose routes the engine took while sampling them.
                    mask = torch.zeros_like(batch.input_ids, dtype=torch.bool)
                    mask[:, :-1] = batch.loss_mask
                    stats = moe.route_stats(model.routing, args, mask)
                    rows = int(mask.sum()) * len(args.sparse_layers)
                    agree += round(stats["moe/route_agreement"] * rows)
                    total += rows
                del logits
            model.routing.replay = None
    for mode, parts in gaps.items():
        g = torch.cat(parts)
        out[f"gap_{mode}_max"], out[f"gap_{mode}_mean"] = float(g.max()), float(g.mean())
    out["route_agreement"] = agree / max(total, 1)
    # An engine whose head did not load (a tied checkpoint on SGLang's Qwen3-MoE) gives every token the same log-prob.
    engine_lps = torch.tensor([lp for r in results for lp in r.output_token_logprobs], dtype=torch.float64)
    out["engine_logprob_std"] = float(engine_lps.std())
    if out["engine_logprob_std"] < 1e-6:
        print(f"{url}: every sampled token has log-prob {float(engine_lps[0]):.6f}: the engine's logits are constant "
              "(its lm_head did not load), so the gaps measure that, not the routes", flush=True)  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/moe-gpu"))
    p.add_argument("--engines", default="sglang,embedded", help="comma-separated: sglang, embedded")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--score-batch", type=int, default=8, help="sequences per trainer forward")
    p.add_argument("--port", type=int, default=31171)
    # SGLang refuses to start unless the free memory left after its weights load is at least (1 - fraction) of what
    # was free before, and other processes loading beside it eat into that; --max-total-tokens caps the K/V pool, so
    # a high fraction costs no memory.
    p.add_argument("--mem-fraction", type=float, default=0.9, help="SGLang --mem-fraction-static")
    p.add_argument("--python", default=sys.executable, help="the interpreter that has sglang")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same kind (CPU dry run)")
    ns = p.parse_args()
    engines = [e for e in ns.engines.split(",") if e]
    bad = sorted(set(engines) - {"sglang", "embedded"})
    if bad:
        p.error(f"unknown engine(s) {bad}; valid: sglang, embedded")
    from hpcrl.model.hf import load_model, parse_dtype

    t_all = time.perf_counter()
    ns.out.mkdir(parents=True, exist_ok=True)
    ns.workdir.mkdir(parents=True, exist_ok=True)
    shape = TINY if ns.tiny else SHAPE
    model_dir = make_model(ns.workdir / f"qwen3-moe-{'tiny' if ns.tiny else '30b-a3b'}-{ns.layers}l", shape,
                           ns.layers, ns.dtype, ns.device)  # fmt: skip
    print(f"model: {model_dir} ({time.perf_counter() - t_all:.0f} s)", flush=True)
    gen = torch.Generator().manual_seed(1234)
    prompts = torch.randint(3, shape["vocab_size"], (ns.num_seqs, ns.prompt_len), generator=gen).tolist()
    runs = {engine: sample(ns, engine, model_dir, prompts) for engine in engines}
    model = load_model(model_dir, dtype=parse_dtype(ns.dtype), device=ns.device).eval()
    report: dict[str, Any] = {"shape": {**shape, "num_layers": ns.layers}, "num_seqs": ns.num_seqs,
                              "prompt_len": ns.prompt_len, "max_new_tokens": ns.max_new_tokens,
                              "device": torch.cuda.get_device_name() if ns.device == "cuda" else ns.device,
                              "engines": {}}  # fmt: skip
    for engine, run in runs.items():
        t0 = time.perf_counter()
        scored = score(ns, model, prompts, run, engine)
        report["engines"][engine] = {
            "startup_s": run["startup_s"], "generate_s": run["generate_s"], "tokens": run["tokens"],
            "decode_tok_s": run["tokens"] / run["generate_s"], "score_s": time.perf_counter() - t0, **scored,
        }  # fmt: skip
    report["total_s"] = time.perf_counter() - t_all
    print(f"\n{'engine':<9} {'tok/s':>8} {'routes':>14} {'agreement':>9} {'gap own max/mean':>22} "
          f"{'gap replay max/mean':>22}")  # fmt: skip
    for engine, r in report["engines"].items():
        own = f"{r['gap_own_max']:.3e}/{r['gap_own_mean']:.3e}"
        replay = f"{r['gap_replay_max']:.3e}/{r['gap_replay_mean']:.3e}"
        routes = str(r["routes_shape_first"])
        print(f"{engine:<9} {r['decode_tok_s']:8.0f} {routes:>14} {r['route_agreement']:9.4f} {own:>22} {replay:>22}")
    print(f"total {report['total_s']:.0f} s", flush=True)
    (ns.out / "moe_gpu.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
