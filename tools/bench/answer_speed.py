"""The time a /generate answer with log-probs costs outside the GPU: writing it (the embedded server) and reading it
(hpcrl's engine client), on this machine's CPU, with no engine running.

    PYTHONPATH=. python tools/bench/answer_speed.py [--num-seqs 256] [--tokens 512] [--repeats 5]

Builds the results a 256 x 512 batch returns (random ids and log-probs), then times, median of --repeats:
- text: the answer's `text` fields, `decode_ids` with the character tokenizer of `init_shaped_model` (the decode
  bench's model, whose 99 tokens leave nearly every sampled id unknown: this times what that bench's server does,
  not the decoding of real text), and which decode path it takes (transformers versions differ between machines);
- write: `GenerateResult.to_response` for each and `jsonwire.dumps`, with the collector paused as the server does;
- filled a step at a time: the same write from log-prob rows that grew one entry a step, every row in turn, as the
  engine's scheduler fills them: as lists of float objects (scattered over the heap) and as `array("d")` (inline
  doubles, what the scheduler keeps);
- read: `jsonwire.loads` and `parse_generate_response`, as `EngineClient.generate` does, with the bulk check of the
  log-prob entries, and the same with the per-entry checks alone (what every answer went through before the bulk
  check; they still run, for the error message, when the bulk check finds something off);
- packed: the write and the read of the same answer with `return_logprob_packed` (one base64 float64 column a row,
  no triples), what hpcrl's engine client asks the embedded engine for.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import orjson  # noqa: E402
import torch  # noqa: E402, F401 - a process as large as the engine's and the client's: collections scan it
import transformers  # noqa: E402

from hpcrl.engine import jsonwire  # noqa: E402
from hpcrl.engine.embedded.detokenize import _decode_is_transformers_own, decode_ids  # noqa: E402
from hpcrl.engine.protocol import answers as P  # noqa: E402
from hpcrl.model.tiny import build_tokenizer  # noqa: E402


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--tokens", type=int, default=512, help="output tokens a sequence")
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args()
    if ns.num_seqs < 1 or ns.tokens < 1 or ns.repeats < 1:
        p.error("--num-seqs, --tokens and --repeats must be >= 1")
    rng = random.Random(0)
    results = [
        P.GenerateResult(
            text="",
            output_ids=[rng.randrange(151_936) for _ in range(ns.tokens)],
            rid=str(i),
            finish_reason=P.FinishReason.from_dict({"type": "length", "length": ns.tokens}),
            prompt_tokens=128,
            completion_tokens=ns.tokens,
            weight_version="0",
            output_token_logprobs=[-rng.random() * 5 for _ in range(ns.tokens)],
            weight_versions=[P.WeightVersionSpan(version="0", start=0, end=ns.tokens)],
            e2e_latency_s=1.0,
        )
        for i in range(ns.num_seqs)
    ]
    gc.collect()
    gc.freeze()  # as the server does after start-up

    def write() -> bytes:
        with jsonwire.gc_paused():
            return jsonwire.dumps([r.to_response() for r in results])

    body = write()

    def read() -> object:
        return P.parse_generate_response(jsonwire.loads(body))

    def read_per_entry() -> object:
        bulk = P._logprob_columns
        P._logprob_columns = lambda entries: None  # forces the per-entry checks
        try:
            return read()
        finally:
            P._logprob_columns = bulk

    tokenizer = build_tokenizer()
    own = _decode_is_transformers_own(type(tokenizer)) and hasattr(tokenizer, "_decode")
    decode_path = "_decode" if own else "decode"  # as decode_ids chooses

    def text() -> list[str]:
        return [decode_ids(tokenizer, r.output_ids) for r in results]

    def filled_step_by_step(kind: Callable[[], Any]) -> list[Any]:
        rows = [kind() for _ in results]
        others = []  # the engine allocates between steps too
        columns = [r.output_token_logprobs or [] for r in results]
        for t in range(ns.tokens):
            step = [c[t] + 0.0 for c in columns]  # fresh floats, as a step's tolist()
            others.append([object() for _ in range(64)])
            for row, lp in zip(rows, step, strict=True):
                row.append(lp)
        return rows

    def write_from(rows: list[Any]) -> Callable[[], bytes]:
        def write_rows() -> bytes:
            with jsonwire.gc_paused():
                out = []
                for r, lps in zip(results, rows, strict=True):
                    lps = lps if isinstance(lps, list) else lps.tolist()
                    out.append(dataclasses.replace(r, output_token_logprobs=lps).to_response())
                return jsonwire.dumps(out)

        return write_rows

    as_lists = filled_step_by_step(list)
    as_arrays = filled_step_by_step(lambda: array("d"))
    assert write_from(as_lists)() == write_from(as_arrays)() == write(), "the layouts wrote different answers"

    def write_packed() -> bytes:
        # As the server answers return_logprob_packed: no triples, each row's array("d") as one base64 column.
        with jsonwire.gc_paused():
            out = []
            for r, lps in zip(results, as_arrays, strict=True):
                response = dataclasses.replace(r, output_token_logprobs=None).to_response()
                response["meta_info"][P.PACKED_LOGPROBS_KEY] = P.pack_logprobs(lps)
                out.append(response)
            return jsonwire.dumps(out)

    packed_body = write_packed()

    def read_packed() -> object:
        return P.parse_generate_response(jsonwire.loads(packed_body))

    parsed = read()
    assert isinstance(parsed, list) and parsed == results, "the answer did not read back as the results written"
    assert read_per_entry() == parsed
    assert read_packed() == parsed, "the packed answer did not read back as the results written"
    print(f"python {platform.python_version()}, transformers {transformers.__version__}, orjson {orjson.__version__}")
    print(f"{ns.num_seqs} results x {ns.tokens} tokens with log-probs: {len(body) / 1e6:.1f} MB of JSON")
    print(f"| step | s (median of {ns.repeats}) |\n|---|---:|")
    print(f"| text (decode_ids x {ns.num_seqs}, {decode_path}) | {_median_s(text, ns.repeats):.4f} |")
    print(f"| write (to_response + dumps, collector paused) | {_median_s(write, ns.repeats):.4f} |")
    for name, rows in (("lists", as_lists), ("array('d')", as_arrays)):
        t = _median_s(write_from(rows), ns.repeats)
        print(f"| write, log-probs filled a step at a time as {name} | {t:.4f} |")
    print(f"| read, bulk check (loads + parse_generate_response) | {_median_s(read, ns.repeats):.4f} |")
    print(f"| read, per-entry checks only (before) | {_median_s(read_per_entry, ns.repeats):.4f} |")
    print(f"| write, packed log-probs ({len(packed_body) / 1e6:.1f} MB) | {_median_s(write_packed, ns.repeats):.4f} |")
    print(f"| read, packed log-probs (loads + parse_generate_response) | {_median_s(read_packed, ns.repeats):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
