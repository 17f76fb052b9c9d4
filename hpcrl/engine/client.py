"""HTTP client for one rollout engine speaking the SGLang contract (real SGLang or hpcrl's embedded engine).

The contract is data (`contract.py`: each endpoint's method, paths, retry rule and reply shape): `call` sends
any endpoint; the typed methods below are thin helpers over it.

Failure model (why the retry rules differ per call):
- A connection that could not be established means the request never left this process, so any call may be
  re-sent; after the retries the engine is reported dead (`EngineUnreachableError`), quickly.
- Calls that are safe to repeat (reads, health, flush, pause/continue, abort, version stamps) are also re-sent
  when the engine answers 503 (starting, overloaded) or drops the connection mid-request.
- `generate` is not re-sent once it may have reached the engine: a duplicate would burn engine time and
  could return a sample the caller did not ask for twice.
- Weight-update calls are never re-sent: each pairs with collectives on the trainer side, and a second call
  would wait for broadcasts that never come.
Every call is bounded by a timeout; no loop retries forever.

Log-probs travel as SGLang's `[logprob, token_id, text]` triples, except from an engine whose /server_info lists
"packed" under `logprob_wire` (hpcrl's embedded engine): there `generate_request` asks for them packed
(`return_logprob_packed`, one base64 column of float64), which saves writing, moving and parsing 131k triples per
256 x 512 batch. The client asks /server_info at its first /generate with log-probs and keeps the answer; a packed
request that fails makes it ask again (another engine may answer at the URL now). Stock SGLang never sees the
field: it refuses keys it does not know.

The client is composed by role: `client_transport.py` (one call with its retry rule, the connections),
`client_generate.py` (/generate and the log-prob wire), `client_control.py` (cache, abort, pause, memory, weight
updates) and `client_status.py` (health, readiness, identity); the failures are in `errors.py`.
"""

from __future__ import annotations

from hpcrl.engine.client_control import ControlCalls
from hpcrl.engine.client_generate import GenerateCalls
from hpcrl.engine.client_status import StatusCalls

__all__ = ["EngineClient"]


class EngineClient(GenerateCalls, ControlCalls, StatusCalls):
    """Synchronous client of one engine, safe to share between threads (each call borrows a connection of its own).

    `timeout_s` bounds each wait for the engine's bytes (for a non-streaming call, the whole answer);
    `connect_timeout_s` bounds establishing a connection, kept short so that a dead engine shows quickly.
    Every method takes `timeout_s=` to override the default for that call.
    """
