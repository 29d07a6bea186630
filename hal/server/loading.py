"""The port while the engine loads: taken first (a taken port fails before anything loads),
then answered at once, every request a 503 with ``Retry-After`` (vLLM's readiness
semantics: ``GET /health`` is ``{"status": "loading"}``), until uvicorn takes the socket over.
Nothing a client sends is read past its first line."""

from __future__ import annotations

import json
import socket
import threading

LOADING = "the server is starting: loading the model"


def _reply(path: str) -> bytes:
    body = {"status": "loading", "reason": LOADING} if path == "/health" else \
        {"error": {"message": LOADING, "type": "service_unavailable", "param": None, "code": None}}
    data = json.dumps(body).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


class LoadingResponder:
    """Listens on ``sock`` and answers 503 in a thread of its own until `stop`."""

    def __init__(self, sock: socket.socket):
        self.sock, self._stop = sock, threading.Event()
        sock.listen(128)
        sock.settimeout(0.05)   # the accept loop notices `stop` within this
        self.thread = threading.Thread(target=self._run, name="hal-loading", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return   # the socket was closed
            with conn:
                try:
                    conn.settimeout(1.0)
                    line = conn.recv(4096).split(b"\r\n", 1)[0].split()
                    path = line[1].decode("latin-1").split("?")[0] if len(line) > 1 else ""
                    conn.sendall(_reply(path))
                except OSError:
                    pass   # the client went away, or sent nothing in time

    def stop(self) -> None:
        """Stop answering; the socket is left listening (blocking) for the real server."""
        self._stop.set()
        self.thread.join(5)
        self.sock.settimeout(None)
