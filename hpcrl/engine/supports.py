"""The sampling supports of an engine's answer, checked before anything trains on them (docs/sampling-replay.md)."""

from __future__ import annotations

from hpcrl.engine.errors import EngineRequestError
from hpcrl.engine.protocol.answers import GenerateResult
from hpcrl.samples.support import TokenSupports


def checked_supports(r: GenerateResult, url: str) -> TokenSupports:
    """A result's sampling supports; refused when it cannot be replayed: no supports (an engine without
    return_sampling_mask), or a support without its sampled token (the trainer would score an impossible one)."""
    if r.sampling_mask is None or r.support_logprobs is None:
        raise EngineRequestError(
            f"the engine answered request {r.rid!r} without meta_info.output_token_sampling_mask / "
            "output_token_sampling_logprobs although it asked return_sampling_mask; top-k/top-p replay needs an "
            "engine that returns sampling supports (hpcrl's embedded engine, SGLang 0.5.16)",
            url=url,
        )
    supports = TokenSupports.from_lists(r.sampling_mask)
    try:
        supports.check_tokens(r.output_ids, where=f"request {r.rid!r}")
    except ValueError as exc:
        raise EngineRequestError(str(exc), url=url) from None
    return supports
