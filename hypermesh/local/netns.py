"""Hosts on a real (virtual) network: network namespaces joined by a bridge, links to cut.

A :class:`NetLab` builds a *switch* namespace holding one bridge, and one namespace per
host (``etcd``, ``onprem``, ``cloud-a`` ...), each joined to the bridge by a veth pair
whose two ends are created directly inside the two namespaces: nothing is added to, or
routed in, the namespace the caller runs in. Every host has its own private address
(``10.x.y.z/24``) and its loopback up; processes run inside a host through
``ip netns exec`` (it execs, so the pid returned is the program's own).

Faults, each with its heal:

- :meth:`NetLab.cut_off` sets the host's switch port down: the host loses carrier and
  nothing reaches it or leaves it, in either direction, as when its uplink fails;
- :meth:`NetLab.cut` adds, in each of two hosts, a blackhole route for the other's
  address: both directions between those two, and only those, fail;
- :meth:`NetLab.cut_one_way` adds that route on one side only. ``cut_one_way(a, b)``:
  whatever ``a`` sends to ``b`` is dropped (a connect or a send from ``a`` fails at once
  with EINVAL), while ``b``'s packets still reach ``a``. Datagrams from ``b`` arrive;
  a TCP connection from ``b`` does not come up either (``a``'s replies are dropped), so
  for TCP, and gRPC, a one-way cut is a silent cut in both directions seen from ``b``.

Everything made is recorded; :meth:`NetLab.close` (also the context manager's exit)
stops the processes started here, kills whatever else still runs inside the lab's
namespaces (task processes of an agent) and deletes the namespaces, which takes their
veths and the bridge with them. ``close`` is idempotent. Namespace names carry a marker,
the creating pid and a random suffix (``hmnet-<pid>-<hex>-<host>``), so labs never
collide and :func:`sweep_leftovers` can remove those of a process that died without
closing. Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2; :func:`unavailable`
says why a lab cannot be made here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypermesh.local.agents import AgentProcess, hypermesh_command
from hypermesh.local.etcd import etcd_binary, etcdctl_binary
from hypermesh.local.processes import stop_process, wait_for
from hypermesh.local.s3server import S3Server

MARKER = "hmnet"  # every namespace a lab makes starts with "hmnet-<pid>-"
SWITCH_IF = "br0"  # the bridge, inside the switch namespace
HOST_IF = "eth0"  # a host's end of its veth, inside the host's namespace
ETCD_PORT = 2379
ETCD_PEER_PORT = 2380
AGENT_PORT = 7070


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise with its stderr when ``check`` and it fails."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def unavailable() -> str | None:
    """Why a lab cannot be built on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{MARKER}-{os.getpid()}-probe{secrets.token_hex(3)}"
    try:
        made = ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        veth = ip("-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb",
                  check=False)
        if veth.returncode != 0:
            return f"cannot make a veth pair: {veth.stderr.strip()}"
    except FileNotFoundError:
        return "iproute2 (ip) is not installed"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still running in namespace ``ns`` (it was made here)."""
    for pid in ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def sweep_leftovers() -> list[str]:
    """Delete the namespaces of labs whose creating process is gone (a crashed run);
    returns their names. Labs of running processes are left alone."""
    swept = []
    for ns in namespaces():
        parts = ns.split("-")
        if len(parts) < 3 or parts[0] != MARKER or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid != os.getpid() and Path(f"/proc/{pid}").exists():
            continue
        _kill_inside(ns)
        ip("netns", "del", ns, check=False)
        swept.append(ns)
    return swept


@dataclass
class Host:
    """One namespace on the lab's bridge: its name, namespace, address and switch port."""

    name: str
    ns: str
    address: str
    port: str  # its veth end in the switch namespace


@dataclass
class NetLab:
    """A switch and hosts in network namespaces of their own; see the module docstring.

    Owned by one thread; every method but :meth:`close` raises once the lab is closed.
    """

    subnet: str = "10.77.0"  # hosts get SUBNET.10, SUBNET.11, ... /24
    lab_id: str = field(default_factory=lambda: f"{MARKER}-{os.getpid()}-{secrets.token_hex(3)}")
    hosts: dict[str, Host] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)  # namespaces, in creation order
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _routes: set[tuple[str, str]] = field(default_factory=set)  # (in host, to host)
    _down: set[str] = field(default_factory=set)
    _closed: bool = False

    def __post_init__(self) -> None:
        if not (self.subnet.startswith("10.") and self.subnet.count(".") == 2):
            raise ValueError(f"subnet must be the first three octets of a 10.x address, "
                             f"not {self.subnet!r}")
        self.switch = self._namespace("switch")
        try:
            ip("-n", self.switch, "link", "add", SWITCH_IF, "type", "bridge")
            ip("-n", self.switch, "link", "set", SWITCH_IF, "up")
            ip("-n", self.switch, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def _namespace(self, name: str) -> str:
        ns = f"{self.lab_id}-{name}"
        ip("netns", "add", ns)
        self._made.append(ns)
        return ns

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError(f"lab {self.lab_id} is closed")

    # -- building ---------------------------------------------------------------------

    def add_host(self, name: str) -> Host:
        """A new host on the bridge with the next free address; its loopback is up."""
        self._live()
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = len(self.hosts)
        if index > 200:
            raise ValueError("a lab holds at most 200 hosts")
        host = Host(name, self._namespace(name), f"{self.subnet}.{10 + index}", f"p{index}")
        ip("link", "add", host.port, "netns", self.switch, "type", "veth",
           "peer", "name", HOST_IF, "netns", host.ns)
        ip("-n", self.switch, "link", "set", host.port, "master", SWITCH_IF)
        ip("-n", self.switch, "link", "set", host.port, "up")
        ip("-n", host.ns, "addr", "add", f"{host.address}/24", "dev", HOST_IF)
        ip("-n", host.ns, "link", "set", HOST_IF, "up")
        ip("-n", host.ns, "link", "set", "lo", "up")
        self.hosts[name] = host
        return host

    def address(self, name: str) -> str:
        return self.hosts[name].address

    # -- running ----------------------------------------------------------------------

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``name`` (``ip netns exec`` execs: same pid)."""
        return ["ip", "netns", "exec", self.hosts[name].ns, *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside host ``name``; ``close`` stops it."""
        self._live()
        proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            self.command(name, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], *, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside host ``name`` to its end; its output as text."""
        self._live()
        return subprocess.run(self.command(name, argv), capture_output=True, text=True,
                              timeout=timeout, env=env)

    def connects(self, src: str, dst: str, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from ``src`` reaches ``dst``'s kernel: a refused
        connection (no one listens on port 9) counts as reached, a timeout or a local
        routing error does not."""
        code = (
            "import socket,sys\n"
            "s=socket.socket()\n"
            f"s.settimeout({timeout})\n"
            f"try: s.connect(({self.address(dst)!r}, 9))\n"
            "except ConnectionRefusedError: sys.exit(0)\n"
            "except OSError: sys.exit(1)\n"
        )
        return self.run(src, [sys.executable, "-c", code], timeout=timeout + 20).returncode == 0

    def datagram_arrives(self, src: str, dst: str, timeout: float = 1.0) -> bool:
        """Whether a UDP datagram sent from ``src`` arrives at ``dst``."""
        port = 9999
        listen = (
            "import socket,sys\n"
            "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
            f"s.bind(({self.address(dst)!r},{port}))\n"
            f"s.settimeout({timeout + 2})\n"
            "print('ready',flush=True)\n"
            "try: s.recvfrom(64)\n"
            "except OSError: sys.exit(1)\n"
        )
        receiver = subprocess.Popen(self.command(dst, [sys.executable, "-c", listen]),
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout is not None
            receiver.stdout.readline()  # bound
            send = (
                "import socket\n"
                "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                f"try: s.sendto(b'x',({self.address(dst)!r},{port}))\n"
                "except OSError: pass\n"
            )
            self.run(src, [sys.executable, "-c", send], timeout=20)
            return receiver.wait(timeout + 20) == 0
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()

    # -- faults -----------------------------------------------------------------------

    def cut_off(self, name: str) -> None:
        """Cut host ``name`` off from every other host (its switch port down)."""
        self._live()
        ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")
        self._down.add(name)

    def heal_off(self, name: str) -> None:
        ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")
        self._down.discard(name)
        # Neighbours the cut left FAILED would be retried only on ARP's own clock (1 s).
        for host in self.hosts.values():
            ip("-n", host.ns, "neigh", "flush", "all", check=False)

    def cut_one_way(self, src: str, dst: str) -> None:
        """Drop what ``src`` sends to ``dst`` (a blackhole route in ``src``)."""
        self._live()
        if (src, dst) not in self._routes:
            ip("-n", self.hosts[src].ns, "route", "add", "blackhole",
               f"{self.address(dst)}/32")
            self._routes.add((src, dst))

    def heal_one_way(self, src: str, dst: str) -> None:
        if (src, dst) in self._routes:
            ip("-n", self.hosts[src].ns, "route", "del", "blackhole",
               f"{self.address(dst)}/32", check=False)
            self._routes.discard((src, dst))

    def cut(self, a: str, b: str) -> None:
        """Cut ``a`` from ``b`` only, both directions; each keeps its other links."""
        self.cut_one_way(a, b)
        self.cut_one_way(b, a)

    def heal(self, a: str, b: str) -> None:
        self.heal_one_way(a, b)
        self.heal_one_way(b, a)

    def heal_all(self) -> None:
        for src, dst in sorted(self._routes):
            self.heal_one_way(src, dst)
        for name in sorted(self._down):
            self.heal_off(name)

    # -- teardown ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop what runs in the lab and delete every namespace it made (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            with contextlib.suppress(OSError):
                stop_process(proc, 5)
        for ns in reversed(self._made):
            _kill_inside(ns)
        for ns in reversed(self._made):
            # A namespace's processes may take a moment to die; `del` works regardless
            # (the name goes; the namespace itself goes with its last process).
            ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NetMesh:
    """etcd, agents and a CLI host on a :class:`NetLab`, plaintext gRPC (``--insecure``).

    etcd runs alone in host ``etcd``, listening on its lab address, or, with
    ``etcd_members=3``, as a cluster of three members in hosts ``etcd-1`` .. ``etcd-3``
    that talk to each other over the lab (peer URLs on their addresses); agents and the
    CLI are given every member's client URL. With ``store``, SeaweedFS serves S3 from
    host ``store`` on its address (:meth:`start_store`), and agents and the CLI get the
    variables that point them at it. Each agent runs in a host of its own, named after
    it, listening on that host's address; the CLI runs in host ``client``. ``close``
    stops the agents (drain, then kill), etcd and the store, then the lab.
    """

    def __init__(self, lab: NetLab, root: Path, *, namespace: str = "net",
                 preset: str = "local", agent_args: Sequence[str] = (),
                 etcd_members: int = 1, store: bool = False) -> None:
        if etcd_members not in (1, 3, 5):
            raise ValueError(f"etcd_members must be 1, 3 or 5, not {etcd_members}")
        self.lab = lab
        self.root = Path(root)
        self.namespace = namespace
        self.preset = preset
        self.agent_args = list(agent_args)
        self.agents: dict[str, AgentProcess] = {}
        self.etcd_hosts = (["etcd"] if etcd_members == 1
                           else [f"etcd-{i}" for i in range(1, etcd_members + 1)])
        self.etcds: dict[str, subprocess.Popen[bytes]] = {}  # host: its etcd member
        self.store: S3Server | None = None
        for name in (*self.etcd_hosts, *(["store"] if store else []), "client"):
            if name not in lab.hosts:
                lab.add_host(name)

    def etcd_member_url(self, host: str) -> str:
        return f"http://{self.lab.address(host)}:{ETCD_PORT}"

    @property
    def etcd_url(self) -> str:
        """Every member's client URL, comma-separated (``--etcd`` takes the list)."""
        return ",".join(self.etcd_member_url(h) for h in self.etcd_hosts)

    @property
    def env(self) -> dict[str, str]:
        store = self.store.client_env() if self.store is not None else {}
        return dict(os.environ, HYPERMESH_ETCD=self.etcd_url,
                    HYPERMESH_NAMESPACE=self.namespace, **store)

    def start_etcd(self, timeout: float = 30) -> None:
        """Start every member, each in its own host, and wait until all are healthy."""
        cluster = ",".join(f"{h}=http://{self.lab.address(h)}:{ETCD_PEER_PORT}"
                           for h in self.etcd_hosts)
        for host in self.etcd_hosts:
            data = self.root / host
            data.mkdir(parents=True, exist_ok=True)
            url = self.etcd_member_url(host)
            peer = f"http://{self.lab.address(host)}:{ETCD_PEER_PORT}"
            args = [etcd_binary(), "--name", host, "--data-dir", str(data / "data"),
                    "--listen-client-urls", url, "--advertise-client-urls", url,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", cluster, "--initial-cluster-token", self.lab.lab_id,
                    "--unsafe-no-fsync", "--experimental-enable-lease-checkpoint",
                    "--log-level", "warn"]
            with open(data / "etcd.log", "ab") as log:
                self.etcds[host] = self.lab.popen(host, args, stdout=log,
                                                  stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL)

        def healthy() -> bool:
            for host, proc in self.etcds.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"etcd member {host} exited with {proc.returncode}")
            check = self.lab.run("client", [etcdctl_binary(), "--endpoints", self.etcd_url,
                                            "--dial-timeout", "1s", "endpoint", "health"])
            return check.returncode == 0

        wait_for(healthy, timeout, f"etcd at {self.etcd_url}", interval=0.2)

    def etcd_leader(self) -> str | None:
        """The host of the etcd member that leads the cluster, as the members answer
        ``etcdctl endpoint status`` from host ``client`` (None: no answer names one)."""
        for host in self.etcd_hosts:  # one at a time: a cut member answers nothing
            status = self.lab.run("client", [
                etcdctl_binary(), "--endpoints", self.etcd_member_url(host),
                "--dial-timeout", "1s", "--command-timeout", "2s",
                "endpoint", "status", "-w", "json"])
            with contextlib.suppress(ValueError, KeyError, TypeError):
                for member in json.loads(status.stdout or "[]"):
                    header, leader = member["Status"]["header"], member["Status"]["leader"]
                    if header["member_id"] == leader:
                        return host
        return None

    def start_store(self, bucket: str = "hypermesh-net", timeout: float = 60) -> str:
        """SeaweedFS in host ``store``, on its address; creates ``bucket`` and returns
        its ``s3://`` URL. Readiness (a bucket made, an object written and read back)
        is checked from host ``client``, across the lab."""
        if "store" not in self.lab.hosts:
            raise RuntimeError("this mesh was made without store=True")
        server = S3Server(self.root / "store", ip=self.lab.address("store"))
        server.data_dir.mkdir(parents=True, exist_ok=True)
        (server.data_dir / "data").mkdir(exist_ok=True)
        with open(server.log_path, "ab") as log:
            server.proc = self.lab.popen("store", server.command(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=server.data_dir, start_new_session=True)
        self.store = server
        probe = (
            "import os, sys, boto3\n"
            "from botocore.config import Config\n"
            "from botocore.exceptions import BotoCoreError, ClientError\n"
            "c = boto3.client('s3', endpoint_url=os.environ['HYPERMESH_S3_ENDPOINT'],\n"
            "    config=Config(connect_timeout=2, read_timeout=5, retries={'max_attempts': 1},\n"
            "                  s3={'addressing_style': 'path'},\n"
            "                  request_checksum_calculation='when_required',\n"
            "                  response_checksum_validation='when_required'))\n"
            "try:\n"
            "    try: c.create_bucket(Bucket=sys.argv[1])\n"
            "    except ClientError: pass\n"
            "    c.put_object(Bucket=sys.argv[1], Key='probe', Body=b'ok')\n"
            "    sys.exit(c.get_object(Bucket=sys.argv[1], Key='probe')['Body'].read() != b'ok')\n"
            "except (BotoCoreError, ClientError): sys.exit(1)\n"
        )

        def ready() -> bool:
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited:\n{server.log_tail()}")
            return self.lab.run("client", [sys.executable, "-c", probe, bucket],
                                env=self.env, timeout=30).returncode == 0

        wait_for(ready, timeout, f"SeaweedFS at {server.endpoint}", interval=0.5)
        return server.url(bucket)

    def add_agent(self, name: str, *, slots: int = 2, extra: Sequence[str] = (),
                  env: dict[str, str] | None = None) -> AgentProcess:
        """An agent in a new host ``name``, listening on that host's address; ``env``:
        more environment variables (the store's, when there is one, are given)."""
        if name not in self.lab.hosts:
            self.lab.add_host(name)
        agent = AgentProcess(
            name, self.etcd_url, self.namespace, self.root / name, slots=slots,
            extra=["--listen", f"{self.lab.address(name)}:{AGENT_PORT}", "--insecure",
                   "--preset", self.preset, *self.agent_args, *extra],
            env=dict(self.env, **(env or {})),
        )  # the later --listen and --preset win over AgentProcess's loopback defaults
        agent.args = self.lab.command(name, agent.args)
        self.agents[name] = agent
        agent.start()
        return agent

    def hm(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """The CLI, run in host ``client``."""
        return self.lab.run("client", [*hypermesh_command(), *args], timeout=timeout,
                            env=self.env)

    def hm_json(self, *args: str) -> Any:
        for _ in range(3):  # a CLI that failed to start (a file being edited) is run again
            result = self.hm(*args, "--json")
            if result.returncode == 0 or "Traceback" not in result.stderr:
                break
            time.sleep(1)
        if result.returncode != 0:
            raise RuntimeError(f"hypermesh {' '.join(args)}: {result.stderr.strip()}")
        return json.loads(result.stdout)

    def submit(self, recipe: Path) -> str:
        result = self.hm("submit", str(recipe))
        if result.returncode != 0:
            raise RuntimeError(f"submit failed: {result.stderr.strip()}")
        return result.stdout.split()[-1]

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{a.log_tail()}" for n, a in self.agents.items())

    def close(self) -> None:
        self.lab.heal_all()  # a cut-off agent drains quicker when it can reach etcd
        for agent in self.agents.values():
            if agent.proc is not None and agent.alive:
                with contextlib.suppress(ProcessLookupError):
                    agent.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for agent in self.agents.values():
            agent.terminate(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.etcds.values():
            stop_process(proc, 10)
        self.etcds.clear()
        if self.store is not None:
            self.store.stop()
            self.store = None
        self.lab.close()

    def __enter__(self) -> NetMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
