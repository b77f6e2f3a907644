"""The mesh's certificate authority and the credentials of its gRPC connections.

One CA per mesh (``hypermesh tls init DIR``); every agent, mount and CLI user holds a
certificate it signed (``hypermesh tls issue DIR NAME``) whose subject alternative
names are NAME (a DNS name: the node's or user's name in the mesh) and the hosts it
is reached at. Every gRPC connection is mutual TLS: the server requires a client
certificate from the mesh CA, and a client checks that the server's certificate
names the peer it meant to reach (``target_name``: a node's name, not the address it
registered, so a certificate is valid wherever its node moves).

Keys are ECDSA P-256 (small handshakes; the TLS session is reused by gRPC for the
life of a channel). Private keys are written with mode 0600 and never overwritten.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from hypermesh.errors import UsageError

ENV_TLS_CA = "HYPERMESH_TLS_CA"
ENV_TLS_CERT = "HYPERMESH_TLS_CERT"
ENV_TLS_KEY = "HYPERMESH_TLS_KEY"

AGENT_NAME = "agent.hypermesh"
"""The DNS name every agent's certificate carries besides its node name
(``hypermesh tls issue --agent``): clients connecting to an agent check the server's
certificate for it, so any agent of the mesh is accepted as an agent and a CLI user's
or mount's certificate is not; agents accept gossip and chunk traffic only from
certificates that carry it."""

CA_DAYS = 3650
CERT_DAYS = 825  # what browsers and most tooling accept for a leaf
NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62})")  # a node or user name
_HOST_RE = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*")


@dataclass(frozen=True)
class TlsFiles:
    """A member's TLS material: the mesh CA's certificate, its own certificate and key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_options(
        cls, ca: str | None, cert: str | None, key: str | None, *, env: bool = True
    ) -> TlsFiles | None:
        """The files named by options, else by ``HYPERMESH_TLS_*`` (with ``env``); None
        when none is named. Naming some but not all three is an error, as is a file
        that cannot be read."""
        if env:
            ca = ca or os.environ.get(ENV_TLS_CA) or None
            cert = cert or os.environ.get(ENV_TLS_CERT) or None
            key = key or os.environ.get(ENV_TLS_KEY) or None
        given = {"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key}
        if not any(given.values()):
            return None
        missing = [name for name, value in given.items() if not value]
        if missing:
            raise UsageError(
                f"TLS needs all of --tls-ca, --tls-cert and --tls-key; missing {', '.join(missing)}"
            )
        files = cls(Path(ca), Path(cert), Path(key))  # type: ignore[arg-type]
        for option, path in zip(given, (files.ca, files.cert, files.key), strict=True):
            if not path.is_file():
                raise UsageError(f"{option}: {path} is not a readable file")
        return files

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(CA certificate, certificate, key) in PEM."""
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials of a server that requires a client certificate from the mesh CA."""
        ca, cert, key = self.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a client that shows its certificate and trusts only the mesh CA."""
        ca, cert, key = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def env(self) -> dict[str, str]:
        """The ``HYPERMESH_TLS_*`` variables naming these files (for a child process)."""
        return {ENV_TLS_CA: str(self.ca.absolute()), ENV_TLS_CERT: str(self.cert.absolute()),
                ENV_TLS_KEY: str(self.key.absolute())}

    def name(self) -> str:
        """The mesh name this certificate was issued for (its first DNS name)."""
        return certificate_name(self.cert.read_bytes())


def channel_options(target_name: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC options that make a TLS client check the server's certificate for
    ``target_name`` (the peer's mesh name) instead of the host in the address."""
    return () if target_name is None else (("grpc.ssl_target_name_override", target_name),)


def certificate_name(pem: bytes) -> str:
    """The first DNS name in a certificate's subject alternative names."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ""
    names = san.get_values_for_type(x509.DNSName)
    return names[0] if names else ""


# ---------------------------------------------------------------------- issuing
def init_ca(directory: Path, common_name: str = "hypermesh mesh CA") -> Path:
    """Create a CA in ``directory`` (ca.pem, ca-key.pem); refuses to replace one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
    if cert_path.exists() or key_path.exists():
        raise UsageError(f"{directory} already holds a CA (ca.pem / ca-key.pem); not replacing it")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    cert_path.write_bytes(_pem(cert))
    return cert_path


def issue(
    directory: Path, name: str, hosts: Sequence[str] = (), days: int = CERT_DAYS,
    *, agent: bool = False, out: Path | None = None,
) -> Path:
    """Issue NAME.pem / NAME-key.pem in ``directory`` (or ``out``), signed by the CA in
    ``directory``, for ``name`` and ``hosts`` (host names or IP addresses), usable as
    server and as client. With ``agent`` the certificate also names :data:`AGENT_NAME`:
    it is an agent's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not NAME_RE.fullmatch(name):
        raise UsageError(
            f"certificate name {name!r}: 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if not 1 <= days <= 3650:
        raise UsageError(f"--days must be 1-3650, not {days}")
    alt_names: list[x509.GeneralName] = [x509.DNSName(name)]
    if agent and name != AGENT_NAME:
        alt_names.append(x509.DNSName(AGENT_NAME))
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not _HOST_RE.fullmatch(host):
                raise UsageError(
                    f"--host {host!r} is neither an IP address nor a host name"
                ) from None
            if host != name:
                alt_names.append(x509.DNSName(host))
    into = out or directory
    cert_path, key_path = into / f"{name}.pem", into / f"{name}-key.pem"
    if cert_path.exists() or key_path.exists():
        raise UsageError(f"{cert_path} or {key_path} exists already; not replacing it")
    try:
        ca_key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    except FileNotFoundError as exc:
        raise UsageError(
            f"{directory} holds no CA; run `hypermesh tls init {directory}` first"
        ) from exc
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise UsageError(f"{directory}/ca-key.pem is not an EC key made by `hypermesh tls init`")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(key_path, key)
    cert_path.write_bytes(_pem(cert))
    return cert_path


def _pem(cert: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)  # type: ignore[attr-defined,no-any-return]


def _write_key(path: Path, key: object) -> None:
    """Write a private key readable by its owner only (created 0600, never widened)."""
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)

