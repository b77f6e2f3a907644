"""What hypermesh relies on from etcd and its young client library (etcd3aio),
against real etcd servers: the mirror resumes after an etcd restart, clients fail
over to another member, fenced transactions and leases behave as designed."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import cast

import pytest

from hypermesh.errors import EtcdUnavailable, UsageError
from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.local.etcd import EtcdCluster, EtcdServer
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd, hush_broken_stream_noise
from tests.state.fence_kit import fault_txns
from tests.tcp_proxy import CuttingProxy


async def wait_until(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_parse_endpoints() -> None:
    assert parse_endpoints("http://127.0.0.1:2379, 10.0.0.2:2380") == [
        "127.0.0.1:2379",
        "10.0.0.2:2380",
    ]
    assert parse_endpoints("https://h1:2379,https://h2:2379") == ["h1:2379", "h2:2379"]
    for bad in ("", "ftp://x:1", "http://host", "https://h:1,http://h:2", "https://h:1,h:2"):
        with pytest.raises(UsageError):
            parse_endpoints(bad)


def test_mirror_resumes_after_etcd_restart(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd", fsync=False).start()
    seen: dict[str, bytes | None] = {}

    def apply(key: str, value: bytes | None, crev: int, mrev: int) -> None:
        seen[key] = value

    async def scenario() -> None:
        async with Etcd([server.url.split("//")[1]]) as etcd:
            await etcd.put("/t/before", b"1")
            mirror = asyncio.create_task(etcd.mirror("/t/", apply, lambda rev: None))
            await wait_until(lambda: seen.get("/t/before") == b"1", 10, "initial load")
            server.stop()
            await asyncio.sleep(0.5)
            server.start()
            deadline = time.monotonic() + 20
            while True:  # writes fail until the client reconnects
                try:
                    await etcd.put("/t/after", b"2")
                    break
                except EtcdUnavailable:
                    assert time.monotonic() < deadline, "etcd did not come back"
                    await asyncio.sleep(0.2)
            await wait_until(lambda: seen.get("/t/after") == b"2", 20, "watch to resume")
            mirror.cancel()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_failover_to_another_member(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path, size=3).start()
    seen: dict[str, bytes | None] = {}

    async def scenario() -> None:
        endpoints = parse_endpoints(cluster.url)
        async with Etcd(endpoints) as etcd:
            lease = await etcd.grant(10)
            await etcd.put("/f/leased", b"x", lease)
            mirror = asyncio.create_task(
                etcd.mirror("/f/", lambda k, v, c, m: seen.__setitem__(k, v), lambda rev: None)
            )
            await wait_until(lambda: "/f/leased" in seen, 10, "initial load")
            cluster.members[0].stop()  # lose one member of three: quorum remains
            for i in range(10):  # round robin hits every member; all must succeed
                await etcd.put(f"/f/k{i}", str(i).encode())
            assert await etcd.keepalive_once(lease) > 0
            await wait_until(lambda: seen.get("/f/k9") == b"9", 20, "watch after failover")
            assert (await etcd.get("/f/leased")) is not None
            mirror.cancel()

    try:
        asyncio.run(scenario())
    finally:
        cluster.stop()


def test_fenced_transaction_and_lease_expiry(etcd_server: EtcdServer) -> None:
    async def scenario() -> None:
        async with Etcd([etcd_server.url.split("//")[1]]) as etcd:
            lease = await etcd.grant(2)
            rev = await etcd.put("/x/claim", b"me", lease)
            # A write fenced on the claim's revision succeeds while it is ours...
            ok = await etcd.txn(
                [etcd.mod_revision_is("/x/claim", rev)], [etcd.op_put("/x/res", b"1")]
            )
            assert ok.succeeded
            # ...and fails once someone re-claimed it.
            await etcd.put("/x/claim", b"other")
            late = await etcd.txn(
                [etcd.mod_revision_is("/x/claim", rev)], [etcd.op_put("/x/res", b"2")]
            )
            assert not late.succeeded
            assert (await etcd.get("/x/res"))[0] == b"1"  # type: ignore[index]
            # A lease nobody renews expires and takes its keys with it.
            lease2 = await etcd.grant(2)
            await etcd.put("/x/mine", b"1", lease2)
            deadline = time.monotonic() + 10
            while await etcd.get("/x/mine") is not None:
                assert time.monotonic() < deadline, "lease did not expire"
                await asyncio.sleep(0.2)
            assert await etcd.keepalive_once(lease2) <= 0

    asyncio.run(scenario())


def test_of_two_candidates_that_saw_the_same_vacancy_one_stands(etcd_server: EtcdServer) -> None:
    """The election's transaction: stand only if no candidacy was put since the view."""

    async def scenario() -> None:
        async with Etcd([etcd_server.url.split("//")[1]]) as etcd:
            stale = await etcd.put("/el/elect/01", b"gone")  # a dead leader's key
            seen = await etcd.put("/el/other", b"x")  # the revision both candidates saw

            def stand(name: str) -> list[object]:
                return [etcd.op_delete("/el/elect/01"), etcd.op_put("/el/elect/" + name, b"")]

            guard = [etcd.none_created_since("/el/elect/", seen)]
            first = await etcd.txn(guard, stand("02"))
            second = await etcd.txn(guard, stand("03"))
            assert first.succeeded and not second.succeeded
            kvs, _ = await etcd.get_prefix("/el/elect/")
            assert [kv.key for kv in kvs] == [b"/el/elect/02"]
            # Keys older than the view do not stop a candidate; an empty prefix neither.
            assert stale < seen
            later = await etcd.txn([etcd.none_created_since("/el/elect/", first.revision)], [])
            empty = await etcd.txn([etcd.none_created_since("/el/none/", seen)], [])
            assert later.succeeded and empty.succeeded

    asyncio.run(scenario())


def test_a_transaction_whose_answer_was_lost_is_not_reported_as_failed(
    etcd_server: EtcdServer,
) -> None:
    """A member that dies after committing a claim must not make its writer believe
    the claim failed (retrying it fails its compares): the claim would be held under
    the writer's lease, run by nobody, forever."""

    async def scenario() -> None:
        async with Etcd([etcd_server.url.split("//")[1]]) as etcd:
            lease = await etcd.grant(30)
            claim = [etcd.absent("/t/claim")], [
                etcd.op_put("/t/claim", b"node1 attempt 1", lease),
                etcd.op_put("/t/attempt", b"running"),
            ]
            calls = fault_txns(etcd, ["lost"])
            done = await etcd.txn(*claim)
            assert calls == ["lost", "ok"]  # committed once, retried once
            assert done.succeeded
            _, rev = await etcd.get("/t/claim")  # type: ignore[misc]
            assert done.revision == rev  # the earlier attempt's revision: a valid fence
            # A compare that fails for real still fails after a retry (a claim's value
            # is new each time: it carries its start time)...
            later = [etcd.absent("/t/claim")], [etcd.op_put("/t/claim", b"node1 at 2", lease)]
            calls = fault_txns(etcd, ["refused"])
            again = await etcd.txn(*later)
            assert calls == ["refused", "ok"] and not again.succeeded
            # ...also when the keys hold someone else's write of the same bytes, but
            # under another lease.
            await etcd.put("/t/claim", b"node1 at 2")
            fault_txns(etcd, ["refused"])
            assert not (await etcd.txn(*later)).succeeded
            # A release (deletes only) whose answer was lost succeeded too.
            rev = (await etcd.get("/t/claim"))[1]  # type: ignore[index]
            fault_txns(etcd, ["lost"])
            released = await etcd.txn(
                [etcd.mod_revision_is("/t/claim", rev)], [etcd.op_delete("/t/claim")]
            )
            assert released.succeeded and await etcd.get("/t/claim") is None
            # An error that is no outage is not retried.
            calls = fault_txns(etcd, [])
            too_many = [etcd.op_put(f"/t/{i}", b"") for i in range(200)]
            with pytest.raises(EtcdUnavailable):
                await etcd.txn([], too_many)
            assert calls == ["ok"]

    asyncio.run(scenario())


def test_a_mirror_of_several_ranges_sees_them_alone_each_in_etcd_order(
    etcd_server: EtcdServer,
) -> None:
    """``mirror(root, ranges=...)``: loads the chosen ranges (two prefixes, one exact
    key) at one revision, is never sent the rest of ``root``, applies each range's
    changes in the order etcd made them, and never reports a batch revision past what
    every range has caught up with (across ranges, a resuming stream may interleave)."""

    async def scenario() -> None:
        async with Etcd([etcd_server.url.split("//")[1]]) as etcd:
            await etcd.put("/m/a/1", b"a1")
            await etcd.put("/m/b/1", b"b1")
            await etcd.put("/m/other/1", b"x")
            await etcd.put("/m/k", b"k")
            await etcd.put("/m/k2", b"not the key")
            seen: list[tuple[str, bytes | None]] = []
            batches: list[int] = []
            ready = asyncio.Event()
            mirror = asyncio.create_task(etcd.mirror(
                "/m/", lambda key, value, *_: seen.append((key, value)), batches.append,
                ready=ready, ranges=[("/m/a/", "/m/a0"), ("/m/b/", "/m/b0"), ("/m/k", "/m/k\0")],
            ))
            try:
                await asyncio.wait_for(ready.wait(), 10)
                assert sorted(seen) == [("/m/a/1", b"a1"), ("/m/b/1", b"b1"), ("/m/k", b"k")]
                seen.clear()
                for key in ("/m/b/2", "/m/other/2", "/m/k2", "/m/a/2", "/m/k", "/m/b/3"):
                    await etcd.put(key, key.encode())
                last = await etcd.put("/m/a/3", b"last")
                await etcd.txn([], [etcd.op_delete("/m/b/1")])
                # Each range comes on a watcher of its own: wait for all of them.
                expected = ["/m/a/2", "/m/a/3", "/m/b/1", "/m/b/2", "/m/b/3", "/m/k"]
                await wait_until(lambda: set(expected) <= {k for k, _ in seen}, 10,
                                 "every range's changes")
                assert ("/m/b/1", None) in seen
                assert batches == sorted(batches) and batches[-1] <= last + 1
                keys = [k for k, _ in seen]
                assert sorted(keys) == expected  # nothing of /m/other/ or /m/k2
                assert [k for k in keys if k.startswith("/m/b/")] == ["/m/b/2", "/m/b/3", "/m/b/1"]
                assert [k for k in keys if k.startswith("/m/a/")] == ["/m/a/2", "/m/a/3"]
            finally:
                mirror.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await mirror

    asyncio.run(scenario())


def test_grpc_stream_cleanup_reports_are_hushed_and_others_are_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        hush_broken_stream_noise(loop)

        async def _consume_request_iterator() -> None:  # named as grpc.aio's task is
            await asyncio.sleep(0)

        task = loop.create_task(_consume_request_iterator())
        await task
        loop.call_exception_handler({"message": "Task was destroyed but it is pending!",
                                     "task": task})
        loop.call_exception_handler({
            "message": "Task exception was never retrieved",
            "exception": RuntimeError("aclose(): asynchronous generator is already running"),
        })
        loop.call_exception_handler({"message": "something else broke",
                                     "exception": ValueError("real")})

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["something else broke"]
    assert sum("grpc.aio stream cleanup" in r.getMessage() for r in caplog.records) == 2


def test_a_mirror_cut_again_and_again_misses_no_change(etcd_server: EtcdServer) -> None:
    """The mirror's connection to etcd is reset again and again while keys change; every
    change still reaches it. A watch that resumes must start after the last event it
    delivered: the header revision of a new watch's first answer is etcd's current one,
    and the events before it may not have arrived when the connection breaks again."""
    port = int(etcd_server.url.rsplit(":", 1)[1])
    seen: dict[str, bytes | None] = {}
    batches: list[int] = []

    async def scenario(proxy: CuttingProxy) -> None:
        async with Etcd([etcd_server.url.split("//")[1]]) as writer, Etcd(
            [f"127.0.0.1:{proxy.port}"]
        ) as reader:
            mirror = asyncio.create_task(reader.mirror(
                "/cut/", lambda key, value, *_: seen.__setitem__(key, value), batches.append
            ))
            try:
                written = 0
                for cut in range(60):  # a cut every 20-160 ms, a write or three between
                    for _ in range(1 + cut % 3):
                        await writer.put(f"/cut/{written:04d}", str(written).encode())
                        written += 1
                    proxy.cut()
                    await asyncio.sleep(0.02 * (1 + cut % 8))
                last = await writer.put("/cut/last", b"last")
                await wait_until(lambda: seen.get("/cut/last") == b"last", 30, "the last key")
                missing = [i for i in range(written) if seen.get(f"/cut/{i:04d}") != b"%d" % i]
                assert not missing, f"{len(missing)} of {written} changes never reached the mirror"
                assert max(batches) >= last
            finally:
                mirror.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await mirror

    with CuttingProxy("127.0.0.1", port) as proxy:
        asyncio.run(scenario(proxy))


def test_a_lease_is_given_up_before_etcd_can_expire_it(tmp_path: Path) -> None:
    """An agent stops its tasks when it gives its lease up; for no other node to run
    them meanwhile, that must come before etcd can have expired the lease: counted
    from when the last answered renewal was sent, not from when it was answered."""
    server = EtcdServer(tmp_path / "etcd", fsync=False).start()
    assert server.proc is not None
    pid = server.proc.pid

    async def scenario() -> None:
        async with Etcd([server.url.split("//")[1]]) as etcd:
            lease = await etcd.grant(3)
            renewed: list[float] = []
            lost = asyncio.Event()
            keeper = asyncio.create_task(
                etcd.keep_lease(lease, 3, lost.set, renewed.append, give_up_after=2.0))
            await wait_until(lambda: len(renewed) >= 2, 10, "two renewals")
            os.kill(pid, signal.SIGSTOP)  # etcd answers nothing from now on
            try:
                await asyncio.wait_for(lost.wait(), 10)
                gave_up = time.monotonic()
            finally:
                os.kill(pid, signal.SIGCONT)
            await asyncio.wait_for(keeper, 5)
            assert 2.0 - 0.05 <= gave_up - renewed[-1] <= 2.5  # and the TTL is 3 s

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def a_follower(cluster: EtcdCluster) -> EtcdServer:
    """A member of ``cluster`` that does not lead it (as the members answer)."""

    def find() -> EtcdServer | None:
        for member in cluster.members:
            status = member.etcdctl("endpoint", "status", "-w", "json", user=None, check=False)
            with contextlib.suppress(ValueError, KeyError, IndexError):
                state = json.loads(status.stdout)[0]["Status"]
                if state["leader"] and state["header"]["member_id"] != state["leader"]:
                    return member
        return None

    return cast(EtcdServer, wait_for(find, 20, "a follower of the etcd cluster"))


def test_a_lease_outlives_a_silent_member(tmp_path: Path) -> None:
    """A member whose host is cut off keeps its connections open and answers nothing (as
    a stopped process does), so round robin still gives it new streams: a keep-alive
    whose stream was on it must reach another member before it gives its lease up.
    Twelve clients (agents), so that about four hold their stream on the silent member."""

    async def scenario(urls: str, pid: int) -> None:
        clients = [Etcd(parse_endpoints(urls)) for _ in range(12)]
        renewed: list[list[float]] = [[] for _ in clients]
        lost: list[int] = []
        any_lost = asyncio.Event()
        keepers = []

        def lose(n: int) -> None:
            lost.append(n)
            any_lost.set()

        async def read(etcd: Etcd) -> None:
            with contextlib.suppress(TimeoutError, EtcdUnavailable):
                await asyncio.wait_for(etcd.get("/chatter"), 0.3)

        async def chatter(etcd: Etcd) -> None:
            # An agent's other calls, started at a steady pace whoever answers: without
            # them a stream opened again is round robin's next pick after the silent
            # member, so never the silent member.
            async with asyncio.TaskGroup() as calls:
                while True:
                    calls.create_task(read(etcd))
                    await asyncio.sleep(0.02)

        try:
            for n, etcd in enumerate(clients):
                await etcd.connect()
                lease = await etcd.grant(3)
                keepers.append(asyncio.create_task(etcd.keep_lease(
                    lease, 3, functools.partial(lose, n), renewed[n].append, give_up_after=2.0)))
                keepers.append(asyncio.create_task(chatter(etcd)))
            await wait_until(lambda: all(len(r) >= 2 for r in renewed), 10, "two renewals each")
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            with contextlib.suppress(TimeoutError):  # ten give-up windows
                await asyncio.wait_for(any_lost.wait(), 20)
            assert not lost, (f"clients {lost} lost their lease "
                              f"{time.monotonic() - stopped:.1f}s after a member stopped")
            assert all(sum(sent > stopped for sent in r) >= 15 for r in renewed), renewed
        finally:
            os.kill(pid, signal.SIGCONT)
            for keeper in keepers:
                keeper.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)
            for etcd in clients:
                await etcd.close()

    cluster = EtcdCluster(tmp_path, size=3).start()
    try:
        silent = a_follower(cluster)
        assert silent.proc is not None
        asyncio.run(scenario(cluster.url, silent.proc.pid))
    finally:
        for member in cluster.members:  # a stopped process would not see its SIGTERM
            if member.proc is not None:
                member.proc.send_signal(signal.SIGCONT)
        cluster.stop()
