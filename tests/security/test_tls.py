"""The mesh CA from the CLI, and mutual TLS as gRPC carries it: a server with the mesh's
credentials refuses plaintext, a client without a certificate, a certificate from
another CA, and a client that expected another member's name."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hypermesh.errors import UsageError
from hypermesh.tls import TlsFiles, certificate_name, channel_options


def hm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hypermesh", *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A mesh CA with certificates for node1 (server) and alice (a CLI user), and a
    foreign CA with one of its own for mallory."""
    root = tmp_path_factory.mktemp("pki")
    for args in (
        ("init", str(root / "mesh")),
        ("issue", str(root / "mesh"), "node1", "--host", "127.0.0.1"),
        ("issue", str(root / "mesh"), "alice"),
        ("init", str(root / "other")),
        ("issue", str(root / "other"), "mallory"),
    ):
        result = hm("tls", *args)
        assert result.returncode == 0, result.stderr
    return root


def files(pki: Path, ca: str, name: str) -> TlsFiles:
    return TlsFiles(pki / ca / "ca.pem", pki / ca / f"{name}.pem", pki / ca / f"{name}-key.pem")


def test_the_ca_and_a_certificate_from_the_cli(pki: Path) -> None:
    mesh = pki / "mesh"
    for key in ("ca-key.pem", "node1-key.pem", "alice-key.pem"):
        assert stat.S_IMODE(os.stat(mesh / key).st_mode) == 0o600
    cert = x509.load_pem_x509_certificate((mesh / "node1.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node1"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert certificate_name((mesh / "alice.pem").read_bytes()) == "alice"
    ca = x509.load_pem_x509_certificate((mesh / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)  # raises if another key signed it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("init", "{mesh}"), "already holds a CA"),
        (("issue", "{mesh}", "node1"), "exists already"),
        (("issue", "{mesh}", "../escape"), "certificate name '../escape'"),
        (("issue", "{mesh}", "bob", "--host", "-bad-"), "neither an IP address nor a host name"),
        (("issue", "{empty}", "bob"), "holds no CA"),
    ],
)
def test_the_cli_refuses_what_would_replace_or_misname_a_certificate(
    pki: Path, tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    before = sorted(p.name for p in (pki / "mesh").iterdir())
    result = hm("tls", *(a.format(mesh=pki / "mesh", empty=tmp_path) for a in args))
    assert result.returncode == 2 and message in result.stderr
    assert sorted(p.name for p in (pki / "mesh").iterdir()) == before
    assert not (pki / "escape.pem").exists()


def test_options_name_all_three_files_or_none(pki: Path) -> None:
    assert TlsFiles.from_options(None, None, None, env=False) is None
    mine = files(pki, "mesh", "alice")
    got = TlsFiles.from_options(str(mine.ca), str(mine.cert), str(mine.key), env=False)
    assert got == mine
    with pytest.raises(UsageError, match="missing --tls-key"):
        TlsFiles.from_options(str(mine.ca), str(mine.cert), None, env=False)
    with pytest.raises(UsageError, match=r"--tls-ca: .* is not a readable file"):
        TlsFiles.from_options(str(pki / "nope.pem"), str(mine.cert), str(mine.key), env=False)


def test_a_mutual_tls_server_lets_in_only_the_mesh(pki: Path) -> None:
    server_files = files(pki, "mesh", "node1")

    async def check(credentials: grpc.ChannelCredentials | None, port: int,
                    target_name: str | None = "node1") -> str:
        address = f"127.0.0.1:{port}"
        channel = (
            grpc.aio.insecure_channel(address)
            if credentials is None
            else grpc.aio.secure_channel(address, credentials, channel_options(target_name))
        )
        async with channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def scenario() -> dict[str, str]:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", server_files.server_credentials())
        await server.start()
        ca_only = grpc.ssl_channel_credentials(root_certificates=server_files.ca.read_bytes())
        mallory = files(pki, "other", "mallory")  # trusts the mesh CA, shows another's cert
        foreign = grpc.ssl_channel_credentials(
            root_certificates=server_files.ca.read_bytes(),
            private_key=mallory.key.read_bytes(),
            certificate_chain=mallory.cert.read_bytes(),
        )
        try:
            return {
                "member": await check(files(pki, "mesh", "alice").channel_credentials(), port),
                "plaintext": await check(None, port),
                "no certificate": await check(ca_only, port),
                "foreign CA": await check(foreign, port),
                "wrong name": await check(files(pki, "mesh", "alice").channel_credentials(),
                                          port, "node2"),
            }
        finally:
            await server.stop(None)

    outcome = asyncio.run(scenario())
    assert outcome == {
        "member": "SERVING",
        "plaintext": "UNAVAILABLE",
        "no certificate": "UNAVAILABLE",
        "foreign CA": "UNAVAILABLE",
        "wrong name": "UNAVAILABLE",
    }
