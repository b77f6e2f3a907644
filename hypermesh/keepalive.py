"""HTTP/2 keep-alive pings on the connections between agents, and the servers' policy.

An idle TCP connection through a NAT (or a stateful firewall) is dropped from the
NAT's table after its idle timeout without either end hearing of it: the next write
is lost, and the sender waits out TCP's retransmissions (minutes) before it knows.
Timeouts met in practice: AWS NAT gateway 350 s, Azure load balancers and NAT 4 min,
GCP Cloud NAT 20 min for established TCP, home and carrier-grade NATs often 60-300 s.

So every channel an agent opens to a peer (gossip and chunk streams,
``agent/gossip/duty.py``) pings after ``KEEPALIVE_TIME_S`` without traffic, calls in
flight or not: the ping keeps the NAT's mapping fresh, and a ping unanswered within
``KEEPALIVE_TIMEOUT_S`` closes the connection, so the next call reconnects instead of
writing into a dead one (:func:`dead_connection_noticed_within`). 30 s is below every
timeout above with room for one lost ping; it costs one 17-byte PING frame and its
ack per idle connection each 30 s, nothing on a busy one.

A gRPC server answers pings that come more often than its policy allows, or without
calls in flight where it does not permit that, with GOAWAY ``too_many_pings`` after
two strikes, and the client then doubles its interval: the keep-alive would silently
stop. The agent's server therefore permits pings without calls and accepts them down
to ``MIN_PING_INTERVAL_S`` apart (:func:`server_accepts`). Under mutual TLS pings are
inside the TLS session; they change nothing about who may connect.

Channels opened by the CLI (one command, then closed) and the mounts' channel to
their own agent (a Unix socket, or loopback) cross no NAT and keep gRPC's defaults.
"""

from __future__ import annotations

KEEPALIVE_TIME_S = 30.0
"""Seconds without traffic after which a channel between agents sends a PING. Shorter:
NATs with shorter idle timeouts are covered and a dead path is noticed sooner, at the
cost of more idle pings. Must stay at or above ``MIN_PING_INTERVAL_S``."""

KEEPALIVE_TIMEOUT_S = 10.0
"""Seconds a PING may go unanswered before the channel closes the connection (and
reconnects on the next call). Shorter: a dead path is noticed sooner, but a peer busy
for that long (a long GC pause, a saturated link) is disconnected needlessly."""

MIN_PING_INTERVAL_S = 5.0
"""Shortest interval between pings the agent's server accepts on a connection without
data (calls in flight or not); faster pings get GOAWAY ``too_many_pings``. Below
``KEEPALIVE_TIME_S`` with room for clients of other settings, high enough that a
misbehaving peer cannot keep the server busy answering pings."""

Options = tuple[tuple[str, int], ...]


def client_options(time_s: float = KEEPALIVE_TIME_S,
                   timeout_s: float = KEEPALIVE_TIMEOUT_S) -> Options:
    """gRPC channel options: ping after ``time_s`` without traffic, close the connection
    when a ping is unanswered for ``timeout_s``; with no call in flight too, and with no
    limit on pings sent without data (gRPC's default of 2 would stop the keep-alive
    of an idle connection after two pings)."""
    if time_s <= 0 or timeout_s <= 0:
        raise ValueError(f"keep-alive times must be positive, not {time_s}, {timeout_s}")
    return (
        ("grpc.keepalive_time_ms", round(time_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    )


def server_options(min_interval_s: float = MIN_PING_INTERVAL_S) -> Options:
    """gRPC server options: accept pings ``min_interval_s`` apart or more, with or
    without calls in flight (gRPC's defaults: 5 minutes apart, and none at all on a
    connection without calls)."""
    if min_interval_s <= 0:
        raise ValueError(f"min_interval_s must be positive, not {min_interval_s}")
    return (
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", round(min_interval_s * 1000)),
    )


def server_accepts(client_time_s: float, server_min_interval_s: float) -> bool:
    """Whether a server with ``server_min_interval_s`` takes the pings of a client that
    sends them ``client_time_s`` apart without a GOAWAY."""
    return client_time_s >= server_min_interval_s


def dead_connection_noticed_within(time_s: float = KEEPALIVE_TIME_S,
                                   timeout_s: float = KEEPALIVE_TIMEOUT_S) -> float:
    """Seconds, at most, until an idle channel notices its connection is dead (a NAT
    forgot it, the peer's machine vanished): the next ping is due after ``time_s`` and
    given up after ``timeout_s``."""
    return time_s + timeout_s


AGENT_CLIENT_OPTIONS = client_options()
"""Keep-alive options of every channel an agent opens to a peer."""

AGENT_SERVER_OPTIONS = server_options()
"""Keep-alive policy of the agent's gRPC server."""
