"""Output tokens/s of the embedded engine (a real `hpcrl engine serve` over HTTP) against transformers'
`model.generate` and, with --engine both, stock SGLang, on the same model, prompts and lengths, in one run.

    PYTHONPATH=. python tools/bench/engine_throughput.py --init-tiny --num-seqs 64 --prompt-len 32 \
        --max-new-tokens 64 --threads 2
    PYTHONPATH=. python tools/bench/engine_throughput.py --init-qwen3-0.6b-shape --device cuda \
        --dtype bfloat16 --num-seqs 256 --prompt-len 128 --max-new-tokens 512
    # the embedded engine, then stock SGLang (installed; tools/gpu/run_engine_gpu.sh), with log-probs:
    PYTHONPATH=. python tools/bench/engine_throughput.py --init-qwen3-0.6b-shape --device cuda \
        --dtype bfloat16 --num-seqs 256 --prompt-len 128 --max-new-tokens 512 --engine both --logprobs \
        --skip-generate --sglang-arg=--attention-backend --sglang-arg=triton

Both sides sample from the full distribution at temperature 1 (engine: ignore_eos; generate: do_sample,
top_k=0, top_p=1, min_new_tokens = max_new_tokens), so every sequence has exactly max_new_tokens
tokens. Each side runs once untimed first (warm-up: CUDA graphs, Triton compiles, allocator), then
once timed; the engine's time is the wall time of one /generate batch call (or of all concurrent
requests with --client concurrent), the server already started and its model loaded. The engines run one
after the other, never at once: each has the GPU to itself. SGLang runs with CUDA graphs up to batch
--num-seqs, `--sampling-backend pytorch --grammar-backend none` and whatever --sglang-arg adds.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hpcrl.engine import jsonwire  # noqa: E402 - after the path that finds hpcrl
from hpcrl.engine.protocol.answers import PACKED_LOGPROBS_KEY, parse_generate_response  # noqa: E402

JSON_HEADERS = {"content-type": "application/json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prepare_model(ns: argparse.Namespace, workdir: Path) -> Path:
    from hpcrl.model.tiny import QWEN3_0_6B_SHAPE, init_shaped_model, init_tiny_model

    if ns.model:
        return Path(ns.model)
    if ns.init_tiny:
        return init_tiny_model(workdir / "tiny", overwrite=True)
    if ns.init_qwen3_0_6b_shape:
        if (workdir / "qwen3-0.6b-shape" / "config.json").exists():  # a rerun in the same --workdir
            print(f"reusing the model in {workdir / 'qwen3-0.6b-shape'}", flush=True)
            return workdir / "qwen3-0.6b-shape"
        t0 = time.perf_counter()
        device = ns.device if ns.device.startswith("cuda") else "cpu"
        path = init_shaped_model(workdir / "qwen3-0.6b-shape", QWEN3_0_6B_SHAPE, dtype=ns.dtype, device=device)
        print(f"wrote a random Qwen3-0.6B-shaped model to {path} in {time.perf_counter() - t0:.1f} s", flush=True)
        return path
    raise SystemExit("pass --model DIR, --init-tiny or --init-qwen3-0.6b-shape")


def _prompts(ns: argparse.Namespace, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    # Ids from 3 on: past the special tokens, so a prompt never starts with an end-of-turn token.
    return torch.randint(3, vocab, (ns.num_seqs, ns.prompt_len), generator=gen).tolist()


def _sglang_command(ns: argparse.Namespace, model_dir: Path, port: int) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--port", str(port),
        "--dtype", ns.dtype, "--random-seed", "0", "--max-running-requests", str(ns.num_seqs),
        "--context-length", str(ns.prompt_len + ns.max_new_tokens + 8), "--cuda-graph-max-bs", str(ns.num_seqs),
        # (SGLang keeps a few positions of the context back: 640 gave 510 new tokens of 512)
        "--mem-fraction-static", str(ns.sglang_mem_fraction), "--sampling-backend", "pytorch",
        "--grammar-backend", "none", "--skip-server-warmup", *ns.sglang_arg,
    ]  # fmt: skip


def _embedded_command(ns: argparse.Namespace, model_dir: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hpcrl.cli",
        "engine",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--device",
        ns.device,
        "--dtype",
        ns.dtype,
        "--max-running-requests",
        str(ns.num_seqs),
        "--context-length",
        str(ns.prompt_len + ns.max_new_tokens),
        "--max-prefill-tokens",
        str(ns.max_prefill_tokens or max(ns.num_seqs * ns.prompt_len, 4096)),
        "--no-deterministic",  # requests join a running batch, as a serving engine's do
        *ns.engine_arg,
    ]


class Engine:
    def __init__(self, ns: argparse.Namespace, model_dir: Path, log_path: Path, *, kind: str = "embedded") -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.kind = kind
        cmd = (
            _sglang_command(ns, model_dir, self.port)
            if kind == "sglang"
            else _embedded_command(ns, model_dir, self.port)
        )
        if ns.threads and kind == "embedded":
            cmd += ["--num-threads", str(ns.threads)]
        if ns.kv_cache_dtype != "auto":
            cmd += ["--kv-cache-dtype", ns.kv_cache_dtype]  # the same flag and value on both engines
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        if ns.threads:
            env["OMP_NUM_THREADS"] = str(ns.threads)
        for kv in ns.engine_env:
            key, _, value = kv.partition("=")
            env[key] = value
        with open(log_path, "wb") as log:
            # Its own process group: SGLang's scheduler and detokenizer are children that must go with it.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"engine not healthy after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # children that outlived their parent
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class PassTime(NamedTuple):
    """One pass as the client saw it, and the parts it can tell apart (sorts by the pass's time)."""

    s: float  # request sent -> answer parsed
    tokens: int
    parse_s: float  # the client's parse of the answer
    server_s: float  # the longest request's time inside the engine: arrival (parsed) -> its last token
    check_s: float  # hpcrl's engine client checking the parsed answer (parse_generate_response); not in `s`


def _logprob_wire(ns: argparse.Namespace, kind: str) -> str | None:
    """The log-prob wire a pass on engine `kind` uses: --logprob-wire on the embedded engine, the triples on SGLang
    (it refuses return_logprob_packed, as hpcrl's engine client knows from its /server_info); None without
    --logprobs."""
    if not ns.logprobs:
        return None
    return ns.logprob_wire if kind == "embedded" else "triples"


def _parse(raw: bytes, wire: str | None) -> tuple[list[dict[str, Any]], list[list[float]] | None]:
    """The answer as hpcrl's engine client parses it (orjson), with the packed log-probs decoded into Python floats
    (None on the other wires): the triples hold theirs as floats once parsed, so both wires' parse times include
    the floats."""
    outs = jsonwire.loads(raw)
    outs = outs if isinstance(outs, list) else [outs]
    if wire == "packed":
        return outs, [array("d", base64.b64decode(o["meta_info"][PACKED_LOGPROBS_KEY])).tolist() for o in outs]
    return outs, None


def _engine_pass(ns: argparse.Namespace, client: Any, url: str, prompts: list[list[int]], wire: str | None) -> PassTime:
    params = {"max_new_tokens": ns.max_new_tokens, "ignore_eos": True, "temperature": 1.0}
    extra: dict[str, Any] = {"return_logprob": True} if wire else {}
    if wire == "packed":
        extra["return_logprob_packed"] = True
    t0 = time.perf_counter()
    parse_s = 0.0
    if ns.client == "batch":
        # Written with orjson, as hpcrl's engine client writes a GenerateRequest (the standard library's json=
        # took 1.7 ms for these 256 x 128 ids on a 2-core CPU, orjson 0.23 ms).
        body = jsonwire.dumps({"input_ids": prompts, "sampling_params": params, **extra})
        r = client.post(url + "/generate", content=body, headers=JSON_HEADERS)
        r.raise_for_status()
        t1 = time.perf_counter()
        outs, decoded = _parse(r.content, wire)
        parse_s = time.perf_counter() - t1
    else:

        def one(p: list[int]) -> tuple[list[dict[str, Any]], list[list[float]] | None]:
            body = jsonwire.dumps({"input_ids": p, "sampling_params": params, **extra})
            r = client.post(url + "/generate", content=body, headers=JSON_HEADERS)
            r.raise_for_status()
            return _parse(r.content, wire)

        with ThreadPoolExecutor(max_workers=min(len(prompts), 256)) as pool:
            parsed = list(pool.map(one, prompts))
        outs = [o for os_, _ in parsed for o in os_]
        decoded = None if wire != "packed" else [lp for _, lps in parsed for lp in lps or []]
        parse_s = math.nan  # each request parses its own answer inside the pass: not apart from the rest
    dt = time.perf_counter() - t0
    lengths = [o["meta_info"]["completion_tokens"] for o in outs]
    if any(n != ns.max_new_tokens for n in lengths):
        raise RuntimeError(f"engine returned lengths {sorted(set(lengths))}, expected {ns.max_new_tokens}")
    if wire is not None:
        counts = (
            [len(lp) for lp in decoded]
            if decoded is not None
            else [len(o["meta_info"].get("output_token_logprobs") or []) for o in outs]
        )
        if len(counts) != len(outs) or any(n != ns.max_new_tokens for n in counts):
            raise RuntimeError(f"--logprobs ({wire} wire): the engine did not return one log-prob per output token")
    server_s = max((o["meta_info"].get("e2e_latency") or 0.0) for o in outs)
    t2 = time.perf_counter()
    parse_generate_response(outs)
    return PassTime(dt, sum(lengths), parse_s, server_s, time.perf_counter() - t2)


def run_engine(
    ns: argparse.Namespace, model_dir: Path, prompts: list[list[int]], workdir: Path, *, kind: str = "embedded"
) -> dict[str, Any]:
    import httpx

    eng = Engine(ns, model_dir, workdir / f"{kind}.log", kind=kind)
    key = "engine" if kind == "embedded" else kind
    wire = _logprob_wire(ns, kind)
    try:
        t0 = time.perf_counter()
        eng.wait_ready(600)
        startup = time.perf_counter() - t0
        # One client for all passes, as a real one keeps its connection: a fresh httpx client per call
        # costs tens of milliseconds (an SSL context), which is client overhead, not the engine's.
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        with httpx.Client(timeout=3600, limits=limits) as client:

            def server_info() -> dict[str, Any]:
                return client.get(eng.url + "/server_info").json()["internal_states"][0] if kind == "embedded" else {}

            passes = [_engine_pass(ns, client, eng.url, prompts, wire) for _ in range(ns.warmup_runs)]
            warm = server_info()
            passes += [_engine_pass(ns, client, eng.url, prompts, wire) for _ in range(ns.timed_runs)]
            info = server_info()
    except Exception:
        print(eng.log_tail(), file=sys.stderr)
        raise
    finally:
        eng.stop()
    timed = sorted(passes[ns.warmup_runs :])
    median = timed[len(timed) // 2]
    dt, tokens = median.s, median.tokens
    return {
        f"{key}_tok_s": tokens / dt,
        f"{key}_logprob_wire": wire,
        f"{key}_s": dt,
        f"{key}_tokens": tokens,
        f"{key}_timed_passes_tok_s": [p.tokens / p.s for p in passes[ns.warmup_runs :]],
        f"{key}_first_pass_tok_s": passes[0].tokens / passes[0].s,
        # Where the median pass went: inside the engine (arrival -> last token of the slowest request), the
        # client's parse of the answer, and the rest (sending, the engine's answer, the transfer).
        f"{key}_pass_server_s": median.server_s,
        f"{key}_pass_parse_s": median.parse_s,
        f"{key}_pass_rest_s": median.s - median.server_s - (0.0 if math.isnan(median.parse_s) else median.parse_s),
        f"{key}_client_check_s": median.check_s,
        f"{key}_startup_s": startup,
        f"{key}_decode_path": info.get("decode_path"),
        f"{key}_pdl": info.get("pdl"),
        f"{key}_profile": info.get("profile"),
        f"{key}_profile_timed": _timed_profile(warm.get("profile"), info.get("profile")),
    }


def _logprobs_text(ns: argparse.Namespace) -> str:
    """`yes (packed wire)`, or one wire per engine with --engine both (SGLang always gets the triples)."""
    if not ns.logprobs:
        return "no"
    kinds = ["embedded", "sglang"] if ns.engine == "both" else [ns.engine]
    wires = {kind: _logprob_wire(ns, kind) for kind in kinds}
    if len(set(wires.values())) == 1:
        return f"yes ({wires[kinds[0]]} wire)"
    return "yes (" + ", ".join(f"{kind}: {wire} wire" for kind, wire in wires.items()) + ")"


def _seconds(value: float) -> str:
    return "n/a (inside each request)" if math.isnan(value) else f"{value:.3f} s"


def _timed_profile(warm: dict[str, Any] | None, end: dict[str, Any] | None) -> dict[str, Any] | None:
    """The engine's decode profile over the timed passes only: the end's totals minus the warm-up's (whose first
    steps hold graph captures and compiles), per decode step of the timed passes."""
    if not warm or not end:
        return None
    steps = end["decode_steps"] - warm["decode_steps"]
    if steps <= 0:
        return None
    out: dict[str, Any] = {"decode_steps": steps}
    for k, v in end.items():
        if k.endswith("_ms_per_step"):
            out[k] = (v * end["decode_steps"] - warm[k] * warm["decode_steps"]) / steps
    for k in ("prefill_s_total", "intake_s_total", "answer_s_total", "answer_cpu_s_total", "answer_queue_s_total"):
        if k in end and k in warm:
            out[k] = end[k] - warm[k]
    return out


def run_generate(ns: argparse.Namespace, model_dir: Path, prompts: list[list[int]]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.model.hf import parse_dtype

    if ns.threads:
        torch.set_num_threads(ns.threads)
    device = torch.device(ns.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=parse_dtype(ns.dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def gen(max_new: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=model.config.pad_token_id,
            )

    # Warm-up: kernels, allocator, cuBLAS handles. On the CPU a full-length pass: fresh memory pages
    # made the first passes here several times slower than later ones.
    for _ in range(ns.warmup_runs):
        gen(ns.max_new_tokens if device.type == "cpu" else min(ns.max_new_tokens, 8))
    times = []
    for _ in range(ns.generate_runs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = gen(ns.max_new_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        new = out.shape[1] - ids.shape[1]
        if new != ns.max_new_tokens:
            raise RuntimeError(f"generate returned {new} new tokens per row, expected {ns.max_new_tokens}")
    tokens = out.shape[0] * ns.max_new_tokens
    dt = sorted(times)[len(times) // 2]  # the median timed pass
    return {
        "generate_tok_s": tokens / dt,
        "generate_s": dt,
        "generate_tokens": tokens,
        "generate_timed_passes_tok_s": [tokens / t for t in times],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face model directory")
    src.add_argument("--init-tiny", action="store_true", help="create hpcrl's tiny model (random weights)")
    src.add_argument(
        "--init-qwen3-0.6b-shape",
        dest="init_qwen3_0_6b_shape",
        action="store_true",
        help="create a random-weight model with Qwen3-0.6B's shape (28 layers, hidden 1024, vocab 151936)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads on both sides")
    p.add_argument("--client", choices=["batch", "concurrent"], default="batch", help="one batch call or N requests")
    p.add_argument("--warmup-runs", type=int, default=1)
    p.add_argument("--timed-runs", type=int, default=1, help="engine passes timed; the median is reported")
    p.add_argument("--generate-runs", type=int, default=1, help="generate passes timed; the median is reported")
    p.add_argument("--skip-generate", action="store_true", help="measure the engine only")
    p.add_argument(
        "--engine", choices=["embedded", "sglang", "both"], default="embedded",
        help="which engine(s): both = the embedded engine, then stock SGLang (needs sglang installed)",
    )  # fmt: skip
    p.add_argument("--logprobs", action="store_true", help="ask every request for its output log-probs (RL)")
    p.add_argument(
        "--logprob-wire", choices=["triples", "packed"], default="packed",
        help="with --logprobs, how the embedded engine answers them: SGLang's [logprob, id, text] triples, or hpcrl's "
             "packed float64 column (return_logprob_packed; what hpcrl's engine client asks it for). SGLang: triples",
    )  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                   help="K/V cache storage of every engine measured (--kv-cache-dtype of both)")  # fmt: skip
    p.add_argument("--sglang-arg", action="append", default=[], help="an extra SGLang launch argument (repeat)")
    p.add_argument("--sglang-mem-fraction", type=float, default=0.5, help="SGLang --mem-fraction-static")
    p.add_argument("--engine-env", action="append", default=[], help="KEY=VALUE for the engine process (repeat)")
    p.add_argument(
        "--engine-arg", action="append", default=[],
        help="an extra `hpcrl engine serve` argument of the embedded engine (repeat), e.g. "
             "--engine-arg=--decode-profile or --engine-arg=--kernels-attn-config=64,8,3,1",
    )  # fmt: skip
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="the embedded engine's prefill chunk (default: every prompt in one forward; the engine's own "
                        "default is 4096)")  # fmt: skip
    p.add_argument("--workdir", default=None, help="where models and the engine log go (default: a temp dir)")
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    ns = p.parse_args(argv)

    workdir = Path(ns.workdir or tempfile.mkdtemp(prefix="hpcrl-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = _prepare_model(ns, workdir)
    from hpcrl.model.qwen3 import ModelArgs

    vocab = ModelArgs.from_dir(model_dir).vocab_size
    prompts = _prompts(ns, vocab)
    config = (
        f"{model_dir.name} {ns.device}/{ns.dtype} {ns.num_seqs} seqs x {ns.max_new_tokens} new tokens "
        f"(prompt {ns.prompt_len}), threads={ns.threads or 'default'}, client={ns.client}, "
        f"logprobs={_logprobs_text(ns)}, kv_cache={ns.kv_cache_dtype}"
    )
    print(f"config: {config}", flush=True)
    results: dict[str, Any] = {"config": config, "argv": sys.argv[1:]}
    kinds = ["embedded", "sglang"] if ns.engine == "both" else [ns.engine]
    for kind in kinds:
        key = "engine" if kind == "embedded" else kind
        results.update(run_engine(ns, model_dir, prompts, workdir, kind=kind))
        print(
            f"{key}: {results[f'{key}_tok_s']:.0f} tok/s ({results[f'{key}_tokens']} tokens in "
            f"{results[f'{key}_s']:.2f} s, median of {ns.timed_runs}: "
            f"{', '.join(f'{x:.0f}' for x in results[f'{key}_timed_passes_tok_s'])}; "
            f"first pass {results[f'{key}_first_pass_tok_s']:.0f} tok/s; started in {results[f'{key}_startup_s']:.0f} s"
            + (
                f"; decode path {results['engine_decode_path']}, PDL {results['engine_pdl']})"
                if kind == "embedded"
                else ")"
            ),
            flush=True,
        )
        wire = results[f"{key}_logprob_wire"]
        print(
            f"{key} median pass (log-probs: {wire or 'none'}): {results[f'{key}_s']:.3f} s = in the engine "
            f"{results[f'{key}_pass_server_s']:.3f} s "
            f"(arrival -> last token) + client parse {_seconds(results[f'{key}_pass_parse_s'])} + rest "
            f"{results[f'{key}_pass_rest_s']:.3f} s (sending, the engine's answer, the transfer); then hpcrl's client "
            f"would check it in {results[f'{key}_client_check_s']:.3f} s (not in the pass)",
            flush=True,
        )
        if results.get(f"{key}_profile"):
            print(f"{key} profile: " + json.dumps(results[f"{key}_profile"]), flush=True)
        if results.get(f"{key}_profile_timed"):
            print(f"{key} profile, timed passes only: " + json.dumps(results[f"{key}_profile_timed"]), flush=True)
    if ns.engine == "both":
        results["embedded_over_sglang"] = results["engine_tok_s"] / results["sglang_tok_s"]
        print(f"embedded / sglang: {results['embedded_over_sglang']:.2f}x", flush=True)
    if not ns.skip_generate:
        results.update(run_generate(ns, model_dir, prompts))
        passes = ", ".join(f"{x:.0f}" for x in results["generate_timed_passes_tok_s"])
        print(
            f"generate: {results['generate_tok_s']:.0f} tok/s ({results['generate_s']:.2f} s; passes {passes})",
            flush=True,
        )
        results["ratio"] = results["engine_tok_s"] / results["generate_tok_s"]
    try:
        import torch

        results["torch"] = torch.__version__
        if ns.device.startswith("cuda"):
            results["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - versions are informative only
        pass
    gen_s = f"{results['generate_tok_s']:.0f}" if "ratio" in results else "-"
    ratio_s = f"{results['ratio']:.2f}x" if "ratio" in results else "-"
    first = "engine" if "engine_tok_s" in results else "sglang"
    sg_s = f"{results['sglang_tok_s']:.0f}" if "sglang_tok_s" in results else "-"
    print()
    print("| embedded tok/s | sglang tok/s | generate tok/s | embedded/generate | config |")
    print("|---:|---:|---:|---:|---|")
    emb_s = f"{results['engine_tok_s']:.0f}" if first == "engine" else "-"
    print(f"| {emb_s} | {sg_s} | {gen_s} | {ratio_s} | {config} |")
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
