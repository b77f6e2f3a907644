"""The counting S3 proxy: requests pass through unchanged and are counted."""

from __future__ import annotations

import os

from hypermesh.chunkfs.store import S3Store
from hypermesh.local.s3proxy import CountingS3Proxy
from hypermesh.local.s3server import S3Server
from tests.conftest import TEST_BUCKET


def test_the_proxy_counts_object_gets_and_their_bytes_not_listings(
    s3_server: S3Server, store_url: str
) -> None:
    prefix = store_url.removeprefix(f"s3://{TEST_BUCKET}/")
    data = os.urandom(3 << 20)
    with CountingS3Proxy(s3_server.endpoint) as proxy:
        s = S3Store(TEST_BUCKET, prefix, endpoint=proxy.endpoint)
        try:
            s.put("a/b", data)  # a PUT: not counted
            assert s.get("a/b") == data
            assert s.get_range("a/b", 100, 1000) == data[100:1100]
            assert list(s.list("a/")) == ["a/b"]  # a listing GET: not an object GET
        finally:
            s.close()
        assert proxy.object_gets == 2
        assert proxy.object_get_bytes == len(data) + 1000
        assert proxy.count("/a/b") == 2
        assert sum(proxy.gets.values()) == 3
