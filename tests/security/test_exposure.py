"""Safe defaults: plaintext listeners only on loopback unless ``--insecure``
(``hypermesh/exposure.py``, applied when an ``AgentConfig`` is built)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hypermesh.agent.burst.ec2 import user_data
from hypermesh.agent.burst.provisioner import Context, NodeSpec
from hypermesh.config import AgentConfig
from hypermesh.errors import UsageError
from hypermesh.exposure import exposed, is_loopback
from hypermesh.state.pools import Pool
from hypermesh.tls import TlsFiles

TLS = TlsFiles(Path("ca.pem"), Path("node1.pem"), Path("node1-key.pem"))


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:7070", True),
        ("127.1.2.3:0", True),
        ("localhost:7070", True),
        ("[::1]:7070", True),
        ("0.0.0.0:0", False),
        ("[::]:7070", False),
        ("10.0.0.7:7070", False),
        ("gpu1.example:7070", False),
    ],
)
def test_loopback_addresses(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_what_counts_as_exposed() -> None:
    assert exposed("127.0.0.1:7070", False, "127.0.0.1:0", "127.0.0.1:7071") == []
    assert exposed("10.0.0.7:7070", True, None, None) == []  # TLS: not plaintext
    found = exposed("10.0.0.7:7070", False, "0.0.0.0:9464", "10.0.0.7:7071")
    assert [f.split()[0] for f in found] == ["--listen", "--http-listen", "--metrics-listen"]


@pytest.mark.parametrize(
    "fields",
    [
        {"listen": "0.0.0.0:7070", "advertise": "10.0.0.7:7070"},
        {"listen": "10.0.0.7:7070", "metrics_listen": None, "http_listen": None},
        {"tls": TLS, "listen": "10.0.0.7:7070", "metrics_listen": "10.0.0.7:9464"},
        {"http_listen": "0.0.0.0:7071"},
    ],
)
def test_plaintext_beyond_loopback_is_refused_without_insecure(fields: dict[str, object]) -> None:
    with pytest.raises(UsageError, match=r"--tls-ca.*--insecure"):
        AgentConfig.lan(name="n1", **fields)
    assert AgentConfig.lan(name="n1", insecure=True, **fields).insecure


def test_tls_on_a_routable_address_and_the_defaults_need_no_insecure() -> None:
    AgentConfig.lan(name="n1")
    AgentConfig.local(name="n1")
    AgentConfig.lan(name="n1", tls=TLS, listen="10.0.0.7:7070", health_listen="10.0.0.7:7072")


def test_an_ec2_nodes_agent_serves_tls_from_tls_dir_or_says_insecure() -> None:
    pool = Pool("cloud", kind="ec2", slots=2)
    ctx = Context(etcd="http://10.0.0.5:2379", namespace="ns1", work_root=Path("/tmp"))
    spec = NodeSpec("cloud-a1", pool, spot=False)
    plain = user_data(spec, ctx, "http://10.0.0.5:2379").splitlines()[-1]
    assert plain.endswith('--listen "$IP:7070" --insecure')
    tls = user_data(spec, ctx, "http://10.0.0.5:2379", tls_dir="/etc/hm/").splitlines()[-1]
    assert tls.endswith('--listen "$IP:7070" --tls-ca=/etc/hm/ca.pem '
                        "--tls-cert=/etc/hm/agent.pem --tls-key=/etc/hm/agent-key.pem")
