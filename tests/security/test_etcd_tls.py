"""etcd reached over TLS and with a user: a real etcd, real agents, the real CLI.

Two module-scoped servers: one serving https that asks every client for a certificate
(``--client-cert-auth``), one with auth enabled whose tokens (JWTs) expire 2 s after
they are issued, with a role per namespace as docs/operations.md says to make it. The
CLI and agents reach each through ``--etcd-*`` options and ``HYPERMESH_ETCD_*``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.etcd_security import ENV_ETCD_PASSWORD, EtcdSecurity
from hypermesh.local.etcd import EtcdServer
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.tls import TlsFiles, init_ca, issue
from tests.conftest import Mesh

RECIPE = "experiments:\n  hello:\n    samples: 2\n    command: ['echo hello {sample}']\n"
TOKEN_TTL_S = 2
TLS_QUOTA = 64 * 1024 * 1024  # not etcd's default: read from its /metrics over https


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA with etcd's server certificate (127.0.0.1, localhost) and a client's."""
    root = tmp_path_factory.mktemp("etcd-pki")
    init_ca(root)
    issue(root, "etcd", ["127.0.0.1", "localhost"])
    issue(root, "client")
    return root


@pytest.fixture(scope="module")
def tls_etcd(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(
        tmp_path_factory.mktemp("etcd-tls"), fsync=False, client_cert_auth=True,
        extra_args=["--quota-backend-bytes", str(TLS_QUOTA)],
        tls=TlsFiles(pki / "ca.pem", pki / "etcd.pem", pki / "etcd-key.pem"),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def jwt_keys(directory: Path) -> tuple[Path, Path]:
    """An ES256 key pair for etcd's JWT tokens (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / "jwt-key.pem", directory / "jwt.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """auth enabled; the user ``team1`` (password ``pw-team1``) has the role ``hm-team1``:
    readwrite on ``/hypermesh/team1/`` and ``/hypermesh-fetching/team1/`` alone. Tokens
    are JWTs valid for 2 s: unlike a simple token, which lapses only when unused that
    long, a JWT expires however busy its holder is, so every long-lived client here must
    authenticate again, often."""
    root = tmp_path_factory.mktemp("etcd-auth")
    private, public = jwt_keys(root)
    server = EtcdServer(root, fsync=False, extra_args=[
        "--auth-token", f"jwt,pub-key={public},priv-key={private},sign-method=ES256,"
        f"ttl={TOKEN_TTL_S}s"])
    server.start()
    try:
        server.enable_auth("root-pw")
        for namespace in ("team1", "team2"):
            server.etcdctl("role", "add", f"hm-{namespace}")
            for prefix in ("/hypermesh/", "/hypermesh-fetching/"):  # docs/operations.md
                server.etcdctl("role", "grant-permission", f"hm-{namespace}", "--prefix=true",
                               "readwrite", f"{prefix}{namespace}/")
            server.etcdctl("user", "add", f"{namespace}:pw-{namespace}")
            server.etcdctl("user", "grant-role", namespace, f"hm-{namespace}")
        yield server
    finally:
        server.stop()


def client_options(pki: Path) -> tuple[str, ...]:
    return ("--etcd-ca", str(pki / "ca.pem"), "--etcd-cert", str(pki / "client.pem"),
            "--etcd-key", str(pki / "client-key.pem"))


def one_line_error(result: object) -> str:
    stderr = str(getattr(result, "stderr", ""))
    lines = [line for line in stderr.splitlines() if line.startswith("hypermesh: ")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return lines[0]


def run_workflow(mesh: Mesh) -> None:
    wid = mesh.submit(mesh.write_recipe(RECIPE))
    state = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"]
    assert state == "succeeded", mesh.logs()


# ------------------------------------------------------------------ client certificates
def test_a_tls_etcd_refuses_plaintext_and_a_client_without_certificate(
    tls_etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    mesh = Mesh(tls_etcd, tmp_path)
    try:
        plain = mesh.hm("settings", "--etcd", tls_etcd.url.replace("https", "http"))
        assert plain.returncode == 1
        assert "use https:// endpoints and --etcd-ca" in one_line_error(plain)
        no_cert = mesh.hm("settings", "--etcd-ca", str(pki / "ca.pem"))
        assert no_cert.returncode == 1
        assert "TLS handshake failed" in one_line_error(no_cert)
        no_ca = mesh.hm("settings")
        assert no_ca.returncode == 2
        assert "give --etcd-ca" in one_line_error(no_ca)
        half = mesh.hm("settings", "--etcd-ca", str(pki / "ca.pem"),
                       "--etcd-cert", str(pki / "client.pem"))
        assert half.returncode == 2
        assert "--etcd-cert needs --etcd-key" in one_line_error(half)
    finally:
        mesh.close()


def test_an_agent_and_the_cli_with_a_client_certificate_run_a_workflow(
    tls_etcd: EtcdServer, pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mesh = Mesh(tls_etcd, tmp_path)
    try:
        mesh.agent("node1", extra=client_options(pki))  # options for the agent
        for name, value in EtcdSecurity(pki / "ca.pem", pki / "client.pem",
                                        pki / "client-key.pem").env().items():
            monkeypatch.setenv(name, value)  # the environment for the CLI
        run_workflow(mesh)
    finally:
        mesh.close()


# ------------------------------------------------------------------ users and roles
@pytest.fixture
def team1(auth_etcd: EtcdServer, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Mesh]:
    """A mesh in namespace team1, its agent and CLI the user team1."""
    monkeypatch.setenv(ENV_ETCD_PASSWORD, "pw-team1")
    monkeypatch.setenv("HYPERMESH_ETCD_USER", "team1")
    mesh = Mesh(auth_etcd, tmp_path)
    mesh.namespace = "team1"
    try:
        yield mesh
    finally:
        mesh.close()


def test_a_namespace_user_runs_a_workflow_and_reads_no_other_namespace(team1: Mesh) -> None:
    mesh = team1
    agent = mesh.agent("node1", extra=("--etcd-user", "team1"))
    # Its token expires 2 s after it was issued: the agent authenticates again.
    wait_for(lambda: agent.log_tail(100_000).count("authenticated again as team1") >= 1, 20,
             "the agent to authenticate again after its tokens expired")
    run_workflow(mesh)
    assert "Traceback" not in agent.log_tail(100_000)
    other = mesh.hm("settings", "--namespace", "team2")
    assert other.returncode == 1
    line = one_line_error(other)
    assert "permission denied for user 'team1'" in line, line


def test_a_wrong_or_missing_password_is_a_one_line_error(
    team1: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    mesh = team1
    monkeypatch.setenv(ENV_ETCD_PASSWORD, "not-the-password")
    wrong = mesh.hm("settings")
    assert wrong.returncode == 1
    assert "etcd authentication failed for user 'team1'" in one_line_error(wrong)
    monkeypatch.delenv(ENV_ETCD_PASSWORD)
    missing = mesh.hm("settings")
    assert missing.returncode == 2
    assert ENV_ETCD_PASSWORD in one_line_error(missing)


def test_a_watch_and_a_lease_survive_expiring_tokens(auth_etcd: EtcdServer) -> None:
    """The token expires several times while the client watches and keeps a lease
    (a second client writes): the watch goes on delivering, the lease stays renewed,
    and the next call authenticates again by itself."""
    security = EtcdSecurity(user="team1", password="pw-team1")
    prefix = "/hypermesh/team1/expiry/"
    rounds = 3

    async def scenario() -> None:
        async with Etcd(parse_endpoints(auth_etcd.url), security=security) as etcd, \
                Etcd(parse_endpoints(auth_etcd.url), security=security) as writer:
            seen: list[str] = []
            renewals: list[float] = []
            lost: list[bool] = []
            lease = await etcd.grant(3)
            keeper = asyncio.create_task(etcd.keep_lease(
                lease, 3, lambda: lost.append(True), renewals.append))
            ready = asyncio.Event()
            mirror = asyncio.create_task(etcd.mirror(
                prefix, lambda key, *_: seen.append(key), lambda _: None, ready=ready))
            try:
                async with asyncio.timeout(10):
                    await ready.wait()
                generation = etcd._token_gen
                for n in range(rounds):
                    idle_until = time.monotonic() + TOKEN_TTL_S + 0.5  # the token expires
                    while time.monotonic() < idle_until:
                        await writer.put(f"{prefix}w{n}", b"x")  # keeps writer's alive
                        await asyncio.sleep(0.5)
                    deadline = time.monotonic() + 5
                    while f"{prefix}w{n}" not in seen:
                        assert time.monotonic() < deadline, f"the watch missed w{n}"
                        await asyncio.sleep(0.05)
                    assert not lost
                await etcd.put(f"{prefix}last", b"x", lease=lease)  # authenticates again
                assert etcd._token_gen > generation
                assert (await etcd.get(f"{prefix}last")) is not None  # the lease is alive
                assert len(renewals) >= rounds * TOKEN_TTL_S
            finally:
                keeper.cancel()
                mirror.cancel()
                await asyncio.gather(keeper, mirror, return_exceptions=True)
            assert not lost

    asyncio.run(scenario())


def test_options_and_environment_make_one_security(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    env = {"HYPERMESH_ETCD_CA": str(ca), "HYPERMESH_ETCD_USER": "u",
           ENV_ETCD_PASSWORD: "s3cret"}
    security = EtcdSecurity.from_env(env)
    assert security == EtcdSecurity(ca=ca, user="u", password="s3cret")
    assert "s3cret" not in repr(security)
    assert os.fspath(ca) in security.env()["HYPERMESH_ETCD_CA"]


class _Leader:
    """What ``Housekeeping`` reads of an agent: a leader whose etcd user has the
    namespace's role only."""

    def __init__(self, etcd: Etcd) -> None:
        self.cfg = type("Cfg", (), {"name": "node1"})()
        self.etcd = etcd
        self.state = "alive"
        self.is_leader = True
        self.lease_is_lost = False
        self.decisions: list[str] = []

    def decide(self, message: str) -> None:
        self.decisions.append(message)


def test_housekeeping_that_needs_root_is_noted_once_and_skipped(
    auth_etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd 3.5 lets a namespace role read members' status and compact, but not
    defragment: the leader says so once and carries on. (Whether a small test database
    has pages to free after a compaction is up to bbolt: every member counts as worth
    defragmenting here.)"""
    from hypermesh.agent.leader import housekeeping as module
    from hypermesh.agent.leader.compaction import HousekeepingConfig

    monkeypatch.setattr(module, "worth_defragmenting", lambda *_: True)

    async def scenario() -> list[str]:
        async with Etcd(parse_endpoints(auth_etcd.url),
                        security=EtcdSecurity(user="team1", password="pw-team1")) as etcd:
            leader = _Leader(etcd)
            housekeeping = module.Housekeeping(
                leader, HousekeepingConfig(defrag_every_s=0.05))  # type: ignore[arg-type]
            revision = await etcd.put("/hypermesh/team1/compact-me", b"x")
            assert await etcd.compact(revision)  # allowed to the role
            for _ in range(3):
                await housekeeping.look_after_members(time.monotonic() + 3600)
            return leader.decisions

    decisions = asyncio.run(scenario())
    refused = [d for d in decisions if "etcd refuses" in d]
    assert len(refused) == 1 and "defragmentation" in refused[0], decisions


def test_the_quota_is_read_over_tls(tls_etcd: EtcdServer, pki: Path) -> None:
    from hypermesh.state.etcd_size import db_size

    async def quota() -> int:
        security = EtcdSecurity(pki / "ca.pem", pki / "client.pem", pki / "client-key.pem")
        async with Etcd(parse_endpoints(tls_etcd.url), security=security) as etcd:
            return (await db_size(etcd)).quota

    assert asyncio.run(quota()) == TLS_QUOTA


def test_schemes_and_the_ca_go_together() -> None:
    from hypermesh.errors import UsageError

    tls = EtcdSecurity(ca=Path("ca.pem"))
    tls.check_scheme("https://10.0.0.5:2379,https://10.0.0.6:2379")
    for security, urls, says in (
        (EtcdSecurity(), "https://10.0.0.5:2379", "give --etcd-ca"),
        (tls, "http://10.0.0.5:2379", "not https://"),
        (tls, "https://10.0.0.5:2379,10.0.0.6:2379", "mix schemes"),
    ):
        with pytest.raises(UsageError, match=says):
            security.check_scheme(urls)
    user = EtcdSecurity(user="team1", password="pw")
    assert user.cleartext_warning(["127.0.0.1:2379", "localhost:2379"]) is None
    assert "in clear" in (user.cleartext_warning(["10.0.0.5:2379"]) or "")
    assert EtcdSecurity(Path("ca.pem"), user="team1", password="pw").cleartext_warning(
        ["10.0.0.5:2379"]) is None
