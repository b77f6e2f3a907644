"""A counting HTTP proxy in front of an S3 endpoint, for tests and benchmarks: which
objects a client GETs and how often (``count``), and in all how many object GETs it
sends and how many body bytes those return (for clients without counters of their
own, such as s3fs).

    with CountingS3Proxy("http://127.0.0.1:8333") as proxy:
        ...  # point the client at proxy.endpoint
        proxy.count("/chunks/ab/abcd"), proxy.object_gets, proxy.object_get_bytes

Requests are forwarded unchanged, the Host header too, so SigV4 signatures made for the
proxy's address stay valid. A GET counts as an object GET when its path names a key
(``/BUCKET/KEY``), so bucket listings are left out. Bodies are relayed in pieces, never
held whole. It adds a hop and a copy per byte: use it for counting passes, not for the
timed ones. Listens on 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
PIECE = 1 << 20


class CountingS3Proxy:
    """Forwards to ``upstream`` (``http://HOST:PORT``). ``gets``: every GET by path,
    counted as it arrives; ``object_gets``/``object_get_bytes``: GETs of a key
    answered with success, and their body bytes, counted once answered."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream).netloc
        self.gets: Counter[str] = Counter()  # every GET, by path
        self.object_gets = 0
        self.object_get_bytes = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def count(self, suffix: str) -> int:
        """GETs of paths ending with ``suffix``."""
        with self._lock:
            return sum(n for path, n in self.gets.items() if path.endswith(suffix))

    def _answered(self, nbytes: int) -> None:
        """An object GET was answered with ``nbytes`` of body."""
        with self._lock:
            self.object_gets += 1
            self.object_get_bytes += nbytes

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                path = self.path.split("?", 1)[0]
                if self.command == "GET":
                    with proxy._lock:  # counted as it is asked, before it is answered
                        proxy.gets[path] += 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in HOP_BY_HOP:
                            self.send_header(k, v)
                    if resp.getheader("Content-Length") is None:
                        data = resp.read()  # (chunked upstream): sent with a length
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data)
                        sent = len(data)
                    else:
                        self.end_headers()
                        sent = 0
                        while piece := resp.read(PIECE):
                            if self.command != "HEAD":
                                self.wfile.write(piece)
                            sent += len(piece)
                finally:
                    conn.close()
                if self.command == "GET" and "/" in path.strip("/") and resp.status < 300:
                    proxy._answered(sent)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        return Handler

    def __enter__(self) -> CountingS3Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
