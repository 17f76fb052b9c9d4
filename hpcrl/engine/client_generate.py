"""The /generate calls of `EngineClient`, and the probe that decides whether log-probs travel packed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, cast

from hpcrl.engine import contract as C
from hpcrl.engine.client_transport import ClientTransport, logger
from hpcrl.engine.errors import (
    EngineError,
    EngineRequestError,
)
from hpcrl.engine.protocol.answers import GenerateResult
from hpcrl.engine.protocol.requests import GenerateRequest, SamplingParams

WIRE_PROBE_TIMEOUT_S = 10.0
"""The most a /generate waits for the /server_info that says whether the engine takes packed log-probs."""
WIRE_PROBE_RETRY_S = 30.0
"""After a probe that got no answer, requests go as triples for this long before the next probe."""


class GenerateCalls(ClientTransport):
    """/generate: one prompt, a prepared request, or many requests from a thread pool."""

    def generate(
        self,
        input_ids: Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | Sequence[str] | None = None,
        return_sampling_mask: bool = False,
        logprob_start_len: int = -1,
        timeout_s: float | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateResult | list[GenerateResult]:
        """POST /generate with token ids: one prompt (`list[int]`) or a batch (`list[list[int]]`).

        Returns one result for one prompt with n == 1, else a list of `batch_size * n` results, prompt-major.
        An aborted request is a result with `finish_reason.type == "abort"`, not an exception.
        """
        ids: list[int] | list[list[int]]
        if input_ids and isinstance(input_ids[0], Sequence):
            ids = [list(cast(Sequence[int], prompt)) for prompt in input_ids]
        else:
            ids = list(cast(Sequence[int], input_ids))
        params: SamplingParams | list[SamplingParams]
        if sampling_params is None:
            params = SamplingParams()
        elif isinstance(sampling_params, SamplingParams):
            params = sampling_params
        else:
            params = list(sampling_params)
        request = GenerateRequest(
            input_ids=ids,
            sampling_params=params,
            return_logprob=return_logprob,
            rid=rid if rid is None or isinstance(rid, str) else list(rid),
            return_sampling_mask=return_sampling_mask,
            logprob_start_len=logprob_start_len,
            return_routed_experts=return_routed_experts,
        )
        return self.generate_request(request, timeout_s=timeout_s)

    def generate_request(
        self, request: GenerateRequest, *, timeout_s: float | None = None
    ) -> GenerateResult | list[GenerateResult]:
        """POST /generate with a prepared request (also for `text` prompts).

        Log-probs are asked for packed when the engine speaks that wire (`speaks_packed_logprobs`) and the request
        wants no text per token; the result is the same either way. A request that sets return_logprob_packed
        itself is sent as it is.
        """
        if request.stream:
            raise ValueError("EngineClient does not stream; send the request with stream=False")
        if (
            request.return_logprob
            and not request.return_logprob_packed
            and not request.return_text_in_logprobs
            and self.speaks_packed_logprobs(timeout_s=timeout_s)
        ):
            request = dataclasses.replace(request, return_logprob_packed=True)
            try:
                parsed = self.call(C.GENERATE, request, timeout_s=timeout_s)
            except EngineRequestError:
                self._forget_wire()
                raise
        else:
            parsed = self.call(C.GENERATE, request, timeout_s=timeout_s)
        if isinstance(parsed, list) != request.returns_list or (
            isinstance(parsed, list) and len(parsed) != request.num_results
        ):
            got = f"a list of {len(parsed)}" if isinstance(parsed, list) else "one object"
            want = f"a list of {request.num_results}" if request.returns_list else "one object"
            raise EngineError(f"POST /generate: expected {want} result(s), the engine sent {got}", url=self.url)
        return cast(GenerateResult | list[GenerateResult], parsed)

    def generate_many(
        self,
        requests: Sequence[GenerateRequest],
        *,
        max_concurrency: int = 32,
        timeout_s: float | None = None,
    ) -> list[GenerateResult | list[GenerateResult]]:
        """Send requests concurrently from a thread pool; results in request order.

        The first failure cancels the requests not yet sent and is raised; requests already in flight finish.
        """
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(max_concurrency, len(requests))) as pool:
            futures: list[Future[GenerateResult | list[GenerateResult]]] = [
                pool.submit(self.generate_request, request, timeout_s=timeout_s) for request in requests
            ]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                if future in done and future.exception() is not None:
                    for other in futures:
                        other.cancel()
                    raise cast(BaseException, future.exception())
            return [future.result() for future in futures]

    def speaks_packed_logprobs(self, *, timeout_s: float | None = None) -> bool:
        """Whether the engine answers return_logprob_packed: its /server_info lists "packed" under `logprob_wire`
        (hpcrl's embedded engine does; SGLang's has no such key).

        Only an optimisation, so it never raises and never holds a request up for long: one thread asks (within
        WIRE_PROBE_TIMEOUT_S), and requests that come meanwhile, or after a probe that got no answer, go as
        triples, which every engine takes. A /server_info answer, or a 404 on it (an older server), is
        remembered; anything else (unreachable, busy, a 5xx, a malformed body) is asked again after
        WIRE_PROBE_RETRY_S.
        """
        with self._wire_lock:
            if self._packed_logprobs is not None:
                return self._packed_logprobs
            if self._wire_probing or time.monotonic() < self._wire_retry_at:
                return False
            self._wire_probing = True
        answer: bool | None = None
        try:
            probe_s = WIRE_PROBE_TIMEOUT_S if timeout_s is None else min(timeout_s, WIRE_PROBE_TIMEOUT_S)
            wires = cast(dict[str, Any], self.call(C.SERVER_INFO, timeout_s=probe_s)).get("logprob_wire")
            answer = isinstance(wires, list) and "packed" in wires
        except EngineError as exc:
            if exc.status_code == 404:
                answer = False
            else:
                logger.warning(
                    "engine %s: /server_info did not say which log-prob wires it speaks (%s); sending triples, "
                    "asking again in %.0f s",
                    self.url,
                    exc,
                    WIRE_PROBE_RETRY_S,
                )
        finally:
            with self._wire_lock:
                self._wire_probing = False
                self._packed_logprobs = answer
                if answer is None:
                    self._wire_retry_at = time.monotonic() + WIRE_PROBE_RETRY_S
        return bool(answer)

    def _forget_wire(self) -> None:
        """A packed request failed: the engine behind the URL may have changed (SGLang started where an embedded
        engine was), so the next request asks /server_info again rather than trust the remembered answer."""
        with self._wire_lock:
            self._packed_logprobs = None
            self._wire_retry_at = 0.0
