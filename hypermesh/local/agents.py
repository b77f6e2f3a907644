"""Agent processes on this machine: ``hypermesh agent start`` as children, found and stopped.

Every process started is stopped by ``terminate()``/``kill()``; ``mesh_agents`` also finds
those a leader's ``local`` provisioner started, so a test can stop them too.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil

from hypermesh.local.processes import stop_process, unmount_under, wait_for


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
            try:  # written whole, ending in a newline, once the agent is registered
                return address_file.read_text().endswith("\n")
            except FileNotFoundError:
                return False

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
        code = stop_process(self.proc, timeout)
        self.proc = None
        unmount_under(self.work_dir)  # the agent unmounts its own; this catches a stuck one
        return code

    def kill(self) -> None:
        """SIGKILL the agent alone (no drain, no lease revoke); its lifeline then kills its
        tasks (``agent/tasks/lifeline.py``), as on a machine whose agent died."""
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
