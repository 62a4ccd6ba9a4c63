"""A trainer's callback endpoint on 127.0.0.1 that answers every POST with one status."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@contextmanager
def callback_receiver(monkeypatch: pytest.MonkeyPatch, status: int, secret: str = "k",
                      on_post: Callable[[dict[str, Any]], None] | None = None
                      ) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """``(url, bodies)``: the URL to call back, allowed with ``secret`` and one attempt per callback.

    Each POST's JSON body is appended to ``bodies`` and handed to ``on_post`` before the answer.
    """
    bodies: list[dict[str, Any]] = []

    class Answer(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            if on_post is not None:
                on_post(body)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", secret)
    monkeypatch.setenv("EVALFLEET_ALLOWED_HOSTS", f"127.0.0.1:{port}")
    monkeypatch.setenv("EVALFLEET_CALLBACK_ATTEMPTS", "1")
    try:
        yield f"http://127.0.0.1:{port}/cb", bodies
    finally:
        server.shutdown()
        server.server_close()
