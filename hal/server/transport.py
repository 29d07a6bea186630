"""The server's transport: the request body read with its bound (`read_body`), the listening
socket taken before anything loads (`bind`), and uvicorn's server with the engine's graceful
SIGTERM (`uvicorn_server`)."""

from __future__ import annotations

import errno
import socket
import sys
import threading

from hal.errors import HalError
from hal.server.openai_schema import ApiError

SHUTDOWN_GRACE = 30.0   # seconds past --shutdown-timeout before uvicorn cancels what is left (never, normally)
MAX_BODY = 8 << 20   # bytes: far above any prompt within --max-model-len; a bigger body is refused unread


async def read_body(request) -> bytes:
    """The request body, refused with 413 past `MAX_BODY` (declared or streamed)."""
    n = request.headers.get("content-length")
    if n is not None and (not n.isdigit() or int(n) > MAX_BODY):
        raise ApiError(f"body: expected at most {MAX_BODY} bytes, got {n}", "body", 413)
    from starlette.requests import ClientDisconnect
    chunks, size = [], 0
    try:
        async for c in request.stream():
            size += len(c)
            if size > MAX_BODY:
                raise ApiError(f"body: expected at most {MAX_BODY} bytes, got more", "body", 413)
            chunks.append(c)
    except ClientDisconnect:   # one line, not a traceback: any client can do this
        print(f"spec-hal serve: a client disconnected after {size} of {n or 'unknown'} body bytes",
              file=sys.stderr, flush=True)
        raise ApiError(f"body: expected {n or 'the whole'} bytes, got {size} before the client disconnected",
                       "body") from None
    return b"".join(chunks)


def bind(host: str, port: int) -> socket.socket:
    """The listening address, taken before anything loads: `HalError` naming ``--port`` when
    another process holds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    except (socket.gaierror, UnicodeError) as e:
        raise HalError(f"--host: expected an address or a host name of this machine, got {host!r} "
                       f"({getattr(e, 'strerror', None) or e})", arg="host") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise HalError(f"--port: expected a free port on {host}, got {port}, which is in use ({e.strerror})",
                           arg="port") from None
        raise HalError(f"--host: expected an address of this machine to listen on, got {host!r} ({e.strerror})",
                       arg="host") from None
    return sock


def uvicorn_server(app, sock: socket.socket, shutdown_timeout: float):
    """uvicorn's server, with SIGTERM first telling the engine to stop accepting and to cut
    what still runs at ``shutdown_timeout`` (streams then end with ``finish_reason: "abort"``
    and ``[DONE]``; non-streaming requests get 503), well before uvicorn would cancel them."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """Stop accepting (new requests get 503 JSON while the port stays open), and
            let uvicorn go once what is in flight has ended; a second signal stops at once."""
            loop = app.state.loop
            if loop.closing:
                return super().handle_exit(sig, frame)
            loop.close(shutdown_timeout)
            threading.Thread(target=self._exit_when_drained, args=(sig, frame), name="hal-drain",
                             daemon=True).start()

        async def on_tick(self, counter: int) -> bool:
            """Also stop when the engine has failed (no request in flight is served any more):
            `hal.server.app.main` then exits non-zero, so an orchestrator restarts it."""
            if app.state.loop.failed:
                self.should_exit = True
            return await super().on_tick(counter)

        def _exit_when_drained(self, sig, frame) -> None:
            app.state.loop.wait_drained(shutdown_timeout + SHUTDOWN_GRACE)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=int(shutdown_timeout + SHUTDOWN_GRACE))
    return Server(config)
