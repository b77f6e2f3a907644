"""Gangs, pure parts: the recipe's ``nodes``, the records' mirror, and ``gang.plan``
(joining the oldest open gang, the waiting bound, starting, restarting, recording)."""

from __future__ import annotations

import textwrap

import pytest

from hypermesh.agent.gang import policy as gang
from hypermesh.agent.gang.policy import GangConfig, Member
from hypermesh.errors import RecipeError
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.gangs import MemberEnd, Rendezvous, combine
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import NodeRecord
from tests.claims.test_claims import Feed

CFG = GangConfig(wait_s=5.0, backoff_s=10.0)
GANG = """
experiments:
  train:
    nodes: 2
    samples: 2
    command: [python3 train.py]
"""


def mesh(*names: str, recipe: str = GANG, tasks: int = 2) -> Feed:
    feed = Feed()
    for name in names:
        feed.put(feed.ks.node(name), NodeRecord(name, f"127.0.0.1:{len(name)}").to_json())
    feed.workflow("w", recipe)
    feed.tasks("w", "train", tasks)
    return feed


def node(name: str) -> NodeRecord:
    return NodeRecord(name, "127.0.0.1:1", slots=2)


def seat(feed: Feed, ref: TaskRef, rank: int, name: str) -> int:
    return feed.put(feed.ks.gang_seat(ref, rank), {"node": name, "host": "127.0.0.1"})


def plan(feed: Feed, name: str, members: dict[TaskRef, Member] | None = None,
         now: float = 0.0, backoff: dict[TaskRef, float] | None = None,
         free: int = 1) -> list[gang.Action]:
    return gang.plan(feed.view, node(name), members or {}, backoff or {}, free, now, CFG)


T0, T1 = TaskRef("w", "train", 0), TaskRef("w", "train", 1)


# ---------------------------------------------------------------------- recipe


def test_nodes_defaults_to_one_and_is_validated_with_field_and_line() -> None:
    assert parse_recipe("experiments:\n  e:\n    command: x\n").experiments[0].nodes == 1
    assert parse_recipe(GANG).experiments[0].nodes == 2
    for bad, message in (("0", "at least 1"), ("two", "expected an integer"),
                         ("1.5", "expected an integer")):
        with pytest.raises(RecipeError) as info:
            parse_recipe(f"experiments:\n  e:\n    command: x\n    nodes: {bad}\n")
        (problem,) = info.value.problems
        assert (problem.line, problem.path) == (4, "experiments.e.nodes")
        assert message in problem.message


def test_pruning_is_refused_for_gangs() -> None:
    text = GANG + "    objective: {metric: loss}\n    pruning: median\n"
    with pytest.raises(RecipeError) as info:
        parse_recipe(textwrap.dedent(text))
    assert [p.path for p in info.value.problems] == ["experiments.train.pruning"]


def test_nodes_survives_the_json_round_trip() -> None:
    recipe = parse_recipe(GANG)
    assert type(recipe).from_json(recipe.to_json()) == recipe


# ---------------------------------------------------------------------- joining


def test_every_agent_joins_the_oldest_open_gang_first() -> None:
    feed = mesh("a", "b", "c")
    assert plan(feed, "a") == [gang.Join(T0, 0)]
    seat(feed, T0, 0, "a")
    assert plan(feed, "b") == [gang.Join(T0, 1)]
    seat(feed, T0, 1, "b")
    # Gang 0 is full: the next agent sits in gang 1, never half of each.
    assert plan(feed, "c") == [gang.Join(T1, 0)]


def test_a_member_waiting_for_its_gang_joins_no_other() -> None:
    feed = mesh("a", "b", "c")
    rev = seat(feed, T0, 0, "a")
    members = {T0: Member(T0, 0, rev, since=0.0)}
    assert plan(feed, "a", members, free=1) == []


def test_no_seat_while_the_mesh_is_smaller_than_the_gang() -> None:
    feed = mesh("a")
    assert plan(feed, "a") == []
    assert feed.view.task_json(T0)["waiting"] == "waiting for 2 nodes, 1 in mesh"
    summary = feed.view.workflow_summary("w")["experiments"]["train"]
    assert summary["waiting"] == "waiting for 2 nodes, 1 in mesh"


def test_ordinary_claims_leave_gang_tasks_alone() -> None:
    from hypermesh.agent.claims.choose import LocalLoad, choose_claims

    feed = mesh("a", "b")
    assert choose_claims(feed.view, node("a"), LocalLoad(), 4) == []


# ---------------------------------------------------------------------- waiting


def test_a_seat_is_given_back_after_the_waiting_bound_and_the_gang_skipped_for_a_while() -> None:
    feed = mesh("a", "b", "c")
    rev = seat(feed, T0, 0, "a")
    members = {T0: Member(T0, 0, rev, since=100.0)}
    assert plan(feed, "a", members, now=104.0) == []
    assert plan(feed, "a", members, now=105.5) == [gang.Leave(T0, "timeout")]
    feed.delete(feed.ks.gang_seat(T0, 0))
    # Backing off gang 0, it may sit in gang 1 meanwhile.
    assert plan(feed, "a", {}, now=106.0, backoff={T0: 115.5}) == [gang.Join(T1, 0)]
    assert feed.view.task_json(T0)["waiting"] == "waiting for 2 nodes, 0 of 2 ranks held"


# ---------------------------------------------------------------------- starting and running


def full_gang(feed: Feed) -> tuple[dict[str, Member], dict[int, tuple[str, int]]]:
    revs = {r: seat(feed, T0, r, n) for r, n in enumerate(("a", "b"))}
    members = {n: Member(T0, r, revs[r], since=0.0) for r, n in enumerate(("a", "b"))}
    return members, {0: ("a", revs[0]), 1: ("b", revs[1])}


def start(feed: Feed, seats: dict[int, tuple[str, int]], attempt: int = 1) -> Rendezvous:
    feed.claim(T0, "a", attempt)
    rdv = Rendezvous(attempt, "127.0.0.1", 29500, seats, 0)
    rev = feed.put(feed.ks.gang_rendezvous(T0), rdv.to_json())
    return Rendezvous(attempt, "127.0.0.1", 29500, seats, rev)


def test_rank_zero_starts_a_full_gang_and_every_member_launches() -> None:
    feed = mesh("a", "b")
    members, seats = full_gang(feed)
    (action,) = plan(feed, "a", {T0: members["a"]}, free=0)
    assert isinstance(action, gang.Start)
    assert (action.plan.ref, action.plan.attempt, action.seats) == (T0, 1, seats)
    assert plan(feed, "b", {T0: members["b"]}, free=0) == []  # only rank 0 starts
    rdv = start(feed, seats)
    assert plan(feed, "a", {T0: members["a"]}, free=0) == [gang.Launch(T0, rdv)]
    assert plan(feed, "b", {T0: members["b"]}, free=0) == [gang.Launch(T0, rdv)]
    env = gang.rendezvous_env(T0, 1, rdv)
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                                "LOCAL_RANK")} == {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1",
        "LOCAL_RANK": "0"}
    assert env["HM_GANG_ID"] == "w.train.0.1"


def test_a_lost_member_stops_the_others_and_rank_zero_records_node_lost() -> None:
    feed = mesh("a", "b", "c")
    members, seats = full_gang(feed)
    rdv = start(feed, seats)
    a = members["a"]
    a.attempt, a.running = 1, True
    assert plan(feed, "a", {T0: a}, free=0) == []
    feed.delete(feed.ks.gang_seat(T0, 1))  # b's lease went
    assert plan(feed, "a", {T0: a}, free=0) == [gang.Stop(T0, "node-lost")]
    a.running, a.outcome = False, MemberEnd("failed", None, "node-lost")
    assert plan(feed, "a", {T0: a}, free=0) == [
        gang.Record(T0, rdv, MemberEnd("failed", None, "node-lost"), None)
    ]


def test_a_dead_rank_zero_stops_the_others_and_the_next_start_closes_its_attempt() -> None:
    feed = mesh("a", "b", "c")
    members, seats = full_gang(feed)
    start(feed, seats)
    b = members["b"]
    b.attempt, b.running = 1, True
    for key in (feed.ks.gang_rendezvous(T0), feed.ks.claim(T0), feed.ks.gang_seat(T0, 0)):
        feed.delete(key)  # all on a's lease
    assert plan(feed, "b", {T0: b}, free=0) == [gang.Stop(T0, "node-lost")]
    b.running = False
    c_rev = seat(feed, T0, 0, "c")
    c = Member(T0, 0, c_rev, since=0.0)
    (action,) = plan(feed, "c", {T0: c}, free=0)
    assert isinstance(action, gang.Start)
    assert action.plan.attempt == 2 and action.plan.lost is not None
    assert action.plan.lost.attempt == 1


def test_rank_zero_waits_for_every_member_then_records_one_outcome() -> None:
    feed = mesh("a", "b")
    members, seats = full_gang(feed)
    rdv = start(feed, seats)
    a = members["a"]
    a.attempt, a.outcome = 1, MemberEnd("succeeded", 0, "exit")
    assert plan(feed, "a", {T0: a}, free=0) == []  # rank 1 still runs
    feed.put(feed.ks.gang_end(T0, 1, 1), {"state": "failed", "exit_code": 3, "reason": "exit"})
    (action,) = plan(feed, "a", {T0: a}, free=0)
    assert action == gang.Record(T0, rdv, MemberEnd("failed", 3, "exit"), "failed")


def test_a_failed_member_stops_the_running_ones() -> None:
    feed = mesh("a", "b")
    members, seats = full_gang(feed)
    start(feed, seats)
    a = members["a"]
    a.attempt, a.running = 1, True
    feed.put(feed.ks.gang_end(T0, 1, 1), {"state": "failed", "exit_code": 3, "reason": "exit"})
    assert plan(feed, "a", {T0: a}, free=0) == [gang.Stop(T0, "peer-failed")]


def test_members_leave_once_the_task_has_a_result() -> None:
    feed = mesh("a", "b")
    members, _ = full_gang(feed)
    feed.put(feed.ks.result(T0), {"state": "succeeded", "attempt": 1, "exit_code": 0,
                                  "ended_at": 1.0})
    assert plan(feed, "b", {T0: members["b"]}, free=0) == [gang.Leave(T0, "done")]


def test_combine_prefers_counted_failures() -> None:
    ok = MemberEnd("succeeded", 0, "exit")
    assert combine({0: ok, 1: ok}) == ok
    lost = MemberEnd("failed", None, "peer-failed")
    assert combine({0: lost, 1: MemberEnd("failed", 2, "exit")}).exit_code == 2
    assert combine({0: ok, 1: lost}).reason == "node-lost"


def test_gang_config_is_validated() -> None:
    with pytest.raises(ValueError, match="wait_s must be > 0"):
        GangConfig(wait_s=0)


def test_a_full_gang_that_cannot_start_gives_its_seats_back_in_time() -> None:
    feed = mesh("a", "b", recipe=GANG + "    workers: 1\n")
    feed.slot("w", "train", 0)  # the one workers slot is taken (by gang 1, say)
    members, _ = full_gang(feed)
    assert plan(feed, "a", {T0: members["a"]}, now=9.0, free=0) == []
    assert plan(feed, "a", {T0: members["a"]}, now=10.5, free=0) == [gang.Leave(T0, "timeout")]


def test_a_draining_node_starts_and_joins_nothing_but_still_records() -> None:
    feed = mesh("a", "b", "c")
    members, seats = full_gang(feed)
    a = members["a"]
    assert gang.plan(feed.view, node("a"), {T0: a}, {}, 1, 0.0, CFG, accepting=False) == []
    rdv = start(feed, seats)
    assert gang.plan(feed.view, node("a"), {T0: a}, {}, 1, 0.0, CFG, accepting=False) == []
    a.attempt, a.outcome = 1, MemberEnd("failed", None, "preempted")
    (action,) = gang.plan(feed.view, node("a"), {T0: a}, {}, 1, 0.0, CFG, accepting=False)
    assert action == gang.Record(T0, rdv, MemberEnd("failed", None, "node-lost"), None)


def test_no_seat_while_too_few_nodes_have_the_hardware() -> None:
    feed = mesh("a", "b", recipe=GANG + "    hardware: {gpus: 1}\n")
    feed.put(feed.ks.node("a"), NodeRecord("a", "127.0.0.1:1", gpus=1).to_json())
    with_gpu = NodeRecord("a", "127.0.0.1:1", slots=2, gpus=1)
    assert gang.plan(feed.view, with_gpu, {}, {}, 1, 0.0, CFG) == []  # b has no GPU
    feed.put(feed.ks.node("b"), NodeRecord("b", "127.0.0.1:2", gpus=1).to_json())
    assert gang.plan(feed.view, with_gpu, {}, {}, 1, 0.0, CFG) == [gang.Join(T0, 0)]


def test_members_keep_their_seats_until_rank_zero_recorded_a_cancelled_attempt() -> None:
    feed = mesh("a", "b")
    members, seats = full_gang(feed)
    rdv = start(feed, seats)
    b = members["b"]
    b.attempt = 1  # its process ended (stopped by the cancel)
    feed.put(feed.ks.workflow_state("w"), {"state": "cancelled"})
    assert plan(feed, "b", {T0: b}, free=0) == []  # leaving now would look like a lost member
    a = members["a"]
    a.attempt, a.outcome = 1, MemberEnd("cancelled", None, "cancelled")
    assert plan(feed, "a", {T0: a}, free=0) == [
        gang.Record(T0, rdv, MemberEnd("cancelled", None, "cancelled"), "cancelled")]
    feed.delete(feed.ks.gang_rendezvous(T0))
    assert plan(feed, "b", {T0: b}, free=0) == [gang.Leave(T0, "done")]
