"""Typed requests and responses of the SGLang HTTP contract (see docs/sglang-contract.md).

- `fields.py`: the field checks every type shares, and `Message`, the base of a request body;
- `requests.py`: `SamplingParams` and `GenerateRequest`, the /generate request;
- `answers.py`: `GenerateResult` and the /generate answer, both ways (parse and write, packed log-probs);
- `control.py`: the bodies of the weight-update, pause, abort and memory endpoints.

One module serves both ends: `EngineClient` builds requests with `to_dict()` and parses responses with
`GenerateResult.from_response`; the embedded engine server validates incoming JSON with `from_dict()` and
answers with `GenerateResult.to_response()`. Every validation error is a `ValueError` whose message names
the field, the allowed values and what was received, because the server returns it verbatim as HTTP 400.

Where engines name the same field differently, `contract.py` holds the table (`META_INFO_ALIASES`): readers
accept every name, writers send SGLang 0.5.16's. With `return_sampling_mask` that is
`output_token_sampling_mask` (per output token, the token ids of the sampling support after top-k/top-p/min-p),
`output_token_sampling_logprobs` (per output token, the log-prob renormalised over that support) and
`output_token_sampling_mask_length` (the number of output tokens those lists cover).

hpcrl's extensions to `meta_info` (absent from upstream SGLang, so every reader treats them as optional):
`weight_versions`: `[{"version": str, "start": int, "end": int}, ...]` half-open spans `[start, end)` over
output-token indices saying which weight version produced each token (weights can change mid-request).
`output_token_logprobs_packed`: with the request's `return_logprob_packed` (hpcrl's engine client sets it only
for an engine whose /server_info lists "packed" under `logprob_wire`), the log-probs as base64 of little-endian
float64, one per `output_ids` entry, instead of the `output_token_logprobs` triples: a 256 x 512 answer's 131k
`[logprob, id, text]` triples cost ~0.14 s a pass to write, move and parse on the H200's host, and a decimal
round trip per float. `from_response` reads either form into the same `output_token_logprobs` list.
"""
