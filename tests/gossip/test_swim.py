"""The SWIM state machine, driven directly: a virtual clock and zero-latency delivery."""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Iterable

import pytest

from hypermesh.agent.gossip.broadcast import Update
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.dissemination import push_pull_request
from hypermesh.agent.gossip.suspicion import lifeguard_timeout, suspicion_bounds
from hypermesh.agent.gossip.swim import (
    ALIVE,
    DEAD,
    LEFT,
    SUSPECT,
    Message,
    Outgoing,
    Roster,
    Swim,
    supersedes,
)

CFG = GossipConfig.local(push_pull_interval=0.0, reconnect_interval=0.0)


class Wire:
    """Members wired together in memory: every message arrives at once, unless its
    link is cut, its receiver is down (silent) or refuses connections; messages to
    names that are not on the wire (ghosts) go unanswered."""

    def __init__(
        self, names: Iterable[str], cfg: GossipConfig = CFG, seed: int = 1, roster: bool = True
    ) -> None:
        names = list(names)
        self.now = 0.0
        self.cfg = cfg
        shared = Roster([(n, f"addr-{n}") for n in names]) if roster else None
        self.nodes = {
            n: Swim(n, f"addr-{n}", cfg, random.Random(seed * 1000 + i), 0.0, roster=shared)
            for i, n in enumerate(names)
        }
        self.down: set[str] = set()
        self.refusing: set[str] = set()
        self.cut: set[frozenset[str]] = set()
        self.log: list[tuple[str, Outgoing]] = []

    def deliver(self, src: str, outs: Iterable[Outgoing]) -> None:
        queue = deque((src, o) for o in outs)
        while queue:
            src, out = queue.popleft()
            self.log.append((src, out))
            if out.to not in self.nodes:
                continue  # a made-up member (a ghost): nothing answers at its address
            assert out.address == f"addr-{out.to}"
            if out.to in self.refusing:
                queue.extend((src, o) for o in self.nodes[src].send_failed(out.to, self.now, True))
            elif out.to not in self.down and frozenset((src, out.to)) not in self.cut:
                replies = self.nodes[out.to].receive(out.message, self.now)
                queue.extend((out.to, o) for o in replies)

    def run_until(self, t: float) -> None:
        while True:
            live = [n for n in self.nodes if n not in self.down and n not in self.refusing]
            nxt = min(self.nodes[n].next_deadline() for n in live)
            if nxt > t:
                break
            self.now = max(self.now, nxt)
            for n in live:
                if self.nodes[n].next_deadline() <= self.now:
                    self.deliver(n, self.nodes[n].tick(self.now))
        self.now = t

    def state(self, observer: str, member: str) -> str:
        view = self.nodes[observer].member(member)
        assert view is not None
        return view.state

    def kinds(self, src: str | None = None) -> list[str]:
        return [o.message.kind for s, o in self.log if src is None or s == src]


def advance(node: Swim, until: float) -> None:
    """Tick ``node`` on time at each of its deadlines up to ``until``, dropping its output."""
    while node.next_deadline() <= until:
        node.tick(node.next_deadline())
    node.tick(until)


def one(node: Swim, now: float) -> list[Outgoing]:
    """Tick ``node`` until it starts a probe; return what it sent."""
    out = node.tick(now)
    assert any(o.message.kind == "ping" for o in out), out
    return out


# ---------------------------------------------------------------- messages


def test_message_json_round_trip_is_compact_and_exact() -> None:
    ups = (
        Update.alive("n1", "h:1", 3, 2, {"gpus": 2, "load": 0.5}),
        Update("n2", "h:2", SUSPECT, 4, source="n1"),
    )
    msg = Message("ping_req", "n1", "h:1", seq=7, target="n2", target_addr="h:2", updates=ups)
    data = msg.to_json()
    assert Message.from_json(json.loads(json.dumps(data))) == msg
    assert data["u"][1] == ["n2", "h:2", 1, 4, 0, None, "n1"]
    assert Message.from_json(Message("ack", "a", "x:1").to_json()) == Message("ack", "a", "x:1")


@pytest.mark.parametrize(
    "bad",
    [
        {"k": "shout", "f": "a", "fa": "h:1"},
        {"k": "ping", "fa": "h:1"},
        {"k": "ping", "f": "a", "fa": "h:1", "q": "1"},
        {"k": "ping", "f": "a", "fa": "h:1", "u": [["m", "x:1", 9, 0]]},
        {"k": "ping", "f": "a", "fa": "h:1", "u": "x"},
    ],
)
def test_malformed_messages_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Message.from_json(bad)


@pytest.mark.parametrize(
    ("new", "cur", "wins"),
    [
        ((ALIVE, 2), (ALIVE, 1), True),
        ((ALIVE, 1), (ALIVE, 1), False),
        ((ALIVE, 2), (SUSPECT, 1), True),
        ((ALIVE, 1), (SUSPECT, 1), False),
        ((ALIVE, 2), (DEAD, 1), True),
        ((ALIVE, 1), (DEAD, 1), False),
        ((ALIVE, 5), (LEFT, 4), True),
        ((SUSPECT, 1), (ALIVE, 1), True),
        ((SUSPECT, 0), (ALIVE, 1), False),
        ((SUSPECT, 2), (SUSPECT, 1), True),
        ((SUSPECT, 1), (SUSPECT, 1), False),
        ((SUSPECT, 9), (DEAD, 1), False),
        ((DEAD, 1), (ALIVE, 1), True),
        ((DEAD, 0), (ALIVE, 1), False),
        ((DEAD, 1), (SUSPECT, 1), True),
        ((DEAD, 2), (DEAD, 1), False),
        ((DEAD, 3), (LEFT, 1), False),
        ((LEFT, 1), (ALIVE, 1), True),
        ((LEFT, 1), (DEAD, 1), True),
        ((LEFT, 0), (SUSPECT, 1), False),
        ((LEFT, 2), (LEFT, 1), False),
    ],
)
def test_precedence_rules(new: tuple[str, int], cur: tuple[str, int], wins: bool) -> None:
    assert supersedes(new[0], new[1], cur[0], cur[1]) is wins


# ---------------------------------------------------------------- probing


def test_ping_ack_keeps_everyone_alive_and_healthy() -> None:
    wire = Wire(["a", "b", "c"])
    wire.run_until(2.0)
    kinds = wire.kinds()
    assert kinds.count("ping") >= 3 * int(2.0 / CFG.protocol_period) - 3
    assert kinds.count("ack") == kinds.count("ping")
    assert "ping_req" not in kinds
    for n in wire.nodes:
        assert {v.state for v in wire.nodes[n].members().values()} == {ALIVE}
        assert wire.nodes[n].local_health == 0


def test_probe_goes_indirect_after_the_timeout_and_an_indirect_ack_saves_the_target() -> None:
    wire = Wire(["a", "b", "c", "d"])
    wire.cut.add(frozenset(("a", "b")))
    wire.run_until(3.0)
    ping_reqs = [(s, o) for s, o in wire.log if o.message.kind == "ping_req"]
    assert any(s == "a" and o.message.target == "b" for s, o in ping_reqs)
    forwarded = [
        o
        for s, o in wire.log
        if o.message.kind == "ack" and o.to == "a" and o.message.target == "b"
    ]
    assert forwarded
    assert wire.state("a", "b") == ALIVE and wire.state("b", "a") == ALIVE
    assert all(e[2] != SUSPECT for n in wire.nodes for e in wire.nodes[n].drain_events())


def test_indirect_request_is_sent_exactly_at_the_probe_timeout() -> None:
    wire = Wire(["a", "b", "c", "d"])
    a = wire.nodes["a"]
    start, target = _first_target(a)
    wire.down.add(target)
    for now in (start + CFG.probe_timeout * 0.99, start + CFG.probe_timeout):
        reqs = [o for o in a.tick(now) if o.message.kind == "ping_req"]
        assert bool(reqs) is (now == start + CFG.probe_timeout)
    assert len(reqs) == 2 and {o.to for o in reqs} == {"b", "c", "d"} - {target}
    assert all(o.message.target == target for o in reqs)


def _first_target(node: Swim) -> tuple[float, str]:
    probe = node.next_deadline()
    out = node.tick(probe)
    return probe, next(o.to for o in out if o.message.kind == "ping")


def test_unanswered_probe_makes_a_suspect_then_dead_after_the_lifeguard_timeout() -> None:
    names = ["a", "b", "c", "d", "e"]
    wire = Wire(names)
    a = wire.nodes["a"]
    start, target = _first_target(a)
    wire.now = start
    for other in names:
        if other not in ("a", target):
            wire.cut.add(frozenset((other, target)))  # only a can fail to reach it
    wire.down.add(target)
    reqs = [o for o in a.tick(start + CFG.probe_timeout) if o.message.kind == "ping_req"]
    assert len(reqs) == 3
    for req in reqs:  # the probers cannot reach the target either, and say so
        nack = Message("nack", req.to, req.address, seq=req.message.seq, target=target)
        a.receive(nack, start + 2 * CFG.probe_timeout)
    end = start + CFG.protocol_period
    wire.deliver("a", a.tick(end - 1e-9))
    assert wire.state("a", target) == ALIVE
    wire.deliver("a", a.tick(end))
    assert wire.state("a", target) == SUSPECT
    assert a.drain_events() == [(target, ALIVE, SUSPECT)]
    assert a.local_health == 0  # every prober answered: the target is the problem, not us
    low, high = suspicion_bounds(5, CFG)
    k = min(CFG.suspicion_confirmations, 3)
    # nobody else probes the target in this test: no confirmations, so the longest timeout
    assert lifeguard_timeout(0, k, low, high) == high
    assert a.next_deadline() <= end + high
    advance(a, end + high - 1e-6)
    assert wire.state("a", target) == SUSPECT
    # unconfirmed: one last probe, carrying the suspicion, before the verdict
    last = [o for o in a.tick(end + high) if o.to == target and o.message.kind == "ping"]
    assert [(u.member, u.state) for u in last[0].message.updates[:1]] == [(target, SUSPECT)]
    verdict = end + high + (a.local_health + 1) * CFG.protocol_period
    advance(a, verdict - 1e-6)
    assert wire.state("a", target) == SUSPECT
    advance(a, verdict)
    assert wire.state("a", target) == DEAD
    assert (target, SUSPECT, DEAD) in a.drain_events()


def test_the_last_probe_of_an_unconfirmed_suspicion_fetches_a_missed_refutation() -> None:
    # a suspicion shorter than a period, so that only the last probe can save b
    cfg = GossipConfig.local(
        suspicion_mult=0.5, suspicion_max_mult=1.0, push_pull_interval=0.0, reconnect_interval=0.0
    )
    wire = Wire(["a", "b", "c"], cfg=cfg)
    a, b = wire.nodes["a"], wire.nodes["b"]
    old = Update("b", "addr-b", SUSPECT, 0, source="c")
    b.receive(Message("gossip", "c", "addr-c", updates=(old,)), 0.0)  # b refutes: inc 1...
    advance(b, 2.0)  # ...and its refutation is spent, while a will hear only the suspicion
    assert "b" not in b._queue and b.incarnation == 1
    wire.now = a.next_deadline()
    wire.deliver("a", a.tick(wire.now))
    a.receive(Message("gossip", "c", "addr-c", updates=(old,)), wire.now)
    a._to_confirm.clear()  # no out-of-turn probe either: only the last probe is left
    deadline = a._suspicions["b"].deadline()
    wire.cut.add(frozenset("ab"))  # a's gossip of the suspicion does not reach b...
    while a.next_deadline() < deadline:
        wire.now = a.next_deadline()
        wire.deliver("a", a.tick(wire.now))
    wire.cut.clear()  # ...but its last probe will
    assert wire.state("a", "b") == SUSPECT
    wire.now = deadline
    out = a.tick(deadline)
    assert [o.message.kind for o in out if o.to == "b"] == ["ping"]
    wire.deliver("a", out)  # b acks, sending its refutation again
    view = a.member("b")
    assert view is not None and (view.state, view.incarnation) == (ALIVE, 1)
    assert ("b", SUSPECT, ALIVE) in a.drain_events()


def test_the_member_that_acts_on_deaths_checks_every_accusation_itself() -> None:
    # In a large mesh about 2k + 2 random members probe an accused member themselves;
    # the one that revokes leases (confirm_all: the leader) always does, so the death
    # it acts on is one its own probe saw, with no check left to wait for then.
    names = [f"n{i}" for i in range(200)]
    wire = Wire(names)
    wire.down.add("n9")
    accusation = Message(
        "gossip", "n1", "addr-n1", updates=(Update("n9", "addr-n9", SUSPECT, 0, source="n1"),)
    )

    def probes_n9(name: str) -> bool:
        outs = wire.nodes[name].receive(accusation, 0.0) + wire.nodes[name].tick(0.0)
        return any(o.to == "n9" and o.message.kind == "ping" for o in outs)

    checkers = [n for n in names[2:] if n != "n9" and probes_n9(n)]
    assert 2 <= len(checkers) <= 30  # about 2k + 2 = 10 of 197
    leader = Wire(names).nodes["n0"]
    leader.confirm_all = True
    wire.nodes["n0"] = leader
    assert probes_n9("n0")
    wire.run_until(1.0)
    assert leader.witnessed("n9") is not None


def test_confirmations_from_distinct_members_shorten_the_suspicion() -> None:
    names = [f"n{i}" for i in range(12)]
    wire = Wire(names)
    a = wire.nodes["n0"]
    low, high = suspicion_bounds(12, CFG)
    k = CFG.suspicion_confirmations
    a.receive(
        Message("gossip", "n1", "x", updates=(Update("n9", "addr-n9", SUSPECT, 0, source="n1"),)),
        0.0,
    )
    deadlines = []
    # n1 accused: no confirmation; n2 confirms once; n3..n5 count until k; n6 is extra
    sources = ["n1", "n2", "n2", "n3", "n4", "n5", "n6"]
    confirmed = [set(), {"n2"}, {"n2"}, {"n2", "n3"}, {"n2", "n3", "n4"}]
    confirmed += [{"n2", "n3", "n4", "n5"}] * 2
    for source, want in zip(sources, confirmed, strict=True):
        a.receive(
            Message(
                "gossip", source, "x", updates=(Update("n9", "addr-n9", SUSPECT, 0, source=source),)
            ),
            0.0,
        )
        suspicion = a._suspicions["n9"]
        assert (suspicion.accuser, suspicion.confirmers) == ("n1", want), source
        assert wire.state("n0", "n9") == SUSPECT  # confirmations never kill before the deadline
        deadlines.append(suspicion.deadline())
    expected = [lifeguard_timeout(c, k, low, high) for c in (0, 1, 1, 2, 3, 4, 4)]
    assert deadlines == pytest.approx(expected)
    assert deadlines[-1] == pytest.approx(low)
    advance(a, low - 1e-6)
    assert wire.state("n0", "n9") == SUSPECT
    advance(a, low)
    assert wire.state("n0", "n9") == DEAD


def test_a_suspect_refutes_with_a_higher_incarnation_and_is_alive_again() -> None:
    wire = Wire(["a", "b", "c"])
    a, b = wire.nodes["a"], wire.nodes["b"]
    suspect_b = Update("b", "addr-b", SUSPECT, 0, source="a")
    a.receive(Message("gossip", "c", "x", updates=(suspect_b,)), 0.0)
    assert wire.state("a", "b") == SUSPECT
    out = b.receive(Message("gossip", "a", "addr-a", updates=(suspect_b,)), 0.0)
    assert out == [] and b.incarnation == 1 and b.local_health == 1
    wire.deliver("b", b.tick(b.next_deadline()))
    wire.run_until(1.0)
    assert wire.state("a", "b") == ALIVE
    assert a.member("b").incarnation == 1  # type: ignore[union-attr]
    assert ("b", SUSPECT, ALIVE) in a.drain_events()
    # an old suspicion (lower incarnation) is no news any more
    b.receive(Message("gossip", "a", "addr-a", updates=(suspect_b,)), 1.0)
    assert b.incarnation == 1


def test_a_member_declared_dead_refutes_and_comes_back() -> None:
    wire = Wire(["a", "b", "c"])
    a, b = wire.nodes["a"], wire.nodes["b"]
    dead_b = Update("b", "addr-b", DEAD, 0, source="a")
    a.receive(Message("gossip", "c", "x", updates=(dead_b,)), 0.0)
    assert wire.state("a", "b") == DEAD
    wire.down.add("b")  # b is busy elsewhere for a while (it neither probes nor hears)
    wire.run_until(0.5)
    wire.down.clear()
    assert wire.state("a", "b") == DEAD  # nobody probes or gossips to the dead...
    b.receive(Message("gossip", "a", "addr-a", updates=(dead_b,)), 0.5)  # ...until b hears it
    assert b.incarnation == 1
    wire.run_until(1.5)
    assert wire.state("a", "b") == ALIVE and wire.state("c", "b") == ALIVE
    assert ("b", DEAD, ALIVE) in a.drain_events()


def test_dead_and_left_members_are_not_probed_and_stale_news_is_ignored() -> None:
    wire = Wire(["a", "b", "c", "d"])
    wire.down.update("bd")  # silent: they do not refute
    a = wire.nodes["a"]
    a.receive(
        Message(
            "gossip",
            "c",
            "x",
            updates=(
                Update("b", "addr-b", DEAD, 0, source="c"),
                Update("d", "addr-d", LEFT, 0, source="d"),
                Update("zz", "addr-zz", DEAD, 3, source="c"),  # a stranger: ignored
                Update("b", "addr-b", SUSPECT, 0, source="d"),  # dead beats suspect
                Update("b", "addr-b", ALIVE, 0),  # not a refutation
            ),
        ),
        0.0,
    )
    assert wire.state("a", "b") == DEAD and wire.state("a", "d") == LEFT
    assert a.member("zz") is None
    wire.run_until(2.0)
    pinged = {o.to for s, o in wire.log if s == "a" and o.message.kind == "ping"}
    assert pinged == {"c"}
    assert a.live_count() == 2


# ---------------------------------------------------------------- dissemination


def test_meta_spreads_with_its_version_and_stale_versions_are_ignored() -> None:
    wire = Wire(["a", "b", "c", "d"])
    a = wire.nodes["a"]
    a.set_meta({"free_gpus": 2}, 0.0)
    a.set_meta({"free_gpus": 1}, 0.0)
    wire.run_until(1.0)
    for n in "bcd":
        view = wire.nodes[n].member("a")
        assert view is not None and view.meta == {"free_gpus": 1} and view.meta_version == 2
        assert wire.nodes[n].drain_meta_changes() == ["a"]
    stale = Update.alive("a", "addr-a", 0, 1, {"free_gpus": 2})
    wire.nodes["b"].receive(Message("gossip", "c", "x", updates=(stale,)), 1.0)
    assert wire.nodes["b"].member("a").meta == {"free_gpus": 1}  # type: ignore[union-attr]
    assert wire.nodes["b"].drain_meta_changes() == []
    with pytest.raises(ValueError, match="max_meta_bytes"):
        a.set_meta({"x": "y" * CFG.max_meta_bytes}, 1.0)


def test_a_restarted_member_s_new_meta_replaces_its_old_life_s_once_it_refutes() -> None:
    """A member restarted under its name counts meta versions from 1 again: its
    refutation (a higher incarnation) carries its new meta, and that meta counts
    although its version is below what the old life reached."""
    wire = Wire(["a", "b"])
    a, b = wire.nodes["a"], wire.nodes["b"]
    for v in range(5):
        a.set_meta({"chunks": f"old-{v}"}, 0.0)
    wire.run_until(1.0)
    assert b.member("a").meta_version == 5  # type: ignore[union-attr]
    b.drain_meta_changes()
    # the new life: same name, a new address, meta version 1, then its refutation
    reborn = Update.alive("a", "addr-a2", 0, 1, {"chunks": "new"})
    b.receive(Message("gossip", "a", "addr-a2", updates=(reborn,)), 1.0)
    assert b.member("a").meta == {"chunks": "old-4"}  # type: ignore[union-attr]
    refuted = Update.alive("a", "addr-a2", 1, 2, {"chunks": "new"})
    b.receive(Message("gossip", "a", "addr-a2", updates=(refuted,)), 1.1)
    view = b.member("a")
    assert view is not None and view.meta == {"chunks": "new"} and view.incarnation == 1
    assert b.drain_meta_changes() == ["a"]
    later = Update.alive("a", "addr-a2", 1, 3, {"chunks": "newer"})  # and it goes on from there
    b.receive(Message("gossip", "a", "addr-a2", updates=(later,)), 1.2)
    assert b.member("a").meta == {"chunks": "newer"}  # type: ignore[union-attr]
    stale = Update.alive("a", "addr-a2", 1, 2, {"chunks": "new"})
    b.receive(Message("gossip", "a", "addr-a2", updates=(stale,)), 1.3)
    assert b.member("a").meta == {"chunks": "newer"}  # type: ignore[union-attr]


def test_a_member_restarted_at_a_new_address_outbids_its_old_life_s_row() -> None:
    """A member back under its name at a new address joins; its peer answers with the
    old life's alive row, of the same incarnation (and meta version) as the new life's
    first row, which the peer therefore did not take. The new life refutes it: its
    address comes with a higher incarnation, which the peer takes."""
    wire = Wire(["a", "b"])
    b = wire.nodes["b"]
    wire.run_until(1.0)
    old = b.member("a")
    assert old is not None and old.incarnation == 0 and old.address == "addr-a"
    reborn = Swim("a", "addr-a2", CFG, random.Random(7), 1.0)
    replies = []
    for out in reborn.join([("b", "addr-b")], 1.0):
        assert out.to == "b"
        replies += b.receive(out.message, 1.0)
    assert b.member("a").address == "addr-a"  # type: ignore[union-attr]
    for out in replies:
        assert out.to == "a" and out.address == "addr-a2"
        reborn.receive(out.message, 1.0)
    assert reborn.incarnation == 1
    now = 1.0
    while now < 3.0 and b.member("a").address != "addr-a2":  # type: ignore[union-attr]
        now += 0.05
        for out in reborn.tick(now):
            if out.to == "b":
                b.receive(out.message, now)
    view = b.member("a")
    assert view is not None and view.address == "addr-a2" and view.incarnation == 1
    assert view.state == ALIVE


def test_an_update_is_sent_retransmit_limit_times_then_dropped() -> None:
    names = [f"n{i}" for i in range(9)]  # N = 9: limit = 4 * ceil(log10(10)) = 4
    wire = Wire(names)
    a = wire.nodes["n0"]
    a.set_meta({"v": 1}, 0.0)
    carried = []
    for t in range(400):
        now = t * 0.01
        out = a.tick(now)
        carried += [o for o in out if any(u.member == "n0" for u in o.message.updates)]
    assert len(carried) == CFG.retransmit_mult * 1
    assert "n0" not in a._queue


def test_push_pull_repairs_a_member_table() -> None:
    cfg = GossipConfig.local(reconnect_interval=0.0)
    wire = Wire(["a", "b"], cfg=cfg)
    a, b = wire.nodes["a"], wire.nodes["b"]
    # what gossip lost: b never heard of x, of y's death, or of a's new meta
    a.receive(
        Message(
            "gossip",
            "q",
            "x",
            updates=(Update.alive("x", "addr-x", 2, 1, {"k": 1}), Update("y", "addr-y", ALIVE, 0)),
        ),
        0.0,
    )
    b.receive(Message("gossip", "q", "x", updates=(Update("y", "addr-y", ALIVE, 0),)), 0.0)
    a.receive(
        Message("gossip", "q", "x", updates=(Update("y", "addr-y", DEAD, 0, source="q"),)), 0.0
    )
    a._meta_json, a._meta_version = '{"load":3}', 5
    a._store_self(0.0)
    wire.deliver("a", [push_pull_request(a, "b", "addr-b")])
    x = b.member("x")
    assert x is not None and (x.state, x.incarnation, x.meta) == (ALIVE, 2, {"k": 1})
    assert b.member("a").meta == {"load": 3}  # type: ignore[union-attr]
    assert wire.state("b", "y") == SUSPECT  # a death reported by push-pull is a suspicion
    assert a.member("b") is not None and a.member("b").state == ALIVE  # type: ignore[union-attr]


def test_push_pull_runs_on_its_own_timer() -> None:
    cfg = GossipConfig.local(reconnect_interval=0.0)
    wire = Wire(["a", "b", "c"], cfg=cfg)
    wire.run_until(cfg.push_pull_interval * 1.01)
    assert wire.kinds().count("push_pull") >= 3
    assert wire.kinds().count("push_pull_reply") == wire.kinds().count("push_pull")


# ---------------------------------------------------------------- join and leave


def test_join_through_a_seed_then_everyone_knows_everyone() -> None:
    cfg = GossipConfig.local(reconnect_interval=0.0)
    names = [f"n{i}" for i in range(6)]
    wire = Wire(names, cfg=cfg, roster=False)
    for i, n in enumerate(names[1:], start=1):
        wire.now = i * 0.01
        wire.deliver(n, wire.nodes[n].join([("n0", "addr-n0")], wire.now))
    wire.run_until(3.0)
    for n in names:
        assert {v.name for v in wire.nodes[n].members().values() if v.state == ALIVE} == set(names)
    assert ("n5", "", ALIVE) in wire.nodes["n1"].drain_events()


def test_join_tries_the_next_seed_when_one_refuses() -> None:
    wire = Wire(["a", "b", "c"], roster=False)
    wire.refusing.add("b")
    a = wire.nodes["a"]
    wire.deliver("a", a.join([("b", "addr-b"), ("c", "addr-c"), ("a", "addr-a")], 0.0))
    pulls = [o.to for s, o in wire.log if s == "a" and o.message.kind == "push_pull"]
    assert pulls in (["c"], ["b", "c"])
    assert wire.nodes["c"].member("a") is not None


def test_leave_is_broadcast_and_the_member_is_not_probed_again() -> None:
    wire = Wire(["a", "b", "c", "d"])
    wire.deliver("d", wire.nodes["d"].leave(0.0))
    wire.run_until(1.0)
    for n in "abc":
        assert wire.state(n, "d") == LEFT
        assert ("d", ALIVE, LEFT) in wire.nodes[n].drain_events()
    wire.log.clear()
    wire.run_until(2.0)
    assert not [o for s, o in wire.log if o.to == "d" and o.message.kind == "ping"]
    assert wire.nodes["d"].incarnation == 0  # a member that left does not refute


# ---------------------------------------------------------------- local health


def test_late_ticks_raise_local_health_and_stretch_the_probe_timeout() -> None:
    wire = Wire(["a", "b", "c", "d"])
    a = wire.nodes["a"]
    due = a.next_deadline()
    a.tick(due + CFG.late_tick_threshold * 0.5)
    assert a.local_health == 0
    late = a.next_deadline() + CFG.late_tick_threshold * 3
    assert a.tick(late) == []  # voids probes in flight; no accusations from a stalled loop
    assert a.local_health == 1
    wire.down.update("bcd")
    start = a.next_deadline()
    assert start == pytest.approx(late + 2 * CFG.protocol_period)
    wire.now = start
    one(a, start)
    assert not [o for o in a.tick(start + CFG.probe_timeout * 1.5) if o.message.kind == "ping_req"]
    reqs = [o for o in a.tick(start + 2 * CFG.probe_timeout) if o.message.kind == "ping_req"]
    assert len(reqs) == 2


def test_failed_probes_without_nacks_raise_local_health_and_acks_lower_it() -> None:
    wire = Wire(["a", "b", "c", "d"])
    a = wire.nodes["a"]
    wire.cut.update(frozenset(("a", x)) for x in "bcd")  # a is cut off: no acks, no nacks
    start = a.next_deadline()
    wire.run_until(start + CFG.protocol_period)
    assert a.local_health == 2  # two indirect probers, neither answered
    wire.cut.clear()
    wire.run_until(start + 20 * CFG.protocol_period)
    assert a.local_health == 0
    assert a.live_count() == 4


def test_a_node_that_was_stalled_does_not_accuse_the_peer_it_was_probing() -> None:
    wire = Wire(["a", "b", "c"])
    a = wire.nodes["a"]
    start = a.next_deadline()
    a.tick(start)  # ping out; the ack would arrive while a is stalled
    wire.run_until(start + 10 * CFG.protocol_period)
    assert all(v.state == ALIVE for v in a.members().values())


def test_a_confirmation_that_makes_a_suspicion_overdue_is_not_taken_for_a_stall() -> None:
    roster = Roster([(n, f"addr-{n}") for n in "abcde"])
    a = Swim("a", "addr-a", CFG, random.Random(1), 0.0, roster=roster)
    now = 0.0

    def run(until: float) -> None:  # on time; every ping acked, everything else dropped
        nonlocal now
        while a.next_deadline() <= until:
            now = max(now, a.next_deadline())
            outs = a.tick(now)
            while outs:
                o = outs.pop()
                if o.message.kind == "ping":
                    outs += a.receive(Message("ack", o.to, o.address, seq=o.message.seq), now)
        now = until

    def suspect_e(accuser: str) -> Message:
        update = Update("e", "addr-e", SUSPECT, 0, source=accuser)
        return Message("gossip", accuser, f"addr-{accuser}", updates=(update,))

    a.receive(suspect_e("b"), 0.0)
    low, high = suspicion_bounds(5, CFG)
    run(0.3)  # past the shortest timeout, short of the longest
    assert low + CFG.late_tick_threshold < 0.3 < high
    assert a.member("e").state == SUSPECT and a.local_health == 0  # type: ignore[union-attr]
    for confirmer in "cd":  # the deadline moves to before now: due at once, not overdue
        a.receive(suspect_e(confirmer), now)
    a.tick(now)
    assert a.member("e").state == DEAD  # type: ignore[union-attr]
    assert a.local_health == 0 and not [e for e in a.log if e[2] == "late-tick"]


# ---------------------------------------------------------------- refused fast path


def _probe_of(wire: Wire, prober: str) -> tuple[float, str]:
    node = wire.nodes[prober]
    start = node.next_deadline()
    wire.now = start
    out = node.tick(start)
    target = next(o.to for o in out if o.message.kind == "ping")
    return start, target


def test_refused_direct_probe_with_a_refusing_indirect_prober_declares_dead_at_once() -> None:
    wire = Wire(["a", "b", "c", "d", "e"])
    start, target = _probe_of(wire, "a")
    wire.refusing.add(target)
    out = wire.nodes["a"].send_failed(target, start, refused=True)
    assert len([o for o in out if o.message.kind == "ping_req"]) == 3
    wire.deliver("a", out)
    assert wire.state("a", target) == DEAD
    assert (target, ALIVE, DEAD) in wire.nodes["a"].drain_events()
    wire.run_until(start + 2 * CFG.protocol_period)
    assert all(wire.state(n, target) == DEAD for n in wire.nodes if n != target)


def test_refused_fast_path_off_only_hastens_suspicion() -> None:
    cfg = GossipConfig.local(push_pull_interval=0.0, reconnect_interval=0.0, refused_quorum=0)
    wire = Wire(["a", "b", "c", "d", "e"], cfg=cfg)
    start, target = _probe_of(wire, "a")
    wire.refusing.add(target)
    wire.deliver("a", wire.nodes["a"].send_failed(target, start, refused=True))
    assert wire.state("a", target) == SUSPECT  # every prober answered: no need to wait


def test_a_refused_gossip_message_triggers_a_probe_of_its_receiver() -> None:
    wire = Wire(["a", "b", "c", "d"])
    wire.refusing.add("d")
    out = wire.nodes["a"].send_failed("d", 0.0, refused=True)
    assert {o.message.kind for o in out} == {"ping_req"} and all(
        o.message.target == "d" for o in out
    )
    wire.deliver("a", out)
    assert wire.state("a", "d") == DEAD


def test_a_lost_connection_probes_its_member_out_of_turn_and_a_dead_one_dies_at_once() -> None:
    wire = Wire(["a", "b", "c", "d"])
    wire.run_until(0.3)
    wire.refusing.add("d")  # its process died: its port refuses
    a = wire.nodes["a"]
    out = a.connection_lost("d", "addr-d", wire.now)
    assert [(o.message.kind, o.to) for o in out] == [("ping", "d")]
    wire.deliver("a", out)  # refused, then refused through an indirect prober
    assert wire.state("a", "d") == DEAD


@pytest.mark.parametrize("case", ["probing", "moved", "suspect", "self", "left"])
def test_a_lost_connection_probes_only_a_live_member_at_that_address(case: str) -> None:
    wire = Wire(["a", "b", "c", "d"])
    wire.run_until(0.3)
    a = wire.nodes["a"]
    member, address = "d", "addr-d"
    if case == "probing":
        assert a.connection_lost("d", "addr-d", wire.now)  # the first probes it
    elif case == "moved":
        address = "addr-elsewhere"  # a stream to where d used to be
    elif case == "suspect":
        a.receive(Message("gossip", "b", "addr-b", updates=(
            Update("d", "addr-d", SUSPECT, 0, source="b"),)), wire.now)
        assert wire.state("a", "d") == SUSPECT
    elif case == "self":
        member, address = "a", "addr-a"
    else:
        wire.deliver("d", wire.nodes["d"].leave(wire.now))
        assert wire.state("a", "d") == LEFT
    assert a.connection_lost(member, address, wire.now) == []


def test_a_silent_member_waits_out_the_suspicion_even_when_many_probe_it() -> None:
    names = [f"n{i}" for i in range(10)]
    wire = Wire(names)
    wire.run_until(0.3)
    wire.down.add("n9")
    crash = wire.now
    low, _ = suspicion_bounds(10, CFG)
    wire.run_until(crash + CFG.protocol_period + low - 1e-6)
    assert all(wire.state(n, "n9") != DEAD for n in names[:-1])
    wire.run_until(crash + 40 * CFG.protocol_period)
    assert all(wire.state(n, "n9") == DEAD for n in names[:-1])


def test_a_relay_nacks_when_the_target_is_silent_and_refused_when_it_refuses() -> None:
    wire = Wire(["a", "b", "c"])
    b = wire.nodes["b"]
    req = Message("ping_req", "a", "addr-a", seq=42, target="c", target_addr="addr-c")
    out = b.receive(req, 0.0)
    assert [(o.to, o.message.kind, o.message.target) for o in out] == [("c", "ping", "c")]
    nack = [o for o in b.tick(CFG.probe_timeout) if o.message.kind == "nack"]
    assert [(o.to, o.message.seq, o.message.refused) for o in nack] == [("a", 42, False)]
    b.receive(req, 1.0)
    out = b.send_failed("c", 1.0, refused=True)
    assert [(o.to, o.message.kind, o.message.refused) for o in out] == [("a", "nack", True)]


def test_a_sick_member_gives_its_own_lone_accusations_longer_to_be_refuted() -> None:
    names = [f"n{i}" for i in range(8)]
    healthy, sick = Wire(names), Wire(names)
    sick.nodes["n0"]._awareness = 3
    for wire in (healthy, sick):
        wire.nodes["n0"].receive(
            Message(
                "gossip", "n1", "x", updates=(Update("n5", "addr-n5", SUSPECT, 0, source="n0"),)
            ),
            0.0,
        )
    _, high = suspicion_bounds(8, CFG)
    assert healthy.nodes["n0"]._suspicions["n5"].deadline() == pytest.approx(high)
    assert sick.nodes["n0"]._suspicions["n5"].deadline() == pytest.approx(4 * high)
    # an accusation by someone else is not stretched by our own health
    sick.nodes["n0"].receive(
        Message("gossip", "n1", "x", updates=(Update("n6", "addr-n6", SUSPECT, 0, source="n1"),)),
        0.0,
    )
    assert sick.nodes["n0"]._suspicions["n6"].deadline() == pytest.approx(high)
    # independent confirmations bring our own accusation down to the healthy minimum
    low, _ = suspicion_bounds(8, CFG)
    for who in ("n2", "n3", "n4", "n6"):
        update = Update("n5", "addr-n5", SUSPECT, 0, source=who)
        sick.nodes["n0"].receive(Message("gossip", who, "x", updates=(update,)), 0.1)
    assert sick.nodes["n0"]._suspicions["n5"].deadline() == pytest.approx(low)


def test_an_accusation_heard_from_another_is_checked_out_of_turn() -> None:
    wire = Wire(["a", "b", "c"])
    a = wire.nodes["a"]
    a.receive(
        Message("gossip", "c", "addr-c", updates=(Update("b", "addr-b", SUSPECT, 0, source="c"),)),
        0.0,
    )
    assert a.next_deadline() < 0.0  # due at once
    wire.down.add("b")
    wire.now = 0.001
    out = a.tick(wire.now)
    assert [(o.to, o.message.kind) for o in out if o.message.kind == "ping"] == [("b", "ping")]
    wire.deliver("a", out)
    # b is silent: a's own verdict confirms c's, and the suspicion is at its shortest
    wire.run_until(1.5 * CFG.protocol_period)
    susp = a._suspicions["b"]
    assert susp.confirmers == {"a"}
    assert susp.deadline() == pytest.approx(susp.start + suspicion_bounds(3, CFG)[0])


def test_a_stale_accusation_makes_the_accused_repeat_its_refutation() -> None:
    wire = Wire(["a", "b", "c"])
    b = wire.nodes["b"]
    old = Update("b", "addr-b", SUSPECT, 0, source="a")
    b.receive(Message("gossip", "a", "addr-a", updates=(old,)), 0.0)
    advance(b, 1.0)
    assert "b" not in b._queue and b.incarnation == 1
    health = b.local_health
    out = b.receive(Message("ping", "c", "addr-c", seq=3, target="b", updates=(old,)), 1.0)
    assert b.incarnation == 1 and b.local_health == health  # no new incarnation, no penalty
    assert [(u.member, u.state, u.incarnation) for u in out[0].message.updates] == [("b", ALIVE, 1)]
