"""A TCP proxy on 127.0.0.1 whose connections a test can cut at any moment.

Clients pointed at it reach ``upstream`` byte for byte; ``cut()`` resets every
connection open at that moment (an RST to the client, as when a server dies between
receiving a request and answering it), and the next connection goes through again.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class CuttingProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._closed = False
        self.cuts = 0
        self._acceptor = threading.Thread(target=self._accept, name="cut-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> CuttingProxy:
        self._acceptor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()
        self._acceptor.join(timeout=5)

    def cut(self) -> int:
        """Reset every open connection; how many there were."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self.cuts += 1
        for pair in pairs:
            for sock in pair:
                _reset(sock)
        return len(pairs)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _reset(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._pairs.append((client, server))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    _reset(dst)


def _reset(sock: socket.socket) -> None:
    """Break the connection at once: an abortive close (RST), after a shutdown that
    wakes the pump thread blocked reading it (a close alone would not)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
