"""How hypermesh reaches a secured etcd: TLS material and an etcd user.

- ``https://`` endpoints need ``--etcd-ca`` (the CA that signed etcd's server
  certificates): the system's roots are not used, an etcd cluster's CA is nearly always
  its own, and trusting every public CA for it would be the unsafe default. All the
  endpoints of one list use the same scheme.
- ``--etcd-cert`` and ``--etcd-key`` (both or neither) are the client certificate etcd
  asks for when it runs with ``--client-cert-auth``; with auth enabled and no user given,
  etcd takes the certificate's common name as the user.
- ``--etcd-user`` names an etcd user; its password comes from ``HYPERMESH_ETCD_PASSWORD``
  only, never from an option (it would show in ``ps``).

Every option falls back to its ``HYPERMESH_ETCD_*`` variable. ``Etcd`` (``hypermesh/
state/etcd.py``) turns these into its channel and its authentication.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import grpc

from hypermesh.errors import UsageError

ENV_ETCD_CA = "HYPERMESH_ETCD_CA"
ENV_ETCD_CERT = "HYPERMESH_ETCD_CERT"
ENV_ETCD_KEY = "HYPERMESH_ETCD_KEY"
ENV_ETCD_USER = "HYPERMESH_ETCD_USER"
ENV_ETCD_PASSWORD = "HYPERMESH_ETCD_PASSWORD"


def endpoints_scheme(urls: str) -> str:
    """``http`` or ``https``: the scheme every endpoint of ``urls`` uses (a bare
    ``HOST:PORT`` is ``http``). A list that mixes them is an error naming both."""
    schemes: dict[str, str] = {}
    for raw in urls.split(","):
        raw = raw.strip()
        if raw:
            schemes.setdefault(urlparse(raw).scheme if "://" in raw else "http", raw)
    if len(schemes) > 1:
        first, second = schemes.values()
        raise UsageError(
            f"etcd endpoints mix schemes ({first!r} and {second!r}): all must be http:// "
            "or all https://"
        )
    return next(iter(schemes), "http")


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS files and credentials of etcd connections; the empty one is plaintext, no user.

    ``ca``: the CA certificate etcd's server certificates are checked against (given:
    the connection is TLS). ``cert``/``key``: the client's certificate and key, for
    ``--client-cert-auth``. ``user``/``password``: an etcd user, authenticated at
    connect and again whenever etcd says its token expired. Frozen; the password is
    kept out of ``repr``."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_options(
        cls, ca: str | None, cert: str | None, key: str | None, user: str | None,
        *, environ: Mapping[str, str] | None = None,
    ) -> EtcdSecurity:
        """The options given, each else from its ``HYPERMESH_ETCD_*`` variable in
        ``environ`` (default ``os.environ``), checked: a certificate needs its key (and
        the reverse) and a CA, every file must be readable, a user needs
        ``HYPERMESH_ETCD_PASSWORD``."""
        env = os.environ if environ is None else environ
        ca = ca or env.get(ENV_ETCD_CA) or None
        cert = cert or env.get(ENV_ETCD_CERT) or None
        key = key or env.get(ENV_ETCD_KEY) or None
        user = user or env.get(ENV_ETCD_USER) or None
        if bool(cert) != bool(key):
            given, missing = ("--etcd-cert", "--etcd-key") if cert else ("--etcd-key",
                                                                         "--etcd-cert")
            raise UsageError(f"{given} needs {missing} (the client certificate and its key)")
        if cert and not ca:
            raise UsageError("--etcd-cert needs --etcd-ca (the CA of etcd's server certificate)")
        for option, value in (("--etcd-ca", ca), ("--etcd-cert", cert), ("--etcd-key", key)):
            if value is not None and not (Path(value).is_file() and os.access(value, os.R_OK)):
                raise UsageError(f"{option}: {value} is not a readable file")
        password = None
        if user:
            password = env.get(ENV_ETCD_PASSWORD)
            if not password:
                raise UsageError(
                    f"--etcd-user {user}: set the password in {ENV_ETCD_PASSWORD} "
                    "(it is never an option: options show in ps)"
                )
        return cls(Path(ca) if ca else None, Path(cert) if cert else None,
                   Path(key) if key else None, user, password)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EtcdSecurity:
        """What the ``HYPERMESH_ETCD_*`` variables alone say."""
        return cls.from_options(None, None, None, None, environ=environ)

    @property
    def tls(self) -> bool:
        return self.ca is not None

    def check_scheme(self, urls: str) -> None:
        """``https`` endpoints need ``--etcd-ca``, and the CA needs ``https``."""
        scheme = endpoints_scheme(urls)
        if scheme == "https" and not self.tls:
            raise UsageError(
                f"etcd endpoints {urls!r} are https: give --etcd-ca (or {ENV_ETCD_CA}), the "
                "CA that signed etcd's server certificate (the system's roots are not used)"
            )
        if scheme != "https" and self.tls:
            raise UsageError(
                f"--etcd-ca (or {ENV_ETCD_CA}) is given but the etcd endpoints {urls!r} are "
                "not https://"
            )

    def cleartext_warning(self, endpoints: list[str]) -> str | None:
        """A warning when a password would cross the network in clear: a user over
        plaintext to an endpoint beyond loopback."""

        def loopback(endpoint: str) -> bool:
            host = endpoint.rpartition(":")[0].strip("[]")
            try:
                return host == "localhost" or ipaddress.ip_address(host).is_loopback
            except ValueError:
                return False

        if self.user and not self.tls and not all(loopback(e) for e in endpoints):
            return (f"etcd user {self.user!r}: its password and token cross the network in "
                    "clear; use https:// endpoints and --etcd-ca")
        return None

    def conn_args(self) -> dict[str, bytes]:
        """etcd3aio's TLS keyword arguments (``ca_cert``, ``cert_chain``, ``cert_key``);
        empty for plaintext."""
        if self.ca is None:
            return {}
        args = {"ca_cert": self.ca.read_bytes()}
        if self.cert is not None and self.key is not None:
            args["cert_chain"] = self.cert.read_bytes()
            args["cert_key"] = self.key.read_bytes()
        return args

    def env(self) -> dict[str, str]:
        """The ``HYPERMESH_ETCD_*`` variables that say the same to a child process
        (the password included: only for the mesh's own processes)."""
        out = {}
        for name, value in ((ENV_ETCD_CA, self.ca), (ENV_ETCD_CERT, self.cert),
                            (ENV_ETCD_KEY, self.key)):
            if value is not None:
                out[name] = str(value.absolute())
        if self.user:
            out[ENV_ETCD_USER] = self.user
            out[ENV_ETCD_PASSWORD] = self.password or ""
        return out


def rpc_details(exc: BaseException) -> str:
    """What etcd said in the gRPC error ``exc`` is (or that etcd3aio wrapped)."""
    rpc = exc if isinstance(exc, grpc.aio.AioRpcError) else exc.__cause__
    if isinstance(rpc, grpc.aio.AioRpcError):
        return str(rpc.details() or rpc.code().name)
    return str(exc)


def auth_refusal(exc: BaseException) -> grpc.StatusCode | None:
    """UNAUTHENTICATED or PERMISSION_DENIED when etcd refused a call on auth grounds
    (defragment says so as UNKNOWN "auth: permission denied", a call without a user
    when auth is on as "user name is empty"); None otherwise."""
    rpc = exc if isinstance(exc, grpc.aio.AioRpcError) else exc.__cause__
    if not isinstance(rpc, grpc.aio.AioRpcError):
        return None
    code = rpc.code()
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return code
    details = rpc.details() or ""
    if "authentication failed" in details:  # a wrong user or password: INVALID_ARGUMENT
        return grpc.StatusCode.UNAUTHENTICATED
    if "permission denied" in details or "user name is empty" in details:
        return grpc.StatusCode.PERMISSION_DENIED
    return None


def tls_hint(line: str, tls: bool) -> str:
    """``line`` (why no etcd endpoint answered), with what to check when it looks like
    a TLS mismatch: a failed handshake, or a plaintext client closed on by a TLS etcd."""
    lower = line.lower()
    if "handshake" in lower or "ssl" in lower or "certificate" in lower:
        return (f"TLS handshake failed ({line}): check --etcd-ca, and give --etcd-cert and "
                "--etcd-key if etcd asks for a client certificate")
    if not tls and ("socket closed" in lower or "reset by peer" in lower):
        return f"{line}; if etcd serves TLS, use https:// endpoints and --etcd-ca"
    return line


PLAINTEXT = EtcdSecurity()
"""No TLS, no user: etcd on loopback, tests and benchmarks."""
