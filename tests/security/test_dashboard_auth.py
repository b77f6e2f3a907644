"""The dashboard lets in only its own: the Host check (against DNS rebinding) on every
request, the login when the agent has a dashboard token (cookie or bearer token, over
HTTPS with the agent's mesh certificate), and the refusal to start a dashboard beyond
loopback without one (``agent/ops/dashboard_auth.py``, ``hypermesh/exposure.py``).

Real agents, on 127.0.0.1 only: one without a token, one with a token and TLS files.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypermesh.agent.ops.dashboard_auth import HostCheck, split_host
from hypermesh.config import AgentConfig
from hypermesh.errors import UsageError
from hypermesh.exposure import dashboard_https, dashboard_token, warn_exposed
from hypermesh.local.agents import AgentProcess, hypermesh_command
from hypermesh.local.etcd import EtcdServer
from hypermesh.local.pki import LocalPki
from hypermesh.tls import TlsFiles

TOKEN = "s3cret-dashboard-token-0123456789"
FILES = TlsFiles(Path("ca.pem"), Path("node1.pem"), Path("node1-key.pem"))
Answer = tuple[int, dict[str, str], bytes]


# -- the rules, without a server ---------------------------------------------------


@pytest.mark.parametrize(
    ("header", "split"),
    [
        ("127.0.0.1:7071", ("127.0.0.1", "7071")),
        ("[::1]:7071", ("::1", "7071")),
        ("[::1]", ("::1", "")),
        ("LocalHost.", ("localhost", "")),
        ("evil.example:7071", ("evil.example", "7071")),
    ],
)
def test_host_header_split(header: str, split: tuple[str, str]) -> None:
    assert split_host(header) == split


@pytest.mark.parametrize(
    ("header", "allowed"),
    [
        ("127.0.0.1:7071", True),
        ("[::1]:7071", True),
        ("10.0.0.7:7071", True),  # an IP literal: no DNS name, no rebinding
        ("localhost:8080", True),  # kubectl port-forward changes the port
        ("gpu1:7071", True),  # this machine's own name
        ("dash.example", True),
        ("dash.example:443", True),
        ("proxy.example:8443", True),
        ("proxy.example:8080", False),  # named with another port
        ("evil.example:7071", False),
        ("127.0.0.1.evil.example", False),
        ("localhost.evil.example:7071", False),
        ("", False),
        (None, False),
    ],
)
def test_host_check(header: str | None, allowed: bool) -> None:
    check = HostCheck(("dash.example", "proxy.example:8443"), machine="GPU1")
    assert check.allows(header) is allowed


def test_a_dashboard_beyond_loopback_needs_a_token_and_https_or_insecure() -> None:
    with pytest.raises(UsageError, match=r"dashboard without a login.*--dashboard-token-file"):
        AgentConfig.lan(name="n1", http_listen="0.0.0.0:7071")
    with pytest.raises(UsageError, match=r"dashboard login over plain HTTP.*--tls-ca"):
        AgentConfig.lan(name="n1", http_listen="0.0.0.0:7071", dashboard_token=TOKEN)
    AgentConfig.lan(name="n1", http_listen="0.0.0.0:7071", dashboard_token=TOKEN, tls=FILES)
    assert AgentConfig.lan(name="n1", http_listen="0.0.0.0:7071", insecure=True).insecure
    AgentConfig.local(name="n1")  # loopback: no token needed
    with pytest.raises(UsageError, match="at least 16"):
        AgentConfig.local(name="n1", dashboard_token="short")
    with pytest.raises(UsageError, match="--dashboard-host"):
        AgentConfig.local(name="n1", dashboard_hosts=("evil example",))
    assert TOKEN not in repr(AgentConfig.local(name="n1", dashboard_token=TOKEN))


def test_insecure_lets_an_open_dashboard_out_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = AgentConfig.lan(name="n1", http_listen="0.0.0.0:7071", insecure=True)
    with caplog.at_level(logging.WARNING, "hypermesh.agent"):
        warn_exposed(cfg)
    assert "--http-listen 0.0.0.0:7071 (dashboard without a login)" in caplog.text


def test_https_only_where_a_token_or_the_network_needs_it() -> None:
    assert not dashboard_https("127.0.0.1:0", True, False)  # loopback, no login
    assert dashboard_https("127.0.0.1:0", True, True)
    assert dashboard_https("0.0.0.0:7071", True, False)
    assert not dashboard_https("0.0.0.0:7071", False, True)  # no certificate to serve
    assert not dashboard_https(None, True, True)


def test_the_token_comes_from_its_file_before_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYPERMESH_DASHBOARD_TOKEN", "from-the-environment-0123")
    assert dashboard_token(None) == "from-the-environment-0123"
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert dashboard_token(tmp_path / "token") == TOKEN
    with pytest.raises(UsageError, match="--dashboard-token-file"):
        dashboard_token(tmp_path / "missing")


# -- real agents ---------------------------------------------------------------------


def request(
    address: str, method: str, path: str, *, host: str | None = None,
    headers: dict[str, str] | None = None, body: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> Answer:
    """One request with exactly these headers (no redirect followed); ``host`` None:
    the address itself."""
    ip, _, port = address.rpartition(":")
    conn = (http.client.HTTPSConnection(ip, int(port), timeout=10, context=tls) if tls
            else http.client.HTTPConnection(ip, int(port), timeout=10))
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host if host is not None else address)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        data = body.encode() if body is not None else None
        if data is not None:
            conn.putheader("Content-Type", "application/x-www-form-urlencoded")
            conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def start_agent(
    etcd: EtcdServer, root: Path, name: str, extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> AgentProcess:
    agent = AgentProcess(name, etcd.url, f"dash-{name}-{os.getpid()}", root / name,
                         slots=1, extra=extra, env=env)
    agent.start()
    return agent


@pytest.fixture(scope="module")
def open_agent(
    etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentProcess]:
    """An agent without a dashboard token (the local mesh's case), told two more names."""
    env = {k: v for k, v in os.environ.items() if k != "HYPERMESH_DASHBOARD_TOKEN"}
    env["HYPERMESH_DASHBOARD_HOSTS"] = "dash.example, other.example:9999"
    agent = start_agent(etcd_server, tmp_path_factory.mktemp("open"), "open1",
                        ("--dashboard-host", "Third.Example"), env=env)
    try:
        yield agent
    finally:
        agent.terminate(timeout=20)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> LocalPki:
    return LocalPki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def guarded_agent(
    etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory, pki: LocalPki
) -> Iterator[AgentProcess]:
    """An agent with a dashboard token (from a file) and its mesh TLS files: HTTPS."""
    root = tmp_path_factory.mktemp("guarded")
    (root / "token").write_text(TOKEN + "\n")
    tls = pki.member("guard1", agent=True)
    agent = start_agent(
        etcd_server, root, "guard1",
        ("--dashboard-token-file", str(root / "token"), "--tls-ca", str(tls.ca),
         "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)),
    )
    try:
        yield agent
    finally:
        agent.terminate(timeout=20)


@pytest.fixture(scope="module")
def trust(pki: LocalPki) -> ssl.SSLContext:
    """A browser that trusts the mesh CA (the agent's certificate names 127.0.0.1)."""
    return ssl.create_default_context(cafile=str(pki.member("guard1", agent=True).ca))


@pytest.mark.parametrize("path", ["/", "/app.js", "/trials.js", "/vendor/echarts.min.js",
                                  "/api/nodes", "/api/workflows", "/api/workflows/wf-1/trials",
                                  "/nowhere"])
def test_a_forged_host_is_refused_on_loopback(open_agent: AgentProcess, path: str) -> None:
    status, _, body = request(open_agent.http_address, "GET", path, host="rebind.evil.example")
    assert status == 403
    assert body.startswith(b"forbidden: this dashboard does not answer to Host")


def test_the_agents_own_address_and_localhost_are_served(open_agent: AgentProcess) -> None:
    address = open_agent.http_address
    status, headers, body = request(address, "GET", "/api/nodes")
    assert status == 200, body
    assert json.loads(body)["node"] == "open1"
    assert headers["x-frame-options"] == "DENY"
    port = address.rpartition(":")[2]
    assert request(address, "GET", "/", host=f"localhost:{port}")[0] == 200
    assert request(address, "GET", "/login")[0] == 404  # no token: no login at all
    for name, served in [("dash.example", 200), ("third.example:1", 200),
                         ("other.example:9999", 200), ("other.example:1", 403)]:
        assert request(address, "GET", "/api/workflows", host=name)[0] == served, name


def test_a_dashboard_beyond_loopback_without_a_token_refuses_to_start(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """The rule is applied as the configuration is built: the agent exits before it
    binds anything (no test listens beyond 127.0.0.1)."""
    result = subprocess.run(
        [*hypermesh_command(), "agent", "start", "--etcd", etcd_server.url, "--namespace",
         "dash-refused", "--name", "refused1", "--listen", "127.0.0.1:0", "--http-listen",
         "0.0.0.0:0", "--work-dir", str(tmp_path / "w"), "--preset", "local"],
        capture_output=True, text=True, timeout=30,
        env={k: v for k, v in os.environ.items() if k != "HYPERMESH_DASHBOARD_TOKEN"},
    )
    assert result.returncode == 2
    assert "--http-listen 0.0.0.0:0 (dashboard without a login)" in result.stderr
    assert "--dashboard-token-file" in result.stderr
    short = subprocess.run(
        [*hypermesh_command(), "agent", "start", "--etcd", etcd_server.url, "--name", "short1",
         "--listen", "127.0.0.1:0", "--work-dir", str(tmp_path / "s"), "--preset", "local"],
        capture_output=True, text=True, timeout=30,
        env=dict(os.environ, HYPERMESH_DASHBOARD_TOKEN="only-12-char"),
    )
    assert short.returncode == 2
    assert "at least 16" in short.stderr


def test_without_a_login_pages_redirect_and_the_api_answers_401(
    guarded_agent: AgentProcess, trust: ssl.SSLContext
) -> None:
    address = guarded_agent.http_address
    status, headers, _ = request(address, "GET", "/", tls=trust)
    assert (status, headers["location"]) == (303, "/login")
    status, headers, body = request(address, "GET", "/api/nodes", tls=trust)
    assert status == 401 and "login required" in json.loads(body)["error"]
    status, _, body = request(address, "GET", "/api/workflows/wf-1/trials", tls=trust)
    assert status == 401 and "login required" in json.loads(body)["error"]
    status, _, body = request(address, "GET", "/login", tls=trust)
    assert status == 200 and b'name="token"' in body
    # The Host check comes first, the right token notwithstanding.
    status, _, _ = request(address, "GET", "/api/nodes", host="rebind.evil.example",
                           headers={"Authorization": f"Bearer {TOKEN}"}, tls=trust)
    assert status == 403


def test_a_wrong_token_is_refused_and_logged(
    guarded_agent: AgentProcess, trust: ssl.SSLContext
) -> None:
    address = guarded_agent.http_address
    status, headers, _ = request(address, "POST", "/login", body="token=not-the-token",
                                 tls=trust)
    assert status == 403 and "set-cookie" not in headers
    status, _, _ = request(address, "GET", "/api/nodes", tls=trust,
                           headers={"Authorization": "Bearer not-the-token"})
    assert status == 403
    assert "wrong token (login form)" in guarded_agent.log_tail(20000)


def test_the_right_token_gives_a_session_cookie_that_opens_pages_and_api(
    guarded_agent: AgentProcess, trust: ssl.SSLContext
) -> None:
    address = guarded_agent.http_address
    status, headers, _ = request(address, "POST", "/login", body=f"token={TOKEN}", tls=trust,
                                 headers={"Origin": f"https://{address}"})
    assert (status, headers["location"]) == (303, "/")
    cookie = headers["set-cookie"]
    attributes = {a.strip().split("=")[0].lower() for a in cookie.split(";")}
    assert {"httponly", "secure", "path", "samesite"} <= attributes
    assert "SameSite=Strict" in cookie and "Path=/" in cookie
    assert TOKEN not in cookie and TOKEN not in headers.get("location", "")
    session = cookie.split(";")[0]
    assert session.startswith("hypermesh_session_")
    status, _, body = request(address, "GET", "/", headers={"Cookie": session}, tls=trust)
    assert status == 200 and b"<html" in body.lower()
    status, _, body = request(address, "GET", "/api/nodes", headers={"Cookie": session},
                              tls=trust)
    assert status == 200 and json.loads(body)["node"] == "guard1"
    forged = session.split("=")[0] + "=" + "x" * 43
    assert request(address, "GET", "/api/nodes", headers={"Cookie": forged}, tls=trust)[0] == 401


def test_a_bearer_token_opens_the_api(guarded_agent: AgentProcess, trust: ssl.SSLContext) -> None:
    status, _, body = request(guarded_agent.http_address, "GET", "/api/workflows", tls=trust,
                              headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and json.loads(body)["node"] == "guard1"


def test_a_cross_origin_login_and_other_methods_are_refused(
    guarded_agent: AgentProcess, trust: ssl.SSLContext
) -> None:
    address = guarded_agent.http_address
    status, headers, _ = request(address, "POST", "/login", body=f"token={TOKEN}", tls=trust,
                                 headers={"Origin": "https://evil.example"})
    assert status == 403 and "set-cookie" not in headers
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for method in ("POST", "PUT", "DELETE"):
        assert request(address, method, "/api/nodes", body="", headers=bearer,
                       tls=trust)[0] == 405


def test_the_guarded_dashboard_speaks_only_https(guarded_agent: AgentProcess) -> None:
    address = guarded_agent.http_address
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with pytest.raises(ssl.SSLCertVerificationError):  # a client without the mesh CA
        request(address, "GET", "/api/nodes", headers=bearer, tls=ssl.create_default_context())
    with pytest.raises((http.client.HTTPException, ConnectionError)):  # plain HTTP
        request(address, "GET", "/api/nodes", headers=bearer)
