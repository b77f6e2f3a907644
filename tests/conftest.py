"""Shared fixtures: one real etcd and one real S3 server (SeaweedFS) per test session,
real agent processes per test.

Each test gets its own namespace (etcd) and its own prefix in one bucket (S3), so tests
share the servers but never each other's keys. Every process a fixture starts is
stopped when the test ends, passed or failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from hypermesh.chunkfs.store import S3Store
from hypermesh.local.agents import AgentProcess, mesh_agents, stop_all
from hypermesh.local.etcd import EtcdServer
from hypermesh.local.images import python_image
from hypermesh.local.processes import unmount_under, wait_for
from hypermesh.local.registry import Registry
from hypermesh.local.s3server import S3Server
from hypermesh.state.keyspace import TaskRef
from tests import leftover_containers

# All tests share one bucket: SeaweedFS gives every bucket its own volumes, so a
# bucket per test would run the server out of volumes.
TEST_BUCKET = "hypermesh-test"


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd"), fsync=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS S3 server for the session; the client variables are set in os.environ."""
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        server.make_bucket(TEST_BUCKET)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in server.client_env().items():
                mp.setenv(key, value)
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def container_image() -> str:
    """An image built here (busybox, bash and this machine's Python: hypermesh/local/images.py),
    in podman's store; its reference."""
    return python_image()


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A real registry (docker-registry) on loopback for the session. Clients find it through
    ``CONTAINERS_REGISTRIES_CONF`` (set in os.environ here: plain HTTP on loopback), so agents
    started afterwards inherit it."""
    server = Registry(tmp_path_factory.mktemp("registry"))
    server.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CONTAINERS_REGISTRIES_CONF", str(server.registries_conf()))
            yield server
    finally:
        server.stop()


@pytest.fixture
def store_url(s3_server: S3Server) -> str:
    """A fresh, empty ``s3://`` store URL (its own prefix) on the session's server."""
    return s3_server.url(TEST_BUCKET, f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def store(s3_server: S3Server, store_url: str) -> Iterator[S3Store]:
    """An ``S3Store`` on a fresh prefix of the session's S3 server."""
    prefix = store_url.removeprefix(f"s3://{TEST_BUCKET}/")
    s = S3Store(TEST_BUCKET, prefix, endpoint=s3_server.endpoint)
    try:
        yield s
    finally:
        s.close()


class Mesh:
    """A namespace on the session's etcd, its agents, and a CLI runner."""

    def __init__(self, etcd: EtcdServer, root: Path) -> None:
        self.etcd = etcd
        self.root = root
        self.namespace = f"t{uuid.uuid4().hex[:10]}"
        self.agents: dict[str, AgentProcess] = {}

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, HYPERMESH_ETCD=self.etcd.url, HYPERMESH_NAMESPACE=self.namespace)

    def agent(
        self, name: str = "node1", *, slots: int = 2, extra: tuple[str, ...] = ()
    ) -> AgentProcess:
        proc = AgentProcess(
            name, self.etcd.url, self.namespace, self.root / name, slots=slots, extra=extra
        )
        self.agents[name] = proc
        proc.start()
        return proc

    def hm(
        self, *args: str, timeout: float = 60, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run the CLI as a user would; returns the finished process."""
        result = subprocess.run(
            [sys.executable, "-m", "hypermesh", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"hypermesh {' '.join(args)} exited {result.returncode}:\n{result.stderr}"
            )
        return result

    def hm_json(self, *args: str) -> Any:
        return json.loads(self.hm(*args, "--json", check=True).stdout)

    def write_recipe(self, text: str, name: str = "recipe.yaml") -> Path:
        path = self.root / name
        path.write_text(text)
        return path

    def submit(self, recipe: Path, *extra: str) -> str:
        result = self.hm("submit", str(recipe), *extra, check=True)
        return result.stdout.split()[-1]

    def wait_state(self, wid: str, states: set[str], timeout: float = 60) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            status = self.hm_json("status", wid)
            return status if status["state"] in states else None

        return wait_for(done, timeout, f"workflow {wid} to reach {states}", interval=0.2)  # type: ignore[return-value]

    def close(self) -> None:
        for proc in self.agents.values():  # all drain at once, not one after the other
            if proc.proc is not None and proc.alive:
                with contextlib.suppress(ProcessLookupError):
                    proc.proc.send_signal(signal.SIGTERM)
        for proc in self.agents.values():
            proc.terminate(timeout=20)
        # Agents no test started by hand: a leader's `local` provisioner may have started
        # one after a fixture stopped the ones it knew of, while the leader still ran.
        stop_all(mesh_agents(self.etcd.url, self.namespace), timeout=15)
        unmount_under(self.root)  # whatever a killed agent's mounts left behind

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{a.log_tail()}" for n, a in self.agents.items())


@pytest.fixture
def mesh(etcd_server: EtcdServer, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Mesh]:
    m = Mesh(etcd_server, tmp_path)
    try:
        yield m
    finally:
        m.close()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(m.logs())


@pytest.fixture(autouse=True)
def no_containers_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test that leaves a container of its agents (labelled under its ``tmp_path``),
    after removing it. Torn down last, once the test's agents have stopped; podman is asked
    only where an agent ran (tests/leftover_containers.py)."""
    yield
    root = request.node.funcargs.get("tmp_path")
    left = leftover_containers.left_by_test(root) if root is not None else []
    if left:
        pytest.fail(f"containers left by this test (removed): {leftover_containers.describe(left)}")


_CONTAINERS_BEFORE = pytest.StashKey[set[str]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller, or a run without xdist
        try:
            before = {c["Id"] for c in leftover_containers.containers()}
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:  # a broken podman
            print(f"no container check at the session's end: {exc}", file=sys.stderr)
            return
        session.config.stash[_CONTAINERS_BEFORE] = before


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The controller's last word: no container this run made may be left (by a test, or by
    a fixture outside any test's folder)."""
    before = session.config.stash.get(_CONTAINERS_BEFORE, None)
    if before is None:
        return
    basetemp = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    left = leftover_containers.new_since(before, basetemp)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = ("CONTAINERS LEFT BY THIS RUN (podman ps -a): "
                   + leftover_containers.describe(left))
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
        else:
            print(message, file=sys.stderr)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)


def task_pid(agent: AgentProcess, task_id: str, attempt: int = 1, timeout: float = 30) -> int:
    """The pid a test task wrote to ``$HM_ATTEMPT_DIR/pid``, once it has started."""
    ref = TaskRef.parse(task_id)
    folder = f"{ref.experiment}.{ref.index}.{attempt}"
    pid_file = agent.work_dir / "attempts" / ref.workflow / folder / "pid"
    wait_for(
        lambda: pid_file.exists() and pid_file.read_text().strip(),
        timeout,
        f"{task_id} attempt {attempt} to start on {agent.name}",
    )
    return int(pid_file.read_text())


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting to be reaped counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
