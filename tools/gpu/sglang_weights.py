"""Stock SGLang on the GPU: hpcrl's weight payload and the memory-rental cycle, against a server started
on the pushed weights. Run on the GPU machine after `source .sglang/activate.sh ...`:

  python3 tools/gpu/sglang_weights.py --workdir /tmp/sgw --out $OUT

Two servers start at once (start-up is 130-150 s each): A on a tiny model, with --enable-memory-saver;
B on the same model with every weight perturbed (W'). Then on A:
  1. release kv_cache + weights, resume both, generate: the weights read as zeros (log-probs -log V)?
  2. release kv_cache + weights (NVML bytes freed per tag), resume weights, push W' through
     hpcrl.sync.tensor_handover (SGLang's flattened bucket, made without sglang), resume kv_cache,
     generate: must equal B's generation token for token (greedy and seeded sampling).
  3. a request that lives through pause(retract) + update_weight_version + continue: what it reports.
  4. sampling supports (return_sampling_mask with top-k/top-p): the field names 0.5.16 answers with.
Writes sglang_weights.json (every figure and raw answer) to --out and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hpcrl.engine.client import EngineClient  # noqa: E402
from hpcrl.sync.tensor_handover import tensor_update_request  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]


def nvml_used() -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)


def launch(model: Path, port: int, log: Path, *, memory_saver: bool) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port),
        "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
        "--skip-server-warmup", "--mem-fraction-static", "0.5", "--max-total-tokens", "65536",
        "--dtype", "bfloat16", "--random-seed", "0",
        "--disable-cuda-graph", "--max-running-requests", "64",
    ]  # fmt: skip
    if memory_saver:
        cmd.append("--enable-memory-saver")
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_up(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 420) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"server {url} exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"server {url} not up in {timeout_s} s:\n{log.read_text()[-4000:]}")


def generate(url: str, *, greedy: bool, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    body: dict[str, Any] = {
        "input_ids": PROMPTS,
        "sampling_params": [
            {"max_new_tokens": 24, "temperature": 0.0 if greedy else 1.0, "ignore_eos": True, "sampling_seed": 7 + i}
            for i in range(len(PROMPTS))
        ],
        "return_logprob": True,
        **(extra or {}),
    }
    r = httpx.post(url + "/generate", json=body, timeout=120)
    r.raise_for_status()
    return list(r.json())


def tokens(answers: list[dict[str, Any]]) -> list[list[int]]:
    return [[int(t[1]) for t in a["meta_info"]["output_token_logprobs"]] for a in answers]


def logprobs(answers: list[dict[str, Any]]) -> list[list[float]]:
    return [[float(t[0]) for t in a["meta_info"]["output_token_logprobs"]] for a in answers]


def perturbed_copy(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    out = {
        k: (v + 0.05 * v.float().std().clamp_min(1e-3) * torch.randn(v.shape, generator=gen)).to(v.dtype)
        if v.is_floating_point()
        else v
        for k, v in tensors.items()
    }
    save_file(out, str(dst / "model.safetensors"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/sgw"))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/sgw-out")))
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model_a, model_b = args.workdir / "tiny-a", args.workdir / "tiny-b"
    if not (model_a / "config.json").exists():
        subprocess.run([sys.executable, "-m", "hpcrl.cli", "model", "init-tiny", str(model_a)], check=True)
    pushed = perturbed_copy(model_a, model_b)
    report: dict[str, Any] = {}
    url_a, url_b = "http://127.0.0.1:31001", "http://127.0.0.1:31002"
    log_a, log_b = args.workdir / "sglang_a.log", args.workdir / "sglang_b.log"
    proc_a = launch(model_a, 31001, log_a, memory_saver=True)
    proc_b = launch(model_b, 31002, log_b, memory_saver=False)
    ok = True
    try:
        report["startup_s"] = {"a": wait_up(url_a, proc_a, log_a), "b": wait_up(url_b, proc_b, log_b)}
        print("up", report["startup_s"], flush=True)
        client = EngineClient(url_a, timeout_s=120)
        vocab = int(json.loads((model_a / "config.json").read_text())["vocab_size"])
        before = generate(url_a, greedy=True)
        report["generate_raw"] = before[:2]

        # 1. release + resume without a push: are the weights zeros?
        client.release_memory_occupation(["kv_cache"])
        client.release_memory_occupation(["weights"])
        client.resume_memory_occupation(["weights"])
        client.resume_memory_occupation(["kv_cache"])
        lp = logprobs(generate(url_a, greedy=True))
        mean_lp = sum(map(sum, lp)) / sum(map(len, lp))
        report["after_resume_without_push"] = {"mean_logprob": mean_lp, "minus_log_vocab": -math.log(vocab)}
        print("after resume without push: mean log-prob", mean_lp, "-log V", -math.log(vocab), flush=True)

        # 2. the rental cycle hpcrl runs every step, with the push of W'
        cycle: dict[str, float] = {}
        for tag in ("kv_cache", "weights"):
            u0, t0 = nvml_used(), time.perf_counter()
            client.release_memory_occupation([tag])
            cycle[f"release_{tag}_s"], cycle[f"freed_{tag}_bytes"] = time.perf_counter() - t0, u0 - nvml_used()
        t0 = time.perf_counter()
        client.resume_memory_occupation(["weights"])
        cycle["resume_weights_s"] = time.perf_counter() - t0
        named = [(k, v.to("cuda", torch.bfloat16)) for k, v in pushed.items()]
        t0 = time.perf_counter()
        with tensor_update_request(named, engine_kind="sglang") as request:
            reply = client.update_weights_from_tensor(request)
        cycle["push_s"] = time.perf_counter() - t0
        client.update_weight_version(1, abort_all_requests=False)
        t0 = time.perf_counter()
        client.resume_memory_occupation(["kv_cache"])
        cycle["resume_kv_cache_s"] = time.perf_counter() - t0
        report["cycle"] = cycle | {"push_reply": reply, "version": client.weight_version()}
        print("cycle", report["cycle"], flush=True)
        for greedy in (True, False):
            got, want = generate(url_a, greedy=greedy), generate(url_b, greedy=greedy)
            same = tokens(got) == tokens(want)
            diff = max(
                abs(a - b)
                for x, y in zip(logprobs(got), logprobs(want), strict=True)
                for a, b in zip(x, y, strict=True)
            )
            key = "greedy" if greedy else "seeded"
            report[f"pushed_equals_fresh_{key}"] = {"tokens_equal": same, "max_abs_logprob_diff": diff}
            print(f"pushed == fresh server ({key}): tokens {same}, max |dlogprob| {diff:.3g}", flush=True)
            ok &= same

        # 2b. the disaggregated path, on one GPU: hpcrl's WeightSync over a gloo group (NCCL refuses two ranks
        # on one device): init_weights_update_group + update_weights_from_distributed with flattened buckets,
        # pushing the original weights W back; A must then generate what it generated on W at the start.
        from hpcrl.sync.config import SyncConfig
        from hpcrl.sync.push import WeightSync

        sync = WeightSync(
            SyncConfig(transport="distributed", master_address="127.0.0.1", group_timeout_s=120),
            [client], device=torch.device("cpu"), engine_kind="sglang",
        )  # fmt: skip
        from safetensors.torch import load_file

        original = [(k, v.to(torch.bfloat16)) for k, v in load_file(str(model_a / "model.safetensors")).items()]
        t0 = time.perf_counter()
        sync.connect()
        connect_s = time.perf_counter() - t0
        dist_metrics = sync.push(original, 3)
        again = generate(url_a, greedy=True)
        same = tokens(again) == tokens(before)
        diff = max(
            abs(a - b)
            for x, y in zip(logprobs(again), logprobs(before), strict=True)
            for a, b in zip(x, y, strict=True)
        )
        report["distributed_push_restores_original"] = {
            "tokens_equal": same, "max_abs_logprob_diff": diff, "connect_s": connect_s, **dist_metrics,
        }  # fmt: skip
        print(
            f"distributed (gloo, flattened) push of W == A's first generation: tokens {same}, |dlp| {diff:.3g}",
            flush=True,
        )
        ok &= same
        sync.close()

        # 3. a request that lives through a version update
        result: dict[str, Any] = {}

        def long_request() -> None:
            body = {"input_ids": PROMPTS[0], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True}}  # fmt: skip
            result["answer"] = httpx.post(url_a + "/generate", json=body, timeout=300).json()

        cfg_a = json.loads((model_a / "config.json").read_text())
        max_new = int(cfg_a["max_position_embeddings"]) - len(PROMPTS[0]) - 8

        th = threading.Thread(target=long_request)
        th.start()
        time.sleep(0.05)
        client.pause_generation("retract")
        client.update_weight_version(4, abort_all_requests=False)
        client.continue_generation()
        th.join()
        report["lives_through_update_raw"] = {k: v for k, v in result["answer"].items() if k != "output_ids"}
        meta = result["answer"].get("meta_info", {})
        report["lives_through_update"] = {k: v for k, v in meta.items() if "logprob" not in k}
        print("lives through update:", report["lives_through_update"], flush=True)

        # 4. sampling supports
        sup = httpx.post(
            url_a + "/generate",
            json={"input_ids": PROMPTS[1], "return_logprob": True, "return_sampling_mask": True,
                  "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_k": 5, "top_p": 0.9}},
            timeout=60,
        )  # fmt: skip
        report["supports"] = {"status": sup.status_code, "meta_keys": sorted(sup.json().get("meta_info", {}))}
        report["supports_raw"] = sup.json()
        print("supports:", report["supports"], flush=True)
    finally:
        for proc in (proc_a, proc_b):
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
        (args.out / "sglang_weights.json").write_text(json.dumps(report, indent=1, default=str))
    print("RESULT", "ok" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
