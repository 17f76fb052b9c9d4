"""Decode tokens/s of the embedded engine's scheduler serving a LoRA adapter merged into its weights vs unmerged.

    python tools/bench/lora_serving.py [--shape bench|quickstart|qwen3-0.6b] [--rank 16] [--num-seqs 64]
        [--max-new-tokens 64] [--threads 2] [--repeats 3]

Merged: every adapted weight holds W + B' A (hpcrl/model/lora.py `merged_weight`, what the `lora` apply strategy
writes once per version); the decode step is the plain model's. Unmerged: the weights stay W and every GEMM of an
adapted layer computes W x + B' (A x) at every token (the adapters fused as the engine fuses q/k/v and gate/up:
two thin GEMMs beside each base one), nothing written when a version arrives. Both serve the same adapter (rank
--rank on every linear layer of the decoder layers, random A and B') through a real `Scheduler` driven on this
thread (the engine's CPU decode and prefill steps), the same prompts and seeds at temperature 1 with ignore_eos, so
every pass decodes --num-seqs x --max-new-tokens tokens; the passes alternate and the table gives the median of
--repeats. Also printed: the seconds of one merge (the price the merged way pays per version), and whether the
unmerged log-probs equal the merged ones bit for bit (what the trainer's batch-invariant forward scores: it reads
the merged weight).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import hpcrl.engine.embedded.forward as forward_module  # noqa: E402 - after the path that finds hpcrl
from hpcrl.engine.config import EngineConfig  # noqa: E402
from hpcrl.engine.embedded.scheduler import Scheduler, SchedulerConfig, SeqRequest  # noqa: E402
from hpcrl.model.hf import load_model  # noqa: E402
from hpcrl.model.lora import merged_weight  # noqa: E402
from hpcrl.model.qwen3 import CausalLM  # noqa: E402
from hpcrl.model.tiny import TinyModelSpec, init_tiny_model  # noqa: E402

SHAPES = {
    "quickstart": dict(num_layers=4, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32),
    "bench": dict(num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64),
    "qwen3-0.6b": dict(
        num_layers=28, hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8, head_dim=128
    ),
}


class Unmerged:
    """The engine's CPU GEMM (`forward._linear`) with the adapter added: W x + B' (A x).

    The CPU decode and prefill steps read fused [q; k; v] and [gate; up] weights, so an unmerged engine would
    fuse the adapters alike: A stacked [3r, in] and B' block-diagonal, two thin GEMMs beside each base GEMM. The
    fused tensors are made by each scheduler's first step (their first parameter's storage is the fused
    tensor's), so the table is keyed by data pointer and built on the first call of each pass.
    """

    def __init__(self, model: CausalLM, adapter: dict[str, tuple[Tensor, Tensor]]) -> None:
        self.model, self.adapter = model, adapter
        self.table: dict[int, tuple[Tensor, Tensor]] | None = None
        self.plain = forward_module._linear

    def build(self) -> dict[int, tuple[Tensor, Tensor]]:
        table = {}
        for i, layer in enumerate(self.model.model.decoder_layers):
            at, mlp = layer.self_attn, layer.mlp
            p = f"model.layers.{i}."
            for first, names in (
                (at.q_proj, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                (at.o_proj, ["self_attn.o_proj"]),
                (mlp.gate_proj, ["mlp.gate_proj", "mlp.up_proj"]),
                (mlp.down_proj, ["mlp.down_proj"]),
            ):
                parts = [self.adapter[p + n] for n in names]
                table[first.weight.data_ptr()] = (
                    torch.cat([a for a, _ in parts]),
                    torch.block_diag(*[b for _, b in parts]),
                )
        return table

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        if self.table is None:
            self.table = self.build()
        out = self.plain(x, w, b)
        ab = self.table.get(w.data_ptr())
        if ab is None:  # the LM head: not adapted
            return out
        return out + torch.mm(torch.mm(x, ab[0].t()), ab[1].t())


def adapters(model: CausalLM, rank: int) -> dict[str, tuple[Tensor, Tensor]]:
    """Random A [r, in] and B' [out, r] for every linear layer of the decoder layers (fp32, as a push sends)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name.startswith("model.layers."):
            a = torch.randn(rank, m.in_features, generator=gen) / m.in_features**0.5
            b = torch.randn(m.out_features, rank, generator=gen) * 0.02
            out[name] = (a, b)
    return out


def requests(ns: argparse.Namespace, vocab: int) -> list[SeqRequest]:
    rng = random.Random(0)
    return [
        SeqRequest(
            rid=f"r{i}",
            prompt_ids=[rng.randrange(3, vocab) for _ in range(ns.prompt_len)],
            max_new_tokens=ns.max_new_tokens,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            seed=1000 + i,
            stop_token_ids=frozenset(),
            ignore_eos=True,
            return_logprob=True,
            return_sampling_mask=False,
            on_done=lambda r: None,
        )
        for i in range(ns.num_seqs)
    ]


def decode(model: CausalLM, ns: argparse.Namespace) -> tuple[float, list[list[tuple[int, float]]]]:
    """Seconds of one pass over every request (prefill + decode), and each request's (token, log-prob)s."""
    engine = EngineConfig(max_running_requests=ns.num_seqs, dtype="float32", num_threads=ns.threads)
    sched = Scheduler(
        model,
        SchedulerConfig(engine=engine, context_length=ns.prompt_len + ns.max_new_tokens + 8),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    reqs = requests(ns, model.args.vocab_size)
    start = time.perf_counter()
    sched.submit(reqs)
    with torch.inference_mode():
        while sched.waiting or sched.running:
            sched._step()
        sched._drain()
    seconds = time.perf_counter() - start
    assert all(len(r.output_ids) == ns.max_new_tokens for r in reqs)
    return seconds, [list(zip(r.output_ids, r.logprobs, strict=True)) for r in reqs]


def same_prefix_diff(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> float:
    """The largest log-prob difference while both sampled the same tokens (same seeds: until rounding diverges)."""
    diff = 0.0
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        diff = max(diff, abs(la - lb))
        if ta != tb:
            break
    return diff


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="bench", choices=sorted(SHAPES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    with tempfile.TemporaryDirectory(prefix="hpcrl-lora-serving-") as tmp:
        model_dir = init_tiny_model(Path(tmp) / "model", TinyModelSpec(**SHAPES[ns.shape], max_position_embeddings=512))
        model = load_model(model_dir).eval()
    modules = dict(model.named_modules())
    adapter = adapters(model, ns.rank)
    base = {n: modules[n].weight.detach().clone() for n in adapter}

    def merge() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for n, (a, b) in adapter.items():
                modules[n].weight.copy_(merged_weight(base[n], a, b))
        return time.perf_counter() - start

    def unmerged_pass() -> tuple[float, list[list[tuple[int, float]]]]:
        with torch.no_grad():
            for n in adapter:
                modules[n].weight.copy_(base[n])
        unmerged = Unmerged(model, adapter)
        forward_module._linear = unmerged  # type: ignore[assignment]
        try:
            return decode(model, ns)
        finally:
            forward_module._linear = unmerged.plain

    merge_s = [merge() for _ in range(3)]
    decode(model, ns)  # warm-up (allocator, first kernels)
    merged_s, unmerged_s = [], []
    merged_lp = unmerged_lp = None
    for _ in range(ns.repeats):
        merge()
        t, merged_lp = decode(model, ns)
        merged_s.append(t)
        t, unmerged_lp = unmerged_pass()
        unmerged_s.append(t)
    assert merged_lp is not None and unmerged_lp is not None
    diff = max(same_prefix_diff(m, u) for m, u in zip(merged_lp, unmerged_lp, strict=True))
    tokens = ns.num_seqs * ns.max_new_tokens
    m, u = statistics.median(merged_s), statistics.median(unmerged_s)
    adapted = sum(a.numel() + b.numel() for a, b in adapter.values())
    print(
        f"\nembedded engine, eager CPU decode, shape={ns.shape}, rank {ns.rank} on {len(adapter)} linear layers "
        f"({adapted / 1e6:.2f}M adapter parameters), {ns.num_seqs} seqs x {ns.prompt_len} prompt + "
        f"{ns.max_new_tokens} new tokens, {ns.threads} threads, median of {ns.repeats} alternating passes"
    )
    print("| serving | pass (s) | decode tok/s | per version |\n|---|---|---|---|")
    print(f"| merged (W + B'A written once) | {m:.2f} | {tokens / m:.0f} | merge {statistics.median(merge_s):.3f} s |")
    print(f"| unmerged (W x + B'(A x) per token) | {u:.2f} | {tokens / u:.0f} | nothing |")
    print(
        f"unmerged / merged time: {u / m:.2f}; unmerged log-probs vs merged: max |diff| {diff:.3e} "
        f"({'bit for bit' if diff == 0 else 'not bit for bit: the invariant trainer forward scores the merged weight'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
