"""Test-only: a TCP port where another program answers (an HTTP reply, then close), for addresses that name a
port that is open but not a swarm peer's."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def http_port() -> Iterator[int]:
    """A port on 127.0.0.1 where a thread answers every connection with a short HTTP reply, until the block ends."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        server.close()
