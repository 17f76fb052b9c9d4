"""A stand-in for `python -m sglang.launch_server` that starts the way a real 0.5.16 server does: its port
silent for STANDIN_SILENT_S seconds (a real one takes 130-150 s on an H200), then /health answers 200.
It serves nothing else. It records its command line and environment so that tests can check what the
launcher gave it. Only the launcher's start-up handling is under test; the contract is checked against
answers recorded from a real server (tests/golden/).
"""

from __future__ import annotations

import http.server
import json
import os
import sys
import time


def main() -> None:
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    record = os.environ.get("STANDIN_RECORD")
    if record:
        with open(record, "w") as f:
            json.dump({"argv": args, "env": dict(os.environ)}, f)
    print("stand-in sglang: loading (port silent)", flush=True)
    time.sleep(float(os.environ.get("STANDIN_SILENT_S", "0")))
    if os.environ.get("STANDIN_EXIT_CODE"):
        print("stand-in sglang: failing as asked", flush=True)
        raise SystemExit(int(os.environ["STANDIN_EXIT_CODE"]))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    print("stand-in sglang: up", flush=True)
    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
