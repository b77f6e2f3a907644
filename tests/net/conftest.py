"""Fixtures for tests across hosts: a lab of network namespaces (hypermesh/local/netns.py)
and a mesh on it. Skipped, with the reason, where namespaces cannot be made (no root).

Every lab is closed when its test ends, passed or failed; a session-wide sweep first
removes the namespaces of an earlier run that crashed before it could close its labs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hypermesh.local.netns import NetLab, NetMesh, sweep_leftovers, unavailable


@pytest.fixture(scope="session")
def netns_ok() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    sweep_leftovers()


@pytest.fixture
def lab(netns_ok: None) -> Iterator[NetLab]:
    with NetLab() as made:
        yield made


@pytest.fixture
def net_mesh(lab: NetLab, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[NetMesh]:
    """etcd, a CLI host and (added by the test) agents, each in its own host; lease TTL
    of the ``local`` preset (3 s)."""
    mesh = NetMesh(lab, tmp_path)
    try:
        mesh.start_etcd()
        yield mesh
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(mesh.logs())
        mesh.close()
