"""The piggyback queue: order, tiers, replacement, retransmit limit; the update wire format."""

from __future__ import annotations

import json

import pytest

from hypermesh.agent.gossip.broadcast import ALIVE, DEAD, SUSPECT, BroadcastQueue, Message, Update
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.dissemination import quiet_change


def up(member: str, inc: int = 0, state: str = ALIVE) -> Update:
    return Update(member, f"addr-{member}", state, inc)


def test_least_transmitted_first_and_newest_first_among_equals() -> None:
    q = BroadcastQueue()
    for m in "abc":
        q.push(up(m))
    assert [u.member for u in q.take(2, 10)] == ["c", "b"]
    q.push(up("d"))
    assert [u.member for u in q.take(3, 10)] == ["d", "a", "c"]
    assert [u.member for u in q.pending()] == ["d", "a", "b", "c"]
    assert [q.transmits(m) for m in "abcd"] == [1, 1, 2, 1]


def test_an_update_about_a_member_replaces_the_queued_one_and_starts_unsent() -> None:
    q = BroadcastQueue()
    q.push(up("x", 0))
    q.take(5, 10)
    q.push(up("x", 1, SUSPECT))
    assert len(q) == 1 and q.transmits("x") == 0
    assert q.get("x") == up("x", 1, SUSPECT)
    q.drop("x")
    assert not q and "x" not in q and q.get("x") is None


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_updates_leave_after_the_retransmit_limit(limit: int) -> None:
    q = BroadcastQueue()
    q.push(up("a"))
    q.push(up("b"))
    sent = [u.member for _ in range(limit + 3) for u in q.take(8, limit)]
    assert sorted(sent) == ["a"] * limit + ["b"] * limit
    assert not q


def test_a_lower_limit_drops_what_was_already_sent_enough() -> None:
    q = BroadcastQueue()
    q.push(up("a"))
    for _ in range(3):
        q.take(1, 10)
    q.push(up("b"))
    assert [u.member for u in q.take(5, 2)] == ["b"]  # a was sent 3 times: over the new limit
    assert "a" not in q


def test_skip_leaves_one_member_alone() -> None:
    q = BroadcastQueue()
    q.push(up("a"))
    q.push(up("b"))
    assert [u.member for u in q.take(5, 10, skip="b")] == ["a"]
    assert q.transmits("b") == 0


def test_loud_updates_go_first_and_quiet_ones_fill_the_room_left() -> None:
    q = BroadcastQueue()
    q.push(up("load1"), quiet=True)
    q.push(up("load2"), quiet=True)
    assert len(q) == 2 and not q.loud and q.is_quiet("load1")
    q.push(up("dead", 3, DEAD))
    assert q.loud
    assert [u.member for u in q.take(2, 10)] == ["dead", "load2"]
    assert [u.member for u in q.take(5, 10)] == ["dead", "load1", "load2"]
    assert [u.member for u in q.pending()] == ["dead", "load1", "load2"]


def test_a_quiet_update_replacing_a_loud_one_stays_loud() -> None:
    # The newer row carries the older one's news (a refutation, a new address) too.
    q = BroadcastQueue()
    q.push(up("x", 1))
    q.push(up("x", 1), quiet=True)
    assert q.loud and not q.is_quiet("x")
    q.take(1, 1)  # sent enough: gone
    q.push(up("x", 1), quiet=True)
    assert not q.loud and q.is_quiet("x")
    q.push(up("x", 2, SUSPECT))
    assert q.loud and not q.is_quiet("x") and len(q) == 1


def test_a_quiet_update_carries_the_loud_news_only_for_the_sends_it_had_left() -> None:
    # Replacing the loud row must not restart its count: a member whose load changes
    # more often than its loud news takes to spread would stay loud for ever.
    q = BroadcastQueue()
    q.push(up("x", 1))
    for _ in range(3):
        q.take(1, 5)
    q.push(up("x", 1), quiet=True)
    assert q.loud and q.transmits("x") == 3
    q.take(1, 5)
    q.push(up("x", 1), quiet=True)
    assert q.loud and q.transmits("x") == 4
    q.take(1, 5)  # the news' fifth send: done; these counts were sent once
    assert not q.loud and q.is_quiet("x") and q.transmits("x") == 1
    for _ in range(4):  # the counts' own sends 2 to 5
        assert [u.member for u in q.take(2, 5)] == ["x"]
    assert "x" not in q
    q.push(up("x", 1), quiet=True)
    assert not q.loud and q.is_quiet("x") and q.transmits("x") == 0


def test_counts_that_took_over_loud_news_get_their_own_sends_as_quiet_news() -> None:
    q = BroadcastQueue()
    q.push(up("x", 1))
    q.take(1, 5)
    q.take(1, 5)
    q.push(Update("x", "addr-x", ALIVE, 1, 7, '{"running":1}'), quiet=True)  # at 2 sends
    for _ in range(3):
        assert q.loud
        q.take(1, 5)  # the news' sends 3 to 5, the counts' 1 to 3
    assert not q.loud and q.is_quiet("x") and q.transmits("x") == 3
    taken = [q.take(1, 5) for _ in range(3)]
    assert [len(t) for t in taken] == [1, 1, 0]  # the counts' sends 4 and 5, then gone
    assert taken[0][0].meta_version == 7 and "x" not in q


@pytest.mark.parametrize(
    ("old", "new", "quiet"),
    [
        ('{"running":1,"slots":4}', '{"running":2,"slots":4}', True),
        ('{"running":1}', '{"running":1,"free_gpus":0}', True),
        ('{"running":1,"slots":4}', '{"running":2,"slots":8}', False),
        ('{"running":1}', '{"running":1,"chunks":"x"}', False),
        ('{"running":1}', '{"running":1}', True),  # a newer version, counts back where they were
        ('{"running":1}', None, False),
    ],
)
def test_only_changes_confined_to_the_quiet_keys_are_quiet(
    old: str, new: str | None, quiet: bool
) -> None:
    keys = GossipConfig().quiet_meta
    assert quiet_change(keys, old, new) is quiet
    assert quiet_change(frozenset(), old, new) is False


def test_update_wire_round_trip_drops_trailing_defaults() -> None:
    alive = Update.alive("n1", "h:1", 2, 3, {"z": 1, "a": [1, 2]})
    assert alive.meta_json == '{"a":[1,2],"z":1}' and alive.meta == {"a": [1, 2], "z": 1}
    assert Update.from_wire(alive.to_wire()) == alive
    dead = Update("n2", "h:2", DEAD, 4, source="n1")
    assert dead.to_wire() == ["n2", "h:2", 2, 4, 0, None, "n1"]
    assert up("n3").to_wire() == ["n3", "addr-n3", 0, 0]
    assert Update.from_wire(["n3", "h:3", 0, 0]) == Update("n3", "h:3", ALIVE, 0)
    assert hash(alive) == hash(Update.from_wire(alive.to_wire()))


@pytest.mark.parametrize("message", [
    Message("ping", "n1", "h:1", seq=7, target="n2", target_addr="h:2"),
    Message("ack", "n2", "h:2", seq=7, updates=(
        Update.alive("n1", "h:1", 2, 3, {"z": 1, "a": [1, 2], "s": "é\"\\"}),
        Update("n2", "h:2", DEAD, 4, source="n1"),
        Update("n3", "h:3", SUSPECT, 1, 0, None, "n2"),
        Update("n4", "h:4", ALIVE, 0),
        Update.alive("n5", "h:5", 0, 0, {}),
    )),
    Message("push_pull_reply", "n1", "h:1", table=(Update.alive("n1", "h:1", 0, 1, {"r": 0}),),
            updates=(Update("n6", "h:6", ALIVE, 0),), refused=True, page=3),
])
def test_encode_writes_what_to_json_says(message: Message) -> None:
    """The transport's bytes (meta spliced in as held) are the JSON of ``to_json``,
    and decode to the same message."""
    payload = message.encode()
    assert json.loads(payload) == message.to_json()
    assert b" " not in payload  # compact, as json.dumps with separators writes it
    assert Message.from_json(json.loads(payload)) == message


@pytest.mark.parametrize(
    "row",
    [
        ["a", "b:1", 0],
        ["a", "b:1", 7, 0],
        ["a", 1, 0, 0],
        ["a", "b:1", 0, "1"],
        ["a", "b:1", 0, 0, 0, [1]],
        "abc",
    ],
)
def test_malformed_rows_are_rejected(row: object) -> None:
    with pytest.raises(ValueError):
        Update.from_wire(row)  # type: ignore[arg-type]
