"""Bounded push-pull (issue 23): which rows an exchange carries, and what it costs per member.

Row choice on one member built from a roster (pure, no network); then meshes on the
simulated network, virtual clock only.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from hypermesh.agent.gossip.antientropy import RECENT_SENDS, page, reply_rows, request_rows
from hypermesh.agent.gossip.broadcast import ALIVE, DEAD, SUSPECT, Message, Update
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.simnet import SimNet
from hypermesh.agent.gossip.suspicion import push_pull_period, suspicion_bounds
from hypermesh.agent.gossip.swim import Roster, Swim

K = 16
CFG = GossipConfig.local(push_pull_rows=K, push_pull_interval=0.0, reconnect_interval=0.0)
META = {"running": 3, "slots": 8, "free_slots": 5, "gpus": 4, "chunks": {"v": 17, "d": "9f2c"}}


def member(n: int, cfg: GossipConfig = CFG, name: str = "n0") -> Swim:
    roster = Roster([(f"n{i}", f"10.0.{i >> 8}.{i & 255}:7946") for i in range(n)])
    return Swim(name, roster.records[name].address, cfg, random.Random(1), 0.0, roster=roster)


def names(rows: tuple[Update, ...]) -> list[str]:
    return [u.member for u in rows]


def hear(s: Swim, *updates: Update) -> None:
    s.receive(Message("gossip", "n1", "10.0.0.1:7946", updates=updates), 0.0)


def address(s: Swim, name: str) -> str:
    rec = s._table.get(name)
    assert rec is not None
    return rec.address


def test_a_table_of_at_most_k_rows_goes_whole_as_before() -> None:
    s = member(K)
    assert request_rows(s) == s._table_rows()
    assert reply_rows(s, ()) == s._table_rows()
    assert page(s, 0) == (s._table_rows(), 0)


@pytest.mark.parametrize("n", [K + 1, 100, 500])
def test_every_message_is_bounded_and_starts_with_the_senders_own_row(n: int) -> None:
    s = member(n, name="n7")
    for _ in range(3 * n // K):
        rows = request_rows(s)
        assert len(rows) == K and rows[0].member == "n7"
        assert len(set(names(rows))) == K
    assert len(reply_rows(s, s._table_rows())) == K  # however large the request


@pytest.mark.parametrize("n", [K + 1, 100, 500])
def test_a_quiet_table_is_swept_whole_within_ceil_n_over_k_minus_one_exchanges(n: int) -> None:
    s = member(n)
    seen: set[str] = set()
    for _ in range(math.ceil((n - 1) / (K - 1))):
        seen.update(names(request_rows(s)))
    assert seen == {name for name, _ in s._table.items()}


def test_recent_changes_go_first_and_the_sweep_still_covers_the_table() -> None:
    n = 200
    s = member(n)
    # Many membership changes at once: they take at most K // 2 places, newest first.
    for i in range(100, 140):
        hear(s, Update(f"n{i}", address(s, f"n{i}"), SUSPECT, 0, source="n1"))
    rows = request_rows(s)
    assert names(rows)[1 : 1 + K // 2] == [f"n{i}" for i in range(139, 139 - K // 2, -1)]
    seen = set(names(rows))
    bound = math.ceil(n / (K - 1 - K // 2))  # the cursor passes K - 1 - K // 2 rows at least
    for _ in range(bound - 1):
        seen.update(names(request_rows(s)))
    assert len(seen) == n
    # Each change rides RECENT_SENDS exchanges as a recent row, then only the cursor's.
    s2 = member(n)
    hear(s2, Update("n150", address(s2, "n150"), DEAD, 0, source="n1"))
    firsts = [names(request_rows(s2))[1] for _ in range(RECENT_SENDS + 1)]
    assert firsts[:RECENT_SENDS] == ["n150"] * RECENT_SENDS and firsts[-1] != "n150"


def test_a_reply_corrects_the_stale_rows_of_the_request() -> None:
    s = member(100)
    hear(
        s,
        Update("n42", address(s, "n42"), SUSPECT, 0, source="n1"),
        Update.alive("n43", address(s, "n43"), 0, 3, {"k": 1}),
    )
    s._changed.clear()  # not as a recent row: as a correction
    stale = (
        Update("n9", "10.0.0.9:7946", ALIVE, 0),
        Update("n42", "10.0.0.42:7946", ALIVE, 0),
        Update("n43", "10.0.0.43:7946", ALIVE, 0, 1, "{}"),
    )
    rows = reply_rows(s, stale)
    assert names(rows)[:3] == ["n0", "n42", "n43"]  # n9 agrees: no correction
    assert rows[1].state == SUSPECT and rows[2].meta_version == 3


def test_pages_cover_the_whole_table_in_bounded_messages() -> None:
    n = 100
    s = member(n, name="n50")
    seen: set[str] = set()
    nxt, pages = 1, 0
    while nxt:
        rows, nxt = page(s, nxt - 1)
        assert len(rows) <= K and rows[0].member == "n50"
        seen.update(names(rows))
        pages += 1
    assert len(seen) == n and pages == math.ceil((n - 1) / (K - 1))
    assert page(s, 10**18) == ((s._table.get("n50").as_row("n50"),), 0)  # type: ignore[union-attr]


def test_a_joiner_asks_for_each_next_page_and_stops_at_the_last_or_a_backward_one() -> None:
    j = Swim("j", "10.9.9.9:7946", CFG, random.Random(1), 0.0)
    (first,) = j.join([("n0", "10.0.0.0:7946")], 0.0)
    assert first.message.kind == "push_pull" and first.message.page == 1
    seed_row = Update("n0", "10.0.0.0:7946", ALIVE, 0)

    def reply(page_no: int) -> list[tuple[int, list[str]]]:
        msg = Message("push_pull_reply", "n0", "10.0.0.0:7946", table=(seed_row,), page=page_no)
        out = j.receive(msg, 0.01)
        return [(o.message.page, names(o.message.table)) for o in out if o.to == "n0"]

    assert reply(16) == [(16, ["j"])]  # only its own row: the seed has the rest already
    assert reply(31) == [(31, ["j"])]
    assert reply(20) == [] and j._join_target == ""  # not a later page: the join ends there
    j.join([("n0", "10.0.0.0:7946")], 0.02)
    assert reply(0) == [] and j._join_target == ""  # no next page (or a seed before paging)


def test_page_survives_the_wire() -> None:
    msg = Message("push_pull", "a", "10.0.0.1:7946", page=7)
    assert Message.from_json(msg.to_json()) == msg
    assert "pg" not in Message("push_pull", "a", "10.0.0.1:7946").to_json()
    with pytest.raises(ValueError, match="page must be an integer"):
        Message.from_json({"k": "push_pull", "f": "a", "fa": "10.0.0.1:7946", "pg": -1})


# ---------------------------------------------------------------- on the simulated network

SIM = GossipConfig.local(push_pull_interval=0.5)  # push-pull every second past 32 members


def sent_per_period(n: int, periods: int = 100) -> tuple[float, float]:
    """(median, largest) bytes one member sends per protocol period in a quiet mesh of
    ``n``, every member with real-sized meta."""
    net = SimNet(n, SIM, seed=2, measure_bytes=True, meta=META)
    net.run_periods(5)
    before = list(net.stats.sent_bytes)
    net.run_periods(periods)
    sent = [(b - a) / periods for a, b in zip(before, net.stats.sent_bytes, strict=True)]
    return statistics.median(sent), max(sent)


def test_bytes_a_member_sends_per_period_do_not_grow_with_the_mesh() -> None:
    k = SIM.push_pull_rows
    assert push_pull_period(100, SIM) == push_pull_period(500, SIM) == 20 * SIM.protocol_period
    med100, max100 = sent_per_period(100)
    med500, max500 = sent_per_period(500)
    # A period: a ping and an ack out (~250 B), and push-pull: its own request and
    # about one reply, of at most k rows of ~140 B each, every 20 periods. Whole
    # tables at 500 members came to about 2,300 B (1,900 at 60 periods).
    bound = 250 + 2 * k * 140 / 20
    assert med500 < bound and med100 < bound
    assert med500 < 1.15 * med100 and max500 < 1.25 * max100


def test_in_a_mesh_of_500_a_crash_is_known_everywhere_and_a_joiner_learns_the_table() -> None:
    n = 500
    net = SimNet(n, SIM, seed=5, meta=META)
    net.run_periods(3)
    watch = net.watch("n42")
    crash = net.now
    net.crash("n42")
    _, high = suspicion_bounds(n, SIM)
    net.run_until(crash + 4 * SIM.protocol_period + high + 4 * SIM.protocol_period)
    views = net.views_of("n42")
    assert views["dead"] == sum(views.values()) == n - 1 and len(watch.states["dead"]) == n - 1
    net.run_periods(10)
    start = net.now
    joiner = net.add(["n0"])
    node = net.nodes[net.index[joiner]]
    alive = net.watch(joiner).states.setdefault("alive", {})
    # Paging: ceil(499 / (k - 1)) round trips of at most 2 * 2 ms, within one period.
    net.run_until(start + SIM.protocol_period)
    assert node.live_count() == n  # the 499 running and itself; n42 it knows dead
    dead = node.member("n42")  # a death in a push-pull is no news about a stranger
    assert dead is None or dead.state in (SUSPECT, DEAD)
    assert node.member("n7").meta == META  # type: ignore[union-attr]
    net.run_until(start + 10 * SIM.protocol_period)
    assert len(alive) == n - 1  # every running member but itself knows it
    assert not net.false_deaths
