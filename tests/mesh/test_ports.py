"""Ports of local servers: drawn where no outgoing connection can take them meanwhile,
and drawn again when another process took one before the server bound it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hypermesh.local import processes
from hypermesh.local.etcd import EtcdCluster, EtcdServer
from hypermesh.local.processes import free_port
from hypermesh.local.s3server import S3Server


def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_bound() -> None:
    low, _ = processes._ephemeral_range()
    for _ in range(50):
        port = free_port()
        assert processes._PORTS_FLOOR <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(processes, "_ephemeral_range", lambda: (taken + 1, 60999))
        monkeypatch.setattr(processes, "_PORTS_FLOOR", taken - 999)
        draws = {free_port() for _ in range(300)}
    assert taken not in draws
    assert all(taken - 999 <= p <= taken for p in draws)


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "_ephemeral_range", lambda: (1024, 65535))
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_first_start_whose_port_was_taken_tries_fresh_ports_and_a_restart_does_not(
    tmp_path: Path,
) -> None:
    # Another process binds one of the server's ports between free_port and weed's bind.
    server = S3Server(tmp_path / "s3")
    drawn = dict(server.ports)
    with socket.create_server(("127.0.0.1", drawn["filer.port.grpc"])):
        try:
            server.start()
            assert server.ports != drawn and server.proc is not None
            assert "address already in use" in server.log_path.read_text()
            server.make_bucket("after")  # it serves, on its new ports
            server.stop()
            with socket.create_server(("127.0.0.1", server.ports["filer.port.grpc"])):
                kept = dict(server.ports)
                with pytest.raises(RuntimeError, match="address already in use"):
                    server.start()
                assert server.ports == kept and server.proc is None
        finally:
            server.stop()


def test_an_etcd_whose_port_was_taken_starts_on_fresh_ports_and_a_restart_does_not(
    tmp_path: Path,
) -> None:
    server = EtcdServer(tmp_path / "etcd", fsync=False)
    drawn = server.client_port
    with socket.create_server(("127.0.0.1", drawn)):
        try:
            server.start()
            assert server.client_port != drawn and server.proc is not None
            assert "address already in use" in server.log_path.read_text()
            assert server.healthy()
            server.stop()
            with socket.create_server(("127.0.0.1", server.peer_port)):
                kept = (server.client_port, server.peer_port)
                with pytest.raises(RuntimeError, match="address already in use"):
                    server.start()
                assert (server.client_port, server.peer_port) == kept and server.proc is None
        finally:
            server.stop()


def test_an_etcd_cluster_whose_peer_port_was_taken_starts_afresh_on_fresh_ports(
    tmp_path: Path,
) -> None:
    cluster = EtcdCluster(tmp_path / "etcd", size=3)
    drawn = [(m.client_port, m.peer_port) for m in cluster.members]
    with socket.create_server(("127.0.0.1", cluster.members[2].peer_port)):
        try:
            cluster.start()
            now = [(m.client_port, m.peer_port) for m in cluster.members]
            assert not set(now) & set(drawn)
            assert all(m.healthy() for m in cluster.members)
            assert "address already in use" in cluster.members[2].log_path.read_text()
        finally:
            cluster.stop()
