"""Piggybacked rows that carry nothing new are left out unread (``Swim.stale_row``).

Most rows a member of a busy mesh receives are news it heard before (an update is
re-gossiped by every member that learns it); checking and decoding each one again cost
the receiver most of a message's decoding. The test must never leave out news: on random
rows, a table that read every row and one that read only the rows ``stale_row`` let
through end the same. Then the wiring: ``Message.from_json`` leaves out stale update
rows (never table rows, which a push-pull reply is worked out from), and the gossip duty
decodes what it receives with the test."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from hypermesh.agent.gossip.broadcast import STATES, Message, Update
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.duty import Gossip
from hypermesh.agent.gossip.swim import ALIVE, Swim
from hypermesh.agent.gossip.trust import MALFORMED
from hypermesh.state.records import NodeRecord
from tests.gossip.test_gossip_new_life import _Agent

CFG = GossipConfig.local(push_pull_interval=0.0, reconnect_interval=0.0)
ADDR = "127.0.0.1:7002"
ALIVE_CODE = STATES.index(ALIVE)


def node1() -> Swim:
    """node1's table with node2 alive at incarnation 3, meta version 5."""
    swim = Swim("node1", "127.0.0.1:7001", CFG, random.Random(1), 0.0, meta={"running": 0})
    swim.receive(Message("gossip", "node2", ADDR,
                         updates=(Update.alive("node2", ADDR, 3, 5, {"running": 1}),)), 0.1)
    view = swim.member("node2")
    assert view is not None and (view.incarnation, view.meta_version) == (3, 5)
    return swim


@pytest.mark.parametrize(("row", "stale"), [
    (["node2", ADDR, ALIVE_CODE, 3, 5, {"running": 1}], True),  # what we hold
    (["node2", ADDR, ALIVE_CODE, 3, 4, {"running": 0}], True),  # an older meta
    (["node2", ADDR, ALIVE_CODE, 2, 9, {"running": 0}], True),  # an older life
    (["node2", ADDR, ALIVE_CODE, 3], True),  # no meta version: 0
    (["node2", "not an address", ALIVE_CODE, 3, 5], True),  # not read, so not refused
    (["node2", ADDR, ALIVE_CODE, 3, 6, {"running": 0}], False),  # newer meta
    (["node2", ADDR, ALIVE_CODE, 4, 0, {"running": 0}], False),  # a newer life
    (["node2", ADDR, STATES.index("suspect"), 3, 0, None, "node3"], False),  # not alive
    (["node2", ADDR, STATES.index("dead"), 2], False),
    (["node9", ADDR, ALIVE_CODE, 0, 0, {}], False),  # a stranger
    (["node1", "127.0.0.1:7001", ALIVE_CODE, 0, 0, {}], False),  # about us: refuted
    (["node2", ADDR, True, 3, 5], False),  # a bool is no state code
    (["node2", ADDR, ALIVE_CODE, True, 5], False),
    (["node2", ADDR, ALIVE_CODE, "3", 5], False),
    (["node2", ADDR, ALIVE_CODE, 3, "5"], False),
    (["node2", ADDR, ALIVE_CODE, 3.0, 5], False),
    ([["node2"], ADDR, ALIVE_CODE, 3, 5], False),
    (["node2", ADDR, ALIVE_CODE], False),
    ({"member": "node2"}, False),
    (None, False),
])
def test_only_alive_rows_of_what_we_hold_or_older_are_stale(row: Any, stale: bool) -> None:
    assert node1().stale_row(row) is stale


def _random_row(rng: random.Random) -> list[Any]:
    member = rng.choice(["node1", "node2", "node3", "node4"])
    state = rng.choice([ALIVE, ALIVE, ALIVE, "suspect", "dead"])
    incarnation, version = rng.randrange(4), rng.randrange(6)
    if state == ALIVE:
        row: list[Any] = [member, f"127.0.0.{member[-1]}:7946", ALIVE_CODE, incarnation,
                          version, {"running": rng.randrange(3)}]
    else:
        row = [member, f"127.0.0.{member[-1]}:7946", STATES.index(state), incarnation, 0,
               None, rng.choice(["node2", "node3", "node4"])]
    if rng.random() < 0.1:
        row[rng.randrange(len(row))] = rng.choice([None, "x", -1, True, 2.5, []])
    return row


def _state(swim: Swim) -> Any:
    views = {m: swim.member(m) for m in ("node1", "node2", "node3", "node4")}
    return (views, swim.drain_events(), swim.drain_meta_changes(), swim._queue.pending())


@pytest.mark.parametrize("seed", range(20))
def test_leaving_out_stale_rows_never_leaves_out_news(seed: int) -> None:
    rng = random.Random(seed)
    every, filtered = node1(), node1()
    filtered._rng = copy.deepcopy(every._rng)  # the same draws for the same rows
    skipped = 0
    for step in range(300):
        now = 0.2 + step * 0.01
        rows = [_random_row(rng) for _ in range(rng.randrange(1, 6))]
        sender = rng.choice(["node2", "node3"])
        data = {"k": "gossip", "f": sender, "fa": f"127.0.0.{sender[-1]}:7946", "u": rows}
        a = Message.from_json(json.loads(json.dumps(data)), [])
        b = Message.from_json(json.loads(json.dumps(data)), [], filtered.stale_row)
        skipped += len(a.updates) - len(b.updates)
        every.receive(a, now)
        filtered.receive(b, now)
        assert _state(every) == _state(filtered), f"seed {seed}, step {step}: {rows}"
    assert skipped > 0  # the test did leave rows out


def test_from_json_leaves_out_stale_update_rows_but_reads_every_table_row() -> None:
    swim = node1()
    held = ["node2", ADDR, ALIVE_CODE, 3, 5, {"running": 1}]
    news = ["node2", ADDR, ALIVE_CODE, 3, 6, {"running": 0}]
    data = {"k": "push_pull_reply", "f": "node3", "fa": "127.0.0.3:7946",
            "u": [held, news], "tb": [held, news]}
    message = Message.from_json(data, [], swim.stale_row)
    assert [u.meta_version for u in message.updates] == [6]
    assert [u.meta_version for u in message.table] == [5, 6]
    assert len(Message.from_json(data, []).updates) == 2  # without the test: every row


def test_the_gossip_duty_reads_only_the_news_it_receives() -> None:
    """A row the duty left out unread is not even refused when malformed; the same row
    as news is read, and refused."""
    gossip = Gossip(_Agent(NodeRecord("node2", ADDR, lease=0xA1)), CFG)  # type: ignore[arg-type]
    swim = gossip.swim = node1()

    def receive(row: list[Any]) -> int:
        payload = {"k": "gossip", "f": "node3", "fa": "127.0.0.3:7946", "u": [row]}
        before = swim.refusals.totals[MALFORMED]
        gossip.receive(json.dumps(payload).encode())
        return swim.refusals.totals[MALFORMED] - before

    assert receive(["node2", "not an address", ALIVE_CODE, 3, 5, {"running": 7}]) == 0
    assert receive(["node2", "not an address", ALIVE_CODE, 3, 6, {"running": 7}]) == 1
    view = swim.member("node2")
    assert view is not None and view.meta_version == 5
    assert receive(["node2", ADDR, ALIVE_CODE, 3, 6, {"running": 7}]) == 0
    view = swim.member("node2")
    assert view is not None and (view.meta_version, view.meta) == (6, {"running": 7})
