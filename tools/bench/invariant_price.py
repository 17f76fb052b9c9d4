"""The price of the batch-invariant forward on the CPU: engine decode tokens/s and trainer forward time,
invariant vs plain, same model, prompts and threads, in one run (docs/numerics.md records a run).

    PYTHONPATH=. python tools/bench/invariant_price.py [--threads 1] [--num-seqs 128] [--max-new-tokens 32]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--shapes tiny wider qwen3-0.6b] [--json PATH]

The engine side drives a real `Scheduler` in this process (no HTTP: the price of the forward, not of the
server): plain is the device's default decode step (`auto`: eager on the CPU, CUDA graphs of the fused Triton
kernels on CUDA), invariant is `batch_invariant=True`. Every row
samples at temperature 1 with ignore_eos, so both generate exactly num_seqs x max_new_tokens tokens. The
trainer side times the log-prob forward of the generated sequences in micro-batches: the plain forward
with the trainer's `token_logprobs`, then `invariant.token_logprobs`; forward alone (no grad), and
forward + backward. Each measurement runs once untimed, then `--repeats` times; the median is printed.
Model shapes (`--shapes`): the quickstart's tiny Qwen3 (4 layers, hidden 128), a wider one (4 layers, hidden
512), and `qwen3-0.6b` (28 layers, hidden 1024, vocab 151,936, random weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


SHAPES: dict[str, tuple[str, dict[str, int] | None]] = {
    "tiny": (
        "tiny (quickstart: 4 x 128, inter 256)",
        dict(num_layers=4, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32),
    ),
    "wider": (
        "wider (4 x 512, inter 1536)",
        dict(num_layers=4, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4, head_dim=64),
    ),
    "qwen3-0.6b": ("qwen3-0.6b shape (28 x 1024, inter 3072, vocab 151936)", None),
}
"""name: (label, TinyModelSpec dims, or None for the real Qwen3-0.6B shape with its vocabulary)."""


def _median_s(fn: Callable[[], object], repeats: int, device: str = "cpu") -> float:
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(model_dir: Path, prompts: list[list[int]], ns: argparse.Namespace) -> tuple[dict[bool, float], ...]:
    """(engine tok/s, trainer forward s, trainer forward + backward s), each keyed by batch_invariant."""
    import torch

    from hpcrl.engine.config import EngineConfig
    from hpcrl.engine.embedded.scheduler import Scheduler, SchedulerConfig, SeqRequest
    from hpcrl.model import invariant
    from hpcrl.model.hf import load_model, parse_dtype
    from hpcrl.trainer.logprobs import token_logprobs

    device, dtype = torch.device(ns.device), parse_dtype(ns.dtype)

    # One scheduler per mode, made outside the timing (a CUDA engine captures its graphs when it starts).
    model = load_model(model_dir, dtype=dtype, device=device).eval()
    schedulers = {
        bi: Scheduler(
            model,
            SchedulerConfig(
                engine=EngineConfig(
                    device=ns.device,
                    dtype=ns.dtype,
                    max_running_requests=ns.num_seqs,
                    batch_invariant=bi,
                    decode_profile=ns.profile,
                    deterministic=False,
                ),
                context_length=ns.prompt_len + ns.max_new_tokens + 1,
            ),
            device=device,
            dtype=dtype,
        )
        for bi in (False, True)
    }

    def generate(batch_invariant: bool) -> list[list[int]]:
        sched = schedulers[batch_invariant]
        reqs = [
            SeqRequest(
                rid=str(i), prompt_ids=pr, max_new_tokens=ns.max_new_tokens, temperature=1.0, top_k=0,
                top_p=1.0, min_p=0.0, seed=i, stop_token_ids=frozenset(), ignore_eos=True,
                return_logprob=True, return_sampling_mask=False, on_done=lambda r: None,
            )
            for i, pr in enumerate(prompts)
        ]  # fmt: skip
        sched.submit(reqs)
        with torch.inference_mode():
            while sched.waiting or sched.running:
                sched._step()
            sched._drain()
        return [r.all_ids for r in reqs]

    tokens = ns.num_seqs * ns.max_new_tokens
    engine = {bi: tokens / _median_s(lambda bi=bi: generate(bi), ns.repeats, ns.device) for bi in (False, True)}
    print(f"{model_dir.name}: engine tok/s {engine}", flush=True)
    if ns.profile:  # where a decode step's time goes: the GPU forward, the sampler, the host
        for bi in (False, True):
            print(f"{model_dir.name}: {'invariant' if bi else 'plain'} profile {schedulers[bi].profile_summary()}")
    seqs = torch.tensor(generate(True), device=device)
    schedulers.clear()  # their KV caches: the trainer side needs the memory
    model = load_model(model_dir, dtype=dtype, device=device)
    micro = [seqs[i : i + ns.micro_batch] for i in range(0, len(seqs), ns.micro_batch)]

    def logprobs(mb: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        if batch_invariant:
            return invariant.token_logprobs(model, mb)
        return token_logprobs(model(mb)[:, :-1], mb[:, 1:])[0]

    def run(batch_invariant: bool, backward: bool) -> None:
        for mb in micro:
            if backward:
                logprobs(mb, batch_invariant).sum().backward()
            else:
                with torch.no_grad():
                    logprobs(mb, batch_invariant)
        model.zero_grad(set_to_none=True)

    fwd = {bi: _median_s(lambda bi=bi: run(bi, False), ns.repeats, ns.device) for bi in (False, True)}
    fwd_bwd = {bi: _median_s(lambda bi=bi: run(bi, True), ns.repeats, ns.device) for bi in (False, True)}
    print(f"{model_dir.name}: trainer forward s {fwd}, forward + backward s {fwd_bwd}", flush=True)
    return engine, fwd, fwd_bwd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-seqs", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--profile",
        action="store_true",
        help="time each decode step's forward and sampling (CUDA events) and print the split per mode",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (engine and trainer on the same device)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--shapes", nargs="+", default=["tiny", "wider"], choices=list(SHAPES))
    p.add_argument("--json", type=Path, help="also write the figures here")
    ns = p.parse_args()

    import torch

    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, TinyModelSpec, init_shaped_model, init_tiny_model

    torch.set_num_threads(ns.threads)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 99, (ns.prompt_len,), generator=gen).tolist() for _ in range(ns.num_seqs)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ns.shapes:
            label, dims = SHAPES[name]
            out = Path(tmp) / name
            if dims is None:
                model_dir = init_shaped_model(out, QWEN3_0_6B_SHAPE, dtype=ns.dtype, device=ns.device)
            else:
                model_dir = init_tiny_model(out, TinyModelSpec(**dims))
            rows.append((label, *_measure(model_dir, prompts, ns)))

    where = f"CUDA ({torch.cuda.get_device_name()})" if ns.device.startswith("cuda") else "CPU"
    print(
        f"\n{where}, {ns.dtype}, torch {torch.__version__}, {ns.threads} thread(s); engine: {ns.num_seqs} sequences x "
        f"{ns.max_new_tokens} new tokens (prompt {ns.prompt_len}); trainer: the same {ns.num_seqs} sequences "
        f"in micro-batches of {ns.micro_batch}\n"
    )
    print("| model | engine tok/s plain | engine tok/s invariant | decode slowdown | trainer fwd plain | "
          "trainer fwd invariant | fwd slowdown | fwd+bwd plain | fwd+bwd invariant | fwd+bwd slowdown |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, engine, fwd, fwd_bwd in rows:
        print(
            f"| {label} | {engine[False]:.0f} | {engine[True]:.0f} | {engine[False] / engine[True]:.2f}x "
            f"| {fwd[False] * 1e3:.0f} ms | {fwd[True] * 1e3:.0f} ms | {fwd[True] / fwd[False]:.2f}x "
            f"| {fwd_bwd[False] * 1e3:.0f} ms | {fwd_bwd[True] * 1e3:.0f} ms "
            f"| {fwd_bwd[True] / fwd_bwd[False]:.2f}x |"
        )
    for label, engine, fwd, _ in rows:
        print(
            f"price {label}: decode {engine[False] / engine[True]:.2f}x slower (target <= 1.3x), trainer forward "
            f"{fwd[True] / fwd[False]:.2f}x slower (target <= 1.2x)"
        )
    if ns.json is not None:
        figures = {
            label: {
                "engine_tok_s": {"plain": engine[False], "invariant": engine[True]},
                "trainer_forward_s": {"plain": fwd[False], "invariant": fwd[True]},
                "trainer_forward_backward_s": {"plain": fwd_bwd[False], "invariant": fwd_bwd[True]},
                "decode_slowdown": engine[False] / engine[True],
                "forward_slowdown": fwd[True] / fwd[False],
                "forward_backward_slowdown": fwd_bwd[True] / fwd_bwd[False],
            }
            for label, engine, fwd, fwd_bwd in rows
        }
        setup = {k: v for k, v in vars(ns).items() if k != "json"}
        ns.json.write_text(json.dumps({"setup": setup, "torch": torch.__version__, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
