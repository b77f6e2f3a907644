"""agent/gossip/link.py against a real gRPC server in another process."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import grpc

from hypermesh.agent.gossip.link import PeerLink

SERVER = textwrap.dedent("""
    import asyncio, grpc
    from hypermesh.local.processes import free_port
    from hypermesh._proto import agent_pb2, agent_pb2_grpc

    class Echo(agent_pb2_grpc.AgentServicer):
        async def GossipStream(self, packets, context):
            async for packet in packets:
                yield agent_pb2.GossipAck(replies=[packet.payload])

    async def main():
        server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServicer_to_server(Echo(), server)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())
""")


@contextlib.contextmanager
def echo_server() -> Iterator[subprocess.Popen[str]]:
    """A gossip echo server in a process of its own; its port is on its first line. The
    port lies below the ephemeral range: once the server is killed, no other server of a
    busy suite binding port 0 is handed it while a test counts on its refusal."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        yield server
    finally:
        server.kill()
        server.wait(10)


def port_of(server: subprocess.Popen[str]) -> int:
    assert server.stdout is not None
    return int(server.stdout.readline())


async def _wait(event: asyncio.Event, what: str, timeout: float = 10.0) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        raise AssertionError(f"no {what} within {timeout} s") from None


def test_a_peer_process_killed_breaks_the_stream_and_the_link_says_so() -> None:
    async def run() -> None:
        with echo_server() as server:
            port = port_of(server)
            replied, broken, failed = asyncio.Event(), asyncio.Event(), []
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                link = PeerLink(channel, 2.0, lambda payload: replied.set(),
                                lambda tag, was_refused: failed.append((tag, was_refused)),
                                broken.set)
                link.send("ping", b"hello")
                await _wait(replied, "echo")
                assert not broken.is_set()
                server.send_signal(signal.SIGKILL)
                server.wait(10)
                await _wait(broken, "broken stream")  # without sending anything
                link.send("ping", b"again")  # the next message finds the port refusing
                for _ in range(200):
                    if failed:
                        break
                    await asyncio.sleep(0.01)
                assert failed == [("ping", True)]
                await link.close()

    asyncio.run(run())


def test_closing_the_link_ourselves_is_not_a_broken_stream() -> None:
    async def run() -> None:
        with echo_server() as server:
            port = port_of(server)
            replied, broken = asyncio.Event(), asyncio.Event()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                link = PeerLink(channel, 2.0, lambda payload: replied.set(),
                                lambda tag, was_refused: None, broken.set)
                link.send("ping", b"hello")
                await _wait(replied, "echo")
                await link.close()
                await asyncio.sleep(0)  # let a (wrong) callback run, were one scheduled
                assert not broken.is_set()

    asyncio.run(run())

