"""Disk-delta weight versions for a stock SGLang server: an agent on the engine's node keeps a copy of the weights,
patches it with each version the trainer writes (hpcrl/weightwire/delta.py) and has SGLang load the result.

SGLang reads no hpcrl delta. Per version the agent:
  1. brings its copy (CPU tensors, the model's dtype) to the version, strictly in order and checksum by checksum,
     with the embedded engine's own loader (hpcrl/engine/embedded/delta_load.py: a corrupt delta is never applied,
     a gap or a broken apply rebuilds from the newest snapshot);
  2. hands it to SGLang, in one of two ways (`mode`):
     "disk"    the copy as a safetensors model directory on a node-local path (config and tokenizer files linked
               from the model directory), loaded by stock SGLang's `POST /update_weights_from_disk`
               {model_path, load_format, weight_version, abort_all_requests, flush_cache}; SGLang answers
               {success, message, num_paused_requests} and keeps its old weights when it fails;
     "tensor"  the tensors whose bits changed, through `POST /update_weights_from_tensor` (CUDA IPC, as the tensor
               transport's handover), then `/update_weight_version`.
It runs in the agent process beside its server (hpcrl/sync/delta_agent_server.py), which calls `load` once per
`POST /apply`: the trainer's DiskDeltaTransport asks after the manifest is written (the push has paused the engine),
a joining engine's catch-up before it serves. Given a nonce, it checks at start that it sees the trainer's weight
directory (its probe).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import torch

from hpcrl.engine.client import EngineClient
from hpcrl.engine.contract import Endpoint, Reply, Retry
from hpcrl.engine.embedded.delta_load import DeltaLoader
from hpcrl.weightwire.delta import check_probe, read_manifest

MODES = ("disk", "tensor")
Mode = Literal["disk", "tensor"]
WEIGHTS_FILE = "model.safetensors"
UPDATE_WEIGHTS_FROM_DISK = Endpoint(
    "update_weights_from_disk", "POST", ("/update_weights_from_disk",), Retry.NEVER, Reply.SUCCESS
)
"""Stock SGLang's reload of the weights from a model directory (not part of what the fleet calls: agents only)."""


class DeltaAgentError(RuntimeError):
    """SGLang did not take a version (its answer is in the message)."""


def load_model_copy(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the model directory's safetensors files, on the CPU, in `dtype` (the engine's)."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise DeltaAgentError(f"{model_dir} holds no .safetensors file to keep a copy of")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in load_file(str(path)).items():
            out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


class SglangDeltaAgent:
    """One SGLang server's agent: `load(manifest, version)` per push."""

    def __init__(
        self,
        client: EngineClient,
        *,
        model_dir: Path,
        local_dir: Path,
        dtype: torch.dtype = torch.bfloat16,
        mode: Mode = "disk",
        tp_size: int = 1,
        timeout_s: float = 600.0,
        weights_dir: Path | None = None,
        probe_nonce: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if weights_dir is not None and probe_nonce:
            check_probe(weights_dir, probe_nonce)  # this node must see the trainer's weight directory
        self.client, self.mode, self.tp_size, self.timeout_s = client, mode, tp_size, timeout_s
        self.model_dir, self.local_dir = model_dir, local_dir
        self.params = load_model_copy(model_dir, dtype)
        self.loader = DeltaLoader()
        self.loaded: Path | None = None  # the directory SGLang serves from now (mode disk)
        local_dir.mkdir(parents=True, exist_ok=True)

    def load(self, manifest: Path, version: str | None = None) -> dict[str, Any]:
        """Bring SGLang to the version of `manifest`: {"version", "applied", "bytes", "seconds", "patch_s",
        "handover_s"} (seconds: the whole call; patch_s: the copy's; handover_s: SGLang's load)."""
        t0 = time.perf_counter()
        before = self.loader.applied
        done = self.loader.load(self.params, manifest)
        patch_s = time.perf_counter() - t0
        stamp = version if version is not None else str(done["version"])
        t1 = time.perf_counter()
        if self.mode == "disk":
            self._load_from_disk(int(done["version"]), stamp)
        else:
            self._load_tensors(manifest.parent, done["applied"], full=before is None, version=stamp)
        handover_s = time.perf_counter() - t1
        return {**done, "seconds": time.perf_counter() - t0, "patch_s": patch_s, "handover_s": handover_s}

    def _post(self, endpoint: Endpoint, body: dict[str, Any]) -> None:
        try:
            self.client.call(endpoint, body, timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the engine's answer, with what the agent asked for
            raise DeltaAgentError(f"{self.client.url} did not take the weights ({endpoint}): {exc}") from exc

    def _load_from_disk(self, version: int, stamp: str) -> None:
        target = self.local_dir / f"v{version:08d}"
        tmp = self.local_dir / f".v{version:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for entry in self.model_dir.iterdir():  # config, tokenizer, generation config: SGLang reads them too
            if entry.is_file() and entry.suffix != ".safetensors" and not entry.name.endswith(".index.json"):
                os.symlink(entry.absolute(), tmp / entry.name)
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in self.params.items()}, str(tmp / WEIGHTS_FILE))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        body = {
            "model_path": str(target), "load_format": "safetensors", "weight_version": stamp,
            "abort_all_requests": False, "flush_cache": True,
        }  # fmt: skip
        self._post(UPDATE_WEIGHTS_FROM_DISK, body)
        previous, self.loaded = self.loaded, target
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)  # SGLang holds the new weights: the old copy can go

    def _load_tensors(self, directory: Path, applied: list[str], *, full: bool, version: str) -> None:
        from hpcrl.sync.tensor_handover import tensor_update_request

        if full or any(name.startswith("snapshot") for name in applied):
            names = list(self.params)
        else:
            changed: set[str] = set()
            for name in applied:
                changed |= {t.name for t in read_manifest(directory / name).tensors if t.encoding != "same"}
            names = [n for n in self.params if n in changed]
        if names:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            bucket = [(n, self.params[n].to(device)) for n in names]
            with tensor_update_request(bucket, engine_kind="sglang", tp_size=self.tp_size) as req:
                self.client.update_weights_from_tensor(req, timeout_s=self.timeout_s)
        self.client.update_weight_version(int(version), abort_all_requests=False, timeout_s=self.timeout_s)

    def close(self) -> None:
        if self.loaded is not None:
            shutil.rmtree(self.loaded, ignore_errors=True)
            self.loaded = None
