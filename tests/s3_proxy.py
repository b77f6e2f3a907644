"""A counting HTTP proxy in front of the test S3 server, on 127.0.0.1.

Clients pointed at it (``HYPERMESH_S3_ENDPOINT``) reach the real server; the proxy
counts each GET by path, so a test can say how often one object was fetched. Requests
are forwarded unchanged (the Host header too: SigV4 signatures stay valid).
"""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class CountingProxy:
    """Forwards to ``upstream`` (``http://HOST:PORT``); ``gets`` counts GETs by path."""

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self.gets: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                if self.command == "GET":
                    with proxy._lock:
                        proxy.gets[self.path.split("?", 1)[0]] += 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(target.netloc, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in HOP_BY_HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def count(self, suffix: str) -> int:
        """GETs of paths ending with ``suffix``."""
        with self._lock:
            return sum(n for path, n in self.gets.items() if path.endswith(suffix))

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
