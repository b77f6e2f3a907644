"""The ``local`` provisioner in a mesh that runs mutual TLS: each node gets a
certificate issued for its own name from the pool's ``ca_dir`` and the three
``--tls-*`` options; a pool without a CA, or with another CA than the mesh's, starts
nothing and says why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from hypermesh.agent.burst import local
from hypermesh.agent.burst.local import LocalProvisioner
from hypermesh.agent.burst.provisioner import Context, NodeSpec, ProvisionError
from hypermesh.errors import UsageError
from hypermesh.state.pools import Pool
from hypermesh.tls import AGENT_NAME, TlsFiles, certificate_name, init_ca, issue


def mesh_tls(tmp_path: Path) -> TlsFiles:
    ca = tmp_path / "mesh-ca"
    init_ca(ca)
    issue(ca, "leader", ["127.0.0.1"], agent=True)
    return TlsFiles(ca / "ca.pem", ca / "leader.pem", ca / "leader-key.pem")


def provisioner(tmp_path: Path, tls: TlsFiles | None, **options: str) -> LocalProvisioner:
    pool = Pool("burst", kind="local", max_nodes=2, options=options)
    return LocalProvisioner(pool, Context("http://127.0.0.1:2379", "ns", tmp_path / "burst",
                                          tls=tls))


class StartsNothing:
    """Stands in for ``AgentProcess``: records what it was asked to start."""

    started: list[StartsNothing] = []

    def __init__(self, name: str, etcd: str, namespace: str, work_dir: Path, **kw: Any) -> None:
        self.name, self.work_dir, self.extra = name, work_dir, list(kw["extra"])
        self.proc = type("P", (), {"pid": 4242, "poll": lambda self: None})()

    def start(self, wait: bool = True) -> StartsNothing:
        StartsNothing.started.append(self)
        return self


def test_a_node_gets_a_certificate_for_its_own_name(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tls = mesh_tls(tmp_path)
    prov = provisioner(tmp_path, tls, ca_dir=str(tmp_path / "mesh-ca"))
    monkeypatch.setattr(local, "AgentProcess", StartsNothing)
    StartsNothing.started = []
    assert prov.launch(NodeSpec("burst-0a1b2c", prov.pool, spot=False)) == "4242"
    (agent,) = StartsNothing.started
    work = tmp_path / "burst" / "burst-0a1b2c"
    args = dict(zip(agent.extra[::2], agent.extra[1::2], strict=False))
    assert args["--tls-ca"] == str(tls.ca.absolute())
    assert args["--tls-cert"] == str(work / "burst-0a1b2c.pem")
    assert args["--tls-key"] == str(work / "burst-0a1b2c-key.pem")
    pem = (work / "burst-0a1b2c.pem").read_bytes()
    assert certificate_name(pem) == "burst-0a1b2c"
    cert = x509.load_pem_x509_certificate(pem)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) >= {"burst-0a1b2c", AGENT_NAME}
    ca = x509.load_pem_x509_certificate(tls.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert not list((tmp_path / "mesh-ca").glob("burst-*"))  # nothing left in the CA dir


def test_a_plaintext_mesh_passes_no_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "AgentProcess", StartsNothing)
    StartsNothing.started = []
    provisioner(tmp_path, None).launch(NodeSpec("burst-1", Pool("burst", kind="local"), False))
    assert not any(a.startswith("--tls") for a in StartsNothing.started[0].extra)


def test_a_tls_mesh_without_a_pool_ca_starts_nothing(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tls = mesh_tls(tmp_path)
    monkeypatch.setattr(local, "AgentProcess", StartsNothing)
    StartsNothing.started = []
    spec = NodeSpec("burst-2", Pool("burst", kind="local"), False)
    with pytest.raises(ProvisionError, match="pool burst: the mesh uses TLS and the pool "
                                             "names no CA to issue node certificates from"):
        provisioner(tmp_path, tls).launch(spec)
    other = tmp_path / "other-ca"
    init_ca(other)
    with pytest.raises(ProvisionError, match="is not the mesh's CA"):
        provisioner(tmp_path, tls, ca_dir=str(other)).launch(spec)
    assert StartsNothing.started == []


@pytest.mark.parametrize(("kind", "ca_dir", "named"), [
    ("ec2", "/etc/hypermesh/ca", "applies to local pools"),
    ("local", "relative/ca", "absolute path"),
])
def test_the_ca_dir_option_is_checked(kind: str, ca_dir: str, named: str) -> None:
    with pytest.raises(UsageError, match=named):
        Pool("burst", kind=kind, max_nodes=1, options={"ca_dir": ca_dir, "image_id": "ami-1"})
