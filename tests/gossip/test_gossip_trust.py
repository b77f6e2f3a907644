"""What gossip refuses to believe: malformed fields, claims above a member's own
incarnation, a left not from the member, a flood of made-up members, a sender that
is not the authenticated peer; and deaths heard from others are probed before they
count as witnessed."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from hypermesh._proto import agent_pb2
from hypermesh.agent.gossip.broadcast import Update
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.link import serve_stream
from hypermesh.agent.gossip.swim import ALIVE, DEAD, LEFT, SUSPECT, Message
from hypermesh.agent.gossip.trust import (
    INCARNATION,
    LEFT_BY_OTHER,
    MALFORMED,
    MAX_COUNTER,
    NOT_PEER,
    OVERSIZED,
    TABLE_FULL,
    Refusals,
    check_address,
)
from hypermesh.agent.ops.metrics import Snapshot, exposition
from tests.gossip.test_swim import CFG, Wire


def gossip(sender: str, *updates: Update) -> Message:
    return Message("gossip", sender, f"addr-{sender}", updates=updates)


def row(member: str, incarnation: object, state: int = 0, **extra: object) -> list[object]:
    return [member, f"{member}.example:7946", state, incarnation, *extra.values()]


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize(
    "bad",
    [
        row("n1", 2**64),  # the incarnation that broke GetMembers (protobuf int64)
        row("n1", 2**63),
        row("n1", -1),
        row("n1", True),
        row("n1", 1.5),
        row("n1", 0, 0, meta_version=2**63),
        ["../etc", "h:1", 0, 0],  # names full-match the node-name pattern
        ["a b", "h:1", 0, 0],
        ["", "h:1", 0, 0],
        ["x" * 300, "h:1", 0, 0],
        ["n1", "h", 0, 0],  # addresses are host:port with a port in 1-65535
        ["n1", "h:0", 0, 0],
        ["n1", "h:65536", 0, 0],
        ["n1", "h:+80", 0, 0],
        ["n1", ":80", 0, 0],
        ["n1", "h x:80", 0, 0],
        ["n1", "h:1", 2, 0, 0, None, "not a name!"],  # a source, when given, is a name
        ["n1", "h:1", True, 0],
    ],
)
def test_a_row_out_of_range_or_malformed_is_refused(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        Update.from_wire(bad)


def test_the_largest_counters_and_usual_addresses_are_accepted() -> None:
    top = Update.from_wire(row("n1", MAX_COUNTER, 0, meta_version=MAX_COUNTER))
    assert top.incarnation == MAX_COUNTER and top.meta_version == MAX_COUNTER
    for address in ("127.0.0.1:1", "node-7.mesh.local:65535", "[::1]:7946", "[fe80::1%eth0]:80"):
        assert check_address(address, "an address") == address


@pytest.mark.parametrize(
    "bad",
    [
        {"k": "gossip", "f": "not a name", "fa": "h:1"},
        {"k": "gossip", "f": "a", "fa": "h"},
        {"k": "ping", "f": "a", "fa": "h:1", "q": 2**63},
        {"k": "ping", "f": "a", "fa": "h:1", "q": -1},
        {"k": "ping_req", "f": "a", "fa": "h:1", "t": "b/c", "ta": "h:2"},
        {"k": "ping_req", "f": "a", "fa": "h:1", "t": "b", "ta": "h:99999"},
    ],
)
def test_a_malformed_message_is_refused_whole(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Message.from_json(bad, [])


def test_a_bad_row_is_left_out_and_the_rest_of_the_message_counts() -> None:
    data = {
        "k": "gossip",
        "f": "a",
        "fa": "h:1",
        "u": [row("ghost", 2**64), row("n1", 3)],
        "tb": [["n2", "h:2", 0, 1], "junk"],
    }
    bad: list[str] = []
    msg = Message.from_json(json.loads(json.dumps(data)), bad)
    assert [u.member for u in msg.updates] == ["n1"] and [u.member for u in msg.table] == ["n2"]
    assert len(bad) == 2 and "incarnation" in bad[0]
    with pytest.raises(ValueError):  # without a list for them, one bad row fails it all
        Message.from_json(data)


# ---------------------------------------------------------------- whose incarnation


def test_a_forged_death_above_the_announced_incarnation_is_not_believed() -> None:
    wire = Wire(["a", "b", "c"])
    a = wire.nodes["a"]
    for state in (DEAD, SUSPECT):
        a.receive(gossip("c", Update("b", "addr-b", state, 1000, source="c")), 0.0)
    assert wire.state("a", "b") == ALIVE and a.member("b").incarnation == 0  # type: ignore[union-attr]
    assert a.refusals.totals[INCARNATION] == 2
    assert a.drain_events() == []
    wire.run_until(1.0)  # and it is not passed on: nobody else hears of it
    assert all(wire.state(n, "b") == ALIVE for n in "abc")
    assert wire.nodes["b"].incarnation == 0


def test_suspicion_and_death_at_the_announced_incarnation_still_work() -> None:
    wire = Wire(["a", "b", "c"])
    a, b = wire.nodes["a"], wire.nodes["b"]
    # b refutes a suspicion: its new incarnation is announced, and believed...
    wire.deliver("c", [*b.receive(gossip("c", Update("b", "addr-b", SUSPECT, 0, source="c")), 0.0)])
    wire.run_until(0.5)
    assert b.incarnation == 1 and a.member("b").incarnation == 1  # type: ignore[union-attr]
    # ...so an accusation at it is believed, and b refutes it again.
    a.receive(gossip("c", Update("b", "addr-b", SUSPECT, 1, source="c")), 0.5)
    assert wire.state("a", "b") == SUSPECT and a.refusals.totals[INCARNATION] == 0
    wire.run_until(1.5)
    assert wire.state("a", "b") == ALIVE and b.incarnation == 2


def test_news_of_a_newer_incarnation_makes_a_holder_of_a_stale_suspicion_probe() -> None:
    wire = Wire(["a", "b", "c", "d"])
    a, b = wire.nodes["a"], wire.nodes["b"]
    a.receive(gossip("c", Update("b", "addr-b", SUSPECT, 0, source="c")), 0.0)
    assert wire.state("a", "b") == SUSPECT
    b.receive(gossip("c", Update("b", "addr-b", SUSPECT, 0, source="c")), 0.0)
    assert b.incarnation == 1  # b refuted, but a missed it; d accuses b again at 1
    a.receive(gossip("d", Update("b", "addr-b", SUSPECT, 1, source="d")), 0.01)
    assert a.refusals.totals[INCARNATION] == 1
    wire.deliver("a", a.tick(0.01))  # a probes b itself, and b's ack carries its news
    assert wire.state("a", "b") == ALIVE and a.member("b").incarnation >= 1  # type: ignore[union-attr]


def test_left_above_the_known_incarnation_is_believed_only_from_the_member() -> None:
    wire = Wire(["a", "b", "c", "d"])
    a = wire.nodes["a"]
    a.receive(gossip("c", Update("b", "addr-b", LEFT, 3, source="b")), 0.0)
    assert wire.state("a", "b") == ALIVE and a.refusals.totals[LEFT_BY_OTHER] == 1
    a.receive(gossip("b", Update("b", "addr-b", LEFT, 3, source="b")), 0.0)
    assert wire.state("a", "b") == LEFT
    a.receive(gossip("c", Update("d", "addr-d", LEFT, 0, source="d")), 0.0)  # relayed, known
    assert wire.state("a", "d") == LEFT


def test_a_claim_about_oneself_at_the_largest_incarnation_is_not_answered_above_it() -> None:
    wire = Wire(["a", "b"])
    b = wire.nodes["b"]
    b.receive(gossip("a", Update("b", "addr-b", DEAD, MAX_COUNTER, source="a")), 0.0)
    assert b.incarnation == MAX_COUNTER  # refuted as far as the wire allows, never beyond
    b.receive(gossip("a", Update("b", "addr-b", ALIVE, MAX_COUNTER, MAX_COUNTER)), 0.0)
    assert b.incarnation == MAX_COUNTER and b.member("b").meta_version == MAX_COUNTER  # type: ignore[union-attr]
    assert b.members()["b"].state == ALIVE


# ---------------------------------------------------------------- the member table


def test_a_flood_of_ghosts_is_bounded_by_max_members() -> None:
    cfg = GossipConfig.local(push_pull_interval=0.0, reconnect_interval=0.0, max_members=50)
    wire = Wire(["a", "b", "c"], cfg)
    a = wire.nodes["a"]
    ghosts = [Update.alive(f"ghost{i}", f"10.0.0.{i % 250}:1", 0, 0, {}) for i in range(200)]
    for i in range(0, 200, 16):
        a.receive(gossip("c", *ghosts[i : i + 16]), 0.0)
    assert len(a.members()) == 50 and a.refusals.totals[TABLE_FULL] == 153
    assert all(wire.state("a", n) == ALIVE for n in "bc")
    # A full table makes room for a new member by forgetting the longest dead one.
    a.receive(gossip("c", Update("ghost0", "10.0.0.0:1", DEAD, 0, source="c")), 1.0)
    a.receive(gossip("d", Update.alive("d", "addr-d", 0, 0, {})), 2.0)
    assert a.member("d") is not None and a.member("ghost0") is None
    assert len(a.members()) == 50


def test_dead_members_are_forgotten_after_dead_retention() -> None:
    cfg = GossipConfig.local(push_pull_interval=0.0, reconnect_interval=0.0, dead_retention=1.0)
    wire = Wire(["a", "b", "c"], cfg)
    a = wire.nodes["a"]
    a.receive(gossip("c", Update.alive("ghost", "10.0.0.9:1", 0, 0, {})), 0.0)
    a.receive(gossip("c", Update("ghost", "10.0.0.9:1", DEAD, 0, source="c")), 0.0)
    assert wire.state("a", "ghost") == DEAD
    wire.run_until(0.9)
    assert wire.state("a", "ghost") == DEAD
    wire.run_until(3.0)  # a probe pass that starts after dead_retention forgets it
    assert a.member("ghost") is None and wire.state("a", "b") == ALIVE


def test_meta_larger_than_max_meta_bytes_is_refused() -> None:
    wire = Wire(["a", "b"])
    a = wire.nodes["a"]
    big = Update.alive("b", "addr-b", 1, 1, {"x": "y" * CFG.max_meta_bytes})
    a.receive(gossip("b", big), 0.0)
    assert a.member("b").incarnation == 0 and a.refusals.totals[OVERSIZED] == 1  # type: ignore[union-attr]


# ---------------------------------------------------------------- the sender


def test_a_message_sent_in_another_members_name_is_refused_when_the_peer_is_known() -> None:
    wire = Wire(["a", "b", "c"])
    a = wire.nodes["a"]
    ping = Message("ping", "b", "addr-b", seq=1, target="a")
    assert a.receive(ping, 0.0, peer="c") == []
    assert a.refusals.totals[NOT_PEER] == 1
    forged = gossip("b", Update("b", "addr-b", LEFT, 0, source="b"))
    a.receive(forged, 0.0, peer="c")
    assert wire.state("a", "b") == ALIVE
    assert [o.message.kind for o in a.receive(ping, 0.0, peer="b")] == ["ack"]
    assert [o.message.kind for o in a.receive(ping, 0.0)] == ["ack"]  # plaintext: no check


# ---------------------------------------------------------------- deaths heard and witnessed


def test_a_death_heard_from_others_is_witnessed_only_when_our_own_probe_fails() -> None:
    wire = Wire(["a", "b", "c", "d"])
    a = wire.nodes["a"]
    wire.down.add("d")
    a.receive(gossip("c", Update("d", "addr-d", DEAD, 0, source="c")), 0.0)
    assert wire.state("a", "d") == DEAD and a.witnessed("d") is None
    wire.deliver("a", a.check_death("d", 0.0))
    assert a.probing("d") and a.check_death("d", 0.0) == []  # one probe at a time
    wire.run_until(CFG.protocol_period)
    assert a.witnessed("d") == "reported dead; our probe failed too"
    assert ("d", "confirmed-dead", "reported dead; our probe failed too") in [
        entry[1:] for entry in a.log
    ]


def test_a_live_member_reported_dead_answers_our_probe_and_refutes() -> None:
    wire = Wire(["a", "b", "c"])
    a, b = wire.nodes["a"], wire.nodes["b"]
    a.receive(gossip("c", Update("b", "addr-b", DEAD, 0, source="c")), 0.0)
    assert wire.state("a", "b") == DEAD
    sent = a.check_death("b", 0.0)
    assert [(u.member, u.state) for u in sent[0].message.updates[:1]] == [("b", DEAD)]
    wire.deliver("a", sent)
    assert wire.state("a", "b") == ALIVE and b.incarnation == 1
    assert a.witnessed("b") is None and not a.probing("b")


def test_our_own_failed_probe_is_a_witnessed_death() -> None:
    wire = Wire(["a", "b", "c"])
    wire.down.add("b")
    wire.run_until(4.0)
    a = wire.nodes["a"]
    assert wire.state("a", "b") == DEAD
    assert a.witnessed("b") is not None or wire.nodes["c"].witnessed("b") is not None
    wire.down.clear()
    wire.nodes["b"].receive(gossip("a", Update("b", "addr-b", DEAD, 0, source="a")), 4.0)
    wire.run_until(5.0)
    assert wire.state("a", "b") == ALIVE and a.witnessed("b") is None  # alive again: forgotten


# ---------------------------------------------------------------- members only heard of


def _haunt(wire: Wire, count: int = 200) -> None:
    """Tell every member of ``wire`` of ``count`` made-up members (ghosts), at addresses
    where nothing answers, in another member's name."""
    ghosts = [Update.alive(f"ghost{i}", f"ghost{i}.invalid:7946", 0, 0, {}) for i in range(count)]
    for name, node in wire.nodes.items():
        sender = "d" if name == "c" else "c"
        for i in range(0, count, 16):
            wire.deliver(name, node.receive(gossip(sender, *ghosts[i : i + 16]), wire.now))


def _worst_health(wire: Wire, until: float) -> int:
    """Run ``wire`` to ``until``; the highest local health any member had at a period's end."""
    worst = 0
    while wire.now < until:
        wire.run_until(min(until, wire.now + CFG.protocol_period))
        worst = max(worst, *(node.local_health for node in wire.nodes.values()))
    return worst


def test_ghosts_neither_raise_local_health_nor_serve_as_indirect_probers() -> None:
    wire = Wire(["a", "b", "c", "d"])
    wire.run_until(1.0)
    _haunt(wire)
    a = wire.nodes["a"]
    assert all(len(node.members()) == 204 for node in wire.nodes.values())
    assert a.heard("b") and not a.heard("ghost0")
    start = len(wire.log)
    # 100 periods: each member probes about 100 ghosts, each probe going indirect.
    assert _worst_health(wire, 1.0 + 100 * CFG.protocol_period) == 0
    reqs = [o for _, o in wire.log[start:] if o.message.kind == "ping_req"]
    assert len(reqs) > 100 and {o.to for o in reqs} == set(wire.nodes)  # real members only
    assert all(wire.state(x, y) == ALIVE for x in wire.nodes for y in wire.nodes)
    gone = [m for m in a.members().values() if m.name.startswith("ghost") and m.state == DEAD]
    assert len(gone) > 100  # probed, suspected and declared dead as usual


def test_among_ghosts_real_helpers_save_a_cut_off_member_and_a_real_death_is_found() -> None:
    wire = Wire(["a", "b", "c", "d"])
    wire.run_until(1.0)
    _haunt(wire)
    a = wire.nodes["a"]
    wire.cut.add(frozenset(("a", "b")))  # a's probe of b must go through c and d
    start = len(wire.log)
    wire.deliver("a", a.check_death("b", wire.now))
    wire.run_until(wire.now + CFG.protocol_period)
    reqs = [o for s, o in wire.log[start:] if s == "a" and o.message.target == "b"]
    assert {o.to for o in reqs if o.message.kind == "ping_req"} == {"c", "d"}
    assert [(s, o.to) for s, o in wire.log[start:] if o.message.kind == "ack" and o.to == "a"]
    assert wire.state("a", "b") == ALIVE and a.witnessed("b") is None
    wire.cut.clear()
    wire.down.add("d")  # a real death: d misses a nack, and is probed itself at once
    assert _worst_health(wire, wire.now + 3.0) <= 2  # not 8, for hundreds of periods
    assert all(wire.state(x, "d") == DEAD for x in "abc")
    assert any(wire.nodes[x].witnessed("d") for x in "abc")
    assert all(wire.nodes[x].local_health == 0 for x in "abc")


def test_with_nobody_heard_yet_a_failed_probe_has_no_helpers_and_still_finds_a_death() -> None:
    wire = Wire(["a", "b", "c"], roster=False)
    a = wire.nodes["a"]
    wire.down.update("bc")
    wire.deliver("a", a.join([("b", "addr-b"), ("c", "addr-c")], 0.0))
    assert a.member("b") is not None and not a.heard("b") and not a.heard("c")
    wire.run_until(10.0)
    assert wire.state("a", "b") == DEAD and wire.state("a", "c") == DEAD
    assert a.witnessed("b") and a.local_health == 0
    assert "ping_req" not in wire.kinds("a")


def test_a_fresh_mesh_hears_everyone_by_their_probes_and_finds_a_death() -> None:
    names = ["a", "b", "c", "d"]
    wire = Wire(names, roster=False)
    for i, n in enumerate(names[1:], start=1):
        wire.now = i * 0.01
        wire.deliver(n, wire.nodes[n].join([("a", "addr-a")], wire.now))
    wire.run_until(3.0)
    assert all(wire.nodes[x].heard(y) for x in names for y in names if x != y)
    wire.cut.add(frozenset(("a", "b")))
    wire.down.add("d")
    wire.run_until(8.0)
    assert all(wire.state(x, "d") == DEAD for x in "abc")
    assert wire.state("a", "b") == ALIVE and "ping_req" in wire.kinds("a")


def test_a_member_is_heard_only_at_the_address_held_for_it() -> None:
    wire = Wire(["a", "b", "c"])
    a = wire.nodes["a"]
    assert a.heard("b") and not a.heard("e")  # the roster it started from counts as heard
    a.receive(gossip("c", Update.alive("b", "elsewhere:1", 1, 0, {})), 0.0)  # b moved, says c
    b = a.member("b")
    assert b is not None and b.address == "elsewhere:1" and not a.heard("b")
    a.receive(gossip("b"), 0.1)  # from addr-b, where we no longer hold b
    assert not a.heard("b")
    a.receive(Message("gossip", "b", "elsewhere:1"), 0.2)
    assert a.heard("b")


# ---------------------------------------------------------------- the count


def test_refusals_are_reported_at_most_once_per_period() -> None:
    r = Refusals(period=60.0)
    assert r.report(0.0) is None
    r.add(MALFORMED, "first")
    r.add(MALFORMED, "second")
    r.add(TABLE_FULL, "ghost1")
    text = r.report(0.0)
    assert text == "refused gossip: 2 malformed (e.g. first); 1 table-full (e.g. ghost1)"
    r.add(MALFORMED, "third")
    assert r.report(59.0) is None
    assert r.report(60.0) == "refused gossip: 1 malformed (e.g. third)"
    assert r.totals == {MALFORMED: 3, TABLE_FULL: 1}


def test_refusals_are_a_metric_by_reason() -> None:
    snap = Snapshot(node="n1", gossip_refused=Counter({TABLE_FULL: 153, INCARNATION: 2}))
    text = exposition(snap).decode()
    assert 'hypermesh_gossip_refused_total{node="n1",reason="table-full"} 153.0' in text
    assert 'hypermesh_gossip_refused_total{node="n1",reason="incarnation"} 2.0' in text


def test_max_members_is_checked_with_its_range_named() -> None:
    with pytest.raises(ValueError, match=r"max_members must be in \[2, 1e\+07\]"):
        GossipConfig(max_members=1)


def test_a_stream_hands_its_authenticated_peer_to_the_receiver() -> None:
    seen: list[tuple[bytes, str | None]] = []

    def receive(payload: bytes, peer: str | None) -> list[bytes]:
        seen.append((payload, peer))
        if payload == b"bad":
            raise ValueError("malformed")
        return [b"reply"]

    async def packets() -> AsyncIterator[agent_pb2.GossipPacket]:
        for payload in (b"bad", b"ok"):
            yield agent_pb2.GossipPacket(payload=payload)

    async def collect(peer: str | None) -> list[agent_pb2.GossipAck]:
        return [ack async for ack in serve_stream(packets(), receive, peer)]

    acks = asyncio.run(collect("node7"))
    assert [list(a.replies) for a in acks] == [[b"reply"]]  # the bad one is skipped
    assert seen == [(b"bad", "node7"), (b"ok", "node7")]
    asyncio.run(collect(None))
    assert seen[-1] == (b"ok", None)
