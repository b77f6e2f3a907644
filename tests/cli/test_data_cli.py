"""``hypermesh data`` as a user runs it: a subprocess against the real S3 server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hypermesh.chunkfs import format as fmt
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.s3server import S3Server

HYPERMESH = str(Path(sys.executable).parent / "hypermesh")


class DataCli:
    def __init__(self, server: S3Server, store_url: str) -> None:
        self.env = {
            **os.environ,
            **server.client_env(),
            "HYPERMESH_STORE": store_url,
            "HYPERMESH_ETCD": "http://127.0.0.1:1",  # never used by data commands
        }

    def __call__(self, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [HYPERMESH, "data", *args], env=self.env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == code, (
            f"hypermesh data {' '.join(args)} exited {result.returncode}, wanted {code}:\n"
            f"{result.stdout}\n{result.stderr}"
        )
        return result

    def json(self, *args: str) -> object:
        return json.loads(self(*args, "--json").stdout)


@pytest.fixture
def cli(s3_server: S3Server, store_url: str) -> DataCli:
    return DataCli(s3_server, store_url)


def test_put_ls_get_rm(cli: DataCli, store: S3Store, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "sub" / "deeper" / "a.txt").write_text("alpha")
    (src / "big.bin").write_bytes(os.urandom(5 << 20))
    (src / "-dash name").write_text("odd")

    put = cli.json("put", str(src), "cli-ds", "--chunk-size", "4MiB", "--parallel", "2")
    assert isinstance(put, dict)
    assert put["name"] == "cli-ds" and put["files"] == 3 and put["bytes"] == (5 << 20) + 8
    version = put["version"]
    second = cli("put", str(src), "cli-ds", "--chunk-size", "4MiB")
    assert second.stdout.strip() != version and second.stdout.count("\n") == 1
    assert "already stored" in second.stderr

    listing = cli.json("ls")
    assert isinstance(listing, list) and [r["name"] for r in listing] == ["cli-ds"]
    assert listing[0]["versions"] == 2 and listing[0]["version"] == second.stdout.strip()
    versions = cli.json("ls", "cli-ds")
    assert isinstance(versions, list)
    assert [r["version"] for r in versions] == [version, second.stdout.strip()]
    assert "cli-ds" in cli("ls").stdout

    cli("get", f"cli-ds@{version}", str(tmp_path / "out"))
    assert (tmp_path / "out" / "sub" / "deeper" / "a.txt").read_text() == "alpha"
    assert (tmp_path / "out" / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    assert (tmp_path / "out" / "-dash name").read_text() == "odd"

    removed = cli.json("rm", f"cli-ds@{version}")
    assert removed == {"removed": [version], "chunks_deleted": 0, "pages_deleted": 0}
    cli("rm", "cli-ds")
    assert cli.json("ls") == []
    assert list(store.list()) == []


def test_exit_codes(cli: DataCli, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    # Bad input: 2.
    bad = cli("ls", "--store", "ftp://nowhere", code=2)
    assert "invalid store URL 'ftp://nowhere'" in bad.stderr and "s3://BUCKET" in bad.stderr
    assert bad.stderr.startswith("hypermesh: error:")
    cli("put", str(tmp_path / "src"), "x", "--chunk-size", "1MiB", code=2)
    cli("put", str(tmp_path / "src"), "x", "--chunk-size", "lots", code=2)
    cli("put", str(tmp_path / "src"), "bad/name", code=2)
    cli("put", str(tmp_path / "missing"), "x", code=2)
    cli("get", "bad/name", str(tmp_path / "o"), code=2)
    # Missing data set or version: 1, naming it.
    assert "'nope'" in cli("get", "nope", str(tmp_path / "o"), code=1).stderr
    assert "nope@v1" in cli("ls", "nope@v1", code=1).stderr
    cli("rm", "nope", code=1)
    cli("ls", "nope", code=1)


def test_corrupt_chunk_fails_get(cli: DataCli, store: S3Store, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(os.urandom(100_000))
    cli("put", str(src), "bad", "--chunk-size", "4MiB")
    (key,) = [k for k in store.list("chunks/") if not k.endswith(".blocks")]
    data = bytearray(store.get(key))
    data[500] ^= 0xFF
    store.put(key, bytes(data))
    result = cli("get", "bad", str(tmp_path / "out"), code=1)
    assert key.rpartition("/")[2] in result.stderr and "does not match" in result.stderr
    assert fmt.chunk_key(key.rpartition("/")[2]) == key


def test_unavailable_store_is_runtime_error(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "HYPERMESH_S3_ENDPOINT": "http://127.0.0.1:9",  # discard port: nothing listens
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    result = subprocess.run(
        [HYPERMESH, "data", "ls", "--store", "s3://bucket/p"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "unavailable" in result.stderr
