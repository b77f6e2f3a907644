"""A real container registry on loopback: Debian's ``docker-registry`` (the CNCF distribution
registry) on a free port of 127.0.0.1, storing its blobs in a folder of its own.

It speaks plain HTTP, as a registry on loopback may. Clients are told so by a
``registries.conf`` of the test's own (``registries_conf``: the variable
``CONTAINERS_REGISTRIES_CONF`` points podman at it), never by the machine's configuration.
``stop()`` and the context manager stop the server, also when the caller fails; ``pause`` and
``resume`` (SIGSTOP, SIGCONT) make a registry that is down without losing what it holds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

from hypermesh.local.processes import free_port, stop_process, wait_for

_CONFIG = """\
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


class Registry:
    """One registry server with its own storage folder under ``base``."""

    def __init__(self, base: Path, port: int | None = None) -> None:
        self.base = Path(base)
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, the first part of the references it serves."""
        return f"127.0.0.1:{self.port}"

    def registries_conf(self) -> Path:
        """A registries.conf that marks this registry insecure (plain HTTP), for
        ``CONTAINERS_REGISTRIES_CONF``."""
        path = self.base / "registries.conf"
        path.write_text(f'[[registry]]\nlocation = "{self.address}"\ninsecure = true\n')
        return path

    def start(self) -> Registry:
        binary = shutil.which("docker-registry")
        if binary is None:
            raise FileNotFoundError("no docker-registry: bash scripts/setup.sh installs it")
        self.base.mkdir(parents=True, exist_ok=True)
        config = self.base / "config.yml"
        config.write_text(_CONFIG.format(root=self.base / "storage", port=self.port))
        log = open(self.base / "registry.log", "ab")  # noqa: SIM115 (the child holds it)
        try:
            self.proc = subprocess.Popen([binary, "serve", os.fspath(config)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        try:
            wait_for(self._answers, timeout=20, what=f"the registry on {self.address}")
        except BaseException:
            self.stop()
            raise
        return self

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited: {self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def log_tail(self) -> str:
        try:
            return (self.base / "registry.log").read_text()[-2000:]
        except OSError:
            return ""

    def pause(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()
            stop_process(self.proc, timeout=5)
            self.proc = None

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
