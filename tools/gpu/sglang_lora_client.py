"""SGLang's own LoRA serving (0.5.16): adapters loaded from a peft directory under a name, named per request.

A server started with `--enable-lora --max-lora-rank R --lora-target-modules all --max-loras-per-batch N` loads an
adapter with POST /load_lora_adapter {lora_name, lora_path} (the directory `hpcrl`'s export writes as
`model/adapter`, or `write_peft_adapter`), serves it to a /generate that names it in `lora_path`, and drops it with
POST /unload_lora_adapter {lora_name}; both answer {success, error_message, loaded_adapters} (400 on failure).

A run does not serve its adapters this way: SGLang computes W x + B' (A x) with its own LoRA kernels, which is not
the merged W + B' A the trainer scores with, so a run pushes the merged weights (docs/lora.md says why, with the
figures of tools/gpu/lora_gpu.py). This client is what that script measures, and what
tests/unit/test_sglang_lora_golden.py replays tools/gpu/record_sglang_lora.py's recording through.
"""

from __future__ import annotations

from typing import Any

import httpx

from hpcrl.engine.errors import EngineRequestError

LORA_SERVER_ARGS = ("--enable-lora", "--lora-target-modules", "all")
"""The launch flags of a server that loads adapters (with `--max-lora-rank R` and `--max-loras-per-batch N`)."""


class SGLangAdapters:
    """Load, unload and use named adapters on one SGLang server."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, trust_env=False)

    def close(self) -> None:
        self.http.close()

    def load(self, name: str, path: str) -> list[str]:
        """Load the peft adapter directory `path` as `name`; the names loaded after it."""
        return self._update("/load_lora_adapter", {"lora_name": name, "lora_path": path}, f"load {name!r}")

    def unload(self, name: str) -> list[str]:
        """Drop the adapter `name` (once the requests that use it finish); the names still loaded. Not final: a later
        /generate that names it has SGLang 0.5.16 load it again from the directory it was loaded from (recorded)."""
        return self._update("/unload_lora_adapter", {"lora_name": name}, f"unload {name!r}")

    def generate(
        self, input_ids: list[int], adapter: str | None, *, max_new_tokens: int, seed: int = 0, temperature: float = 1.0
    ) -> tuple[list[int], list[float]]:
        """Sample with the adapter `adapter` (None: the base model): the output ids and their log-probs."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature, "sampling_seed": seed},
            "return_logprob": True,
            "lora_path": adapter,
        }
        response = self.http.post("/generate", json=body)
        data = self._json(response, "generate")
        if response.status_code != 200 or not isinstance(data, dict) or "meta_info" not in data:
            raise EngineRequestError(
                f"POST /generate with lora_path {adapter!r} failed: {_message(data)}",
                url=self.url,
                status_code=response.status_code,
            )
        triples = data["meta_info"].get("output_token_logprobs") or []
        return [int(t[1]) for t in triples], [float(t[0]) for t in triples]

    def _update(self, path: str, body: dict[str, Any], what: str) -> list[str]:
        response = self.http.post(path, json=body)
        data = self._json(response, what)
        if response.status_code != 200 or not isinstance(data, dict) or not data.get("success"):
            raise EngineRequestError(
                f"SGLang refused to {what}: {_message(data)}", url=self.url, status_code=response.status_code
            )
        return sorted(data.get("loaded_adapters") or {})

    def _json(self, response: httpx.Response, what: str) -> Any:
        try:
            return response.json()
        except ValueError:
            raise EngineRequestError(
                f"{what}: the server answered HTTP {response.status_code} without JSON: {response.text[:200]!r}",
                url=self.url,
                status_code=response.status_code,
            ) from None


def _message(data: Any) -> str:
    """The server's own words: {error_message} of a LoRA update, {error: {message}} or {message} of the rest."""
    if isinstance(data, dict):
        error = data.get("error")
        for text in (data.get("error_message"), error.get("message") if isinstance(error, dict) else error,
                     data.get("message")):  # fmt: skip
            if text:
                return str(text)
    return repr(data)[:300]
