"""Keep-alive pings between agents (``hypermesh/keepalive.py``): the timing rules, and a
real agent's server taking an idle channel's pings where gRPC's default policy answers
them with GOAWAY ``too_many_pings``."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from hypermesh import keepalive
from hypermesh.agent.gossip.duty import CHANNEL_OPTIONS, DATA_CHANNEL_OPTIONS
from tests.conftest import Mesh


@pytest.mark.parametrize(
    ("client_s", "server_s", "accepted"),
    [(30, 5, True), (5, 5, True), (4.9, 5, False), (30, 300, False)],  # 300: gRPC's default
)
def test_server_accepts(client_s: float, server_s: float, accepted: bool) -> None:
    assert keepalive.server_accepts(client_s, server_s) is accepted


@pytest.mark.parametrize(
    ("time_s", "timeout_s", "noticed_s"), [(30, 10, 40), (1, 1, 2), (120, 20, 140)]
)
def test_dead_connection_noticed_within(time_s: float, timeout_s: float, noticed_s: float) -> None:
    assert keepalive.dead_connection_noticed_within(time_s, timeout_s) == noticed_s


def test_the_chosen_values() -> None:
    # The agents' own clients are accepted by the agents' servers ...
    assert keepalive.server_accepts(keepalive.KEEPALIVE_TIME_S, keepalive.MIN_PING_INTERVAL_S)
    # ... and an idle connection is pinged, and a dead one noticed, well within the
    # shortest NAT idle timeout of those the module names (60 s).
    assert keepalive.dead_connection_noticed_within() <= 60
    # Every channel an agent opens to a peer carries them.
    for options in (CHANNEL_OPTIONS, DATA_CHANNEL_OPTIONS):
        assert set(keepalive.AGENT_CLIENT_OPTIONS) <= set(options)


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError):
        keepalive.client_options(0, 10)
    with pytest.raises(ValueError):
        keepalive.server_options(-1)


READY = grpc.ChannelConnectivity.READY


async def connect_and_watch(channel: grpc.aio.Channel, states: list[grpc.ChannelConnectivity]
                            ) -> None:
    """Connect ``channel``, then record every state it goes through from READY on."""
    await asyncio.wait_for(channel.channel_ready(), 10)
    state = channel.get_state()
    while True:
        states.append(state)
        await channel.wait_for_state_change(state)
        state = channel.get_state()


def test_an_idle_channel_keeps_its_connection_to_an_agent(mesh: Mesh) -> None:
    """An idle channel pinging a real agent every 6 s (the fastest the agent accepts is
    every ``MIN_PING_INTERVAL_S``) stays connected through several pings; the same
    channel to a gRPC server of default policy is sent away at its fourth ping (the
    third strike). Both run at once, so the pings are shown to be sent."""
    ping_s = keepalive.MIN_PING_INTERVAL_S + 1
    options = keepalive.client_options(ping_s, 5)
    agent = mesh.agent("node1")

    async def main() -> tuple[list[grpc.ChannelConnectivity], list[grpc.ChannelConnectivity]]:
        plain = grpc.aio.server()
        port = plain.add_insecure_port("127.0.0.1:0")
        await plain.start()
        to_agent = grpc.aio.insecure_channel(agent.address, options=options)
        to_plain = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
        agent_states: list[grpc.ChannelConnectivity] = []
        plain_states: list[grpc.ChannelConnectivity] = []
        watchers = [asyncio.create_task(connect_and_watch(to_agent, agent_states)),
                    asyncio.create_task(connect_and_watch(to_plain, plain_states))]
        try:
            # gRPC's default: no pings without calls; the third strike (fourth ping)
            # brings GOAWAY, and the channel leaves READY.
            deadline = time.monotonic() + 5 * ping_s + 10
            while plain_states[1:] == [] and time.monotonic() < deadline:
                for w in watchers:
                    if w.done():
                        w.result()  # a failed connect fails the test
                await asyncio.sleep(0.2)
            # By then the agent's channel was pinged as often: one more ping to be sure.
            end = time.monotonic() + ping_s
            while agent_states[1:] == [] and time.monotonic() < end:
                await asyncio.sleep(0.2)
        finally:
            for w in watchers:
                w.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            await to_agent.close()
            await to_plain.close()
            await plain.stop(None)
        return agent_states, plain_states

    agent_states, plain_states = asyncio.run(main())
    assert plain_states[:1] == [READY] and len(plain_states) > 1, (
        f"the default server never sent the pinging channel away: {plain_states}")
    assert agent_states == [READY], agent_states  # connected all along
