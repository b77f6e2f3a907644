"""Soft pool preference, pure: the recipe's ``prefer_pools`` field, the claim rule
(``agent/claims/pool_preference.py``) driven through ``choose_claims`` with a virtual clock, and
the leader's policy scaling preferred pools first."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hypermesh.agent.burst import view as burst_view
from hypermesh.agent.burst.policy import (
    Backlog,
    BurstConfig,
    Launch,
    NodeState,
    Snapshot,
    Starting,
    decide,
)
from hypermesh.agent.claims.choose import LocalLoad, choose_claims
from hypermesh.agent.claims.pool_preference import PoolPreference
from hypermesh.agent.claims.pool_wait import PoolWait
from hypermesh.config import AgentConfig
from hypermesh.errors import RecipeError, UsageError
from hypermesh.recipe.recipe import Recipe, parse_recipe
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.pools import Pool
from hypermesh.state.records import NodeRecord
from tests.claims.test_claims import Feed
from tests.claims.test_placement import agent_start


# ---------------------------------------------------------------------- the recipe field
def _recipe(lines: str) -> Recipe:
    return parse_recipe("experiments:\n  sweep:\n    command: echo hi\n"
                        + textwrap.indent(textwrap.dedent(lines), "    "), "r.yaml")


def test_prefer_pools_is_parsed_and_round_trips() -> None:
    exp = _recipe("pools: [onprem, cloud]\nprefer_pools: onprem\n").experiment("sweep")
    assert exp.pools == ("onprem", "cloud") and exp.prefer_pools == ("onprem",)
    alone = _recipe("prefer_pools: [gpu, cloud]\n")  # no 'pools': every pool may run it
    assert alone.experiment("sweep").prefer_pools == ("gpu", "cloud")
    assert alone.experiment("sweep").pools == ()
    assert Recipe.from_json(alone.to_json()) == alone
    assert _recipe("pools: [a]\n").experiment("sweep").prefer_pools == ()


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ("prefer_pools: []\n",
         "r.yaml:4: experiments.sweep.prefer_pools: expected one pool name or a list of them"),
        ("prefer_pools: [a, a]\n",
         "r.yaml:4: experiments.sweep.prefer_pools[1]: pool 'a' is listed twice"),
        ("prefer_pools: ['bad name']\n",
         "r.yaml:4: experiments.sweep.prefer_pools[0]: 'bad name' is not a pool name"),
        ("pools: [a, b]\nprefer_pools: [b, c]\n",
         "r.yaml:5: experiments.sweep.prefer_pools[1]: pool 'c' is not one of 'pools' (a, b)"),
        ("pools: a\nprefer_pools: c\n",
         "r.yaml:5: experiments.sweep.prefer_pools: pool 'c' is not one of 'pools' (a)"),
        ("prefer_pool: a\n", "r.yaml:4: experiments.sweep.prefer_pool"),
    ],
)
def test_prefer_pools_errors_name_field_and_line(lines: str, message: str) -> None:
    with pytest.raises(RecipeError) as info:
        _recipe(lines)
    assert any(str(p).startswith(message) for p in info.value.problems), info.value.problems


# ---------------------------------------------------------------------- the claim rule
PREFER = "experiments:\n  e:\n    command: echo\n    prefer_pools: [onprem]\n"
ONPREM = NodeRecord("p1", "a:1", pool="onprem", slots=2)
CLOUD = NodeRecord("c1", "a:2", pool="cloud", slots=4)


def mesh(*nodes: NodeRecord, recipe: str = PREFER, tasks: int = 4) -> Feed:
    feed = Feed()
    for n in nodes:
        feed.put(feed.ks.node(n.name), n.to_json())
    feed.workflow("w", recipe)
    feed.tasks("w", "e", tasks)
    return feed


def round_(feed: Feed, me: NodeRecord, wait: PoolWait,
           now: float) -> tuple[list[int], PoolPreference]:
    """The indices ``me`` claims at ``now``, and the round's preference."""
    pref = wait.round(feed.view, me, now)
    plans = choose_claims(feed.view, me, LocalLoad(), 10, preference=pref)
    return sorted(p.ref.index for p in plans), pref


def claimed(feed: Feed, me: NodeRecord, wait: PoolWait, now: float) -> list[int]:
    return round_(feed, me, wait, now)[0]


def waiter(delay: float = 5.0, alive: frozenset[str] | None = None) -> PoolWait:
    return PoolWait(delay, lambda: None, lambda m: None,
                    (lambda n: True) if alive is None else (lambda n: n in alive))


def test_preferred_node_claims_at_once() -> None:
    feed = mesh(ONPREM, CLOUD)
    assert claimed(feed, ONPREM, waiter(), 0.0) == [0, 1]  # its two slots


def test_other_pool_leaves_what_the_preferred_node_has_room_for_then_takes_it() -> None:
    feed = mesh(ONPREM, CLOUD)
    wait = waiter(delay=5.0)
    # onprem has 2 free slots: cloud leaves the two lowest tasks and takes the rest.
    indices, pref = round_(feed, CLOUD, wait, 0.0)
    assert indices == [2, 3]
    assert pref.deferred == {TaskRef("w", "e", 0): "p1", TaskRef("w", "e", 1): "p1"}
    assert pref.next_deadline == 5.0
    assert claimed(feed, CLOUD, wait, 4.9) == [2, 3]
    # The preferred node did not take them within the delay: nothing starves.
    assert claimed(feed, CLOUD, wait, 5.0) == [0, 1, 2, 3]


def test_a_full_preferred_node_leaves_nothing_to_wait_for() -> None:
    feed = mesh(ONPREM, CLOUD, tasks=5)
    feed.claim(TaskRef("w", "e", 0), node="p1")
    feed.claim(TaskRef("w", "e", 1), node="p1")  # onprem's two slots are taken
    assert claimed(feed, CLOUD, waiter(), 0.0) == [2, 3, 4]
    feed.delete(feed.ks.claim(TaskRef("w", "e", 1)))  # lost: open again, a slot free
    indices, pref = round_(feed, CLOUD, waiter(), 0.0)
    assert indices == [2, 3, 4] and list(pref.deferred) == [TaskRef("w", "e", 1)]


@pytest.mark.parametrize(
    ("preferred", "alive", "why"),
    [
        (None, None, "no node of the preferred pool is registered"),
        (ONPREM, frozenset({"c1"}), "gossip has the preferred node dead"),
        (NodeRecord("p1", "a:1", pool="onprem", slots=2, state="draining"), None, "draining"),
        (NodeRecord("p1", "a:1", pool="onprem", slots=2, gpus=0), None, "hardware"),
    ],
)
def test_no_live_fitting_preferred_node_means_no_wait(
    preferred: NodeRecord | None, alive: frozenset[str] | None, why: str
) -> None:
    recipe = PREFER + ("    hardware: {gpus: 1}\n" if why == "hardware" else "")
    cloud = NodeRecord("c1", "a:2", pool="cloud", slots=4, gpus=4)
    feed = mesh(*([preferred] if preferred else []), cloud, recipe=recipe)
    assert claimed(feed, cloud, waiter(alive=alive), 0.0) == [0, 1, 2, 3], why


def test_without_prefer_pools_nothing_waits() -> None:
    feed = mesh(ONPREM, CLOUD, recipe="experiments:\n  e:\n    command: echo\n")
    assert claimed(feed, CLOUD, waiter(), 0.0) == [0, 1, 2, 3]


def test_room_left_for_one_experiment_is_not_counted_again_for_the_next() -> None:
    recipe = PREFER + "  f:\n    command: echo\n    prefer_pools: [onprem]\n"
    feed = mesh(ONPREM, CLOUD, recipe=recipe, tasks=1)
    feed.tasks("w", "f", 2)
    pref = waiter().round(feed.view, CLOUD, 0.0)
    plans = choose_claims(feed.view, CLOUD, LocalLoad(), 10, preference=pref)
    # onprem's 2 slots: e/0 and f/0 are left to it; f/1 is taken now.
    assert [str(p.ref) for p in plans] == [str(TaskRef("w", "f", 1))]
    assert set(pref.deferred) == {TaskRef("w", "e", 0), TaskRef("w", "f", 0)}


def test_wait_restarts_when_a_task_opens_again() -> None:
    feed = mesh(ONPREM, CLOUD, tasks=1)
    wait = waiter(delay=5.0)
    assert claimed(feed, CLOUD, wait, 0.0) == []
    feed.claim(TaskRef("w", "e", 0), node="p1")  # the preferred node took it
    assert claimed(feed, CLOUD, wait, 1.0) == []
    assert wait.since == {}
    feed.delete(feed.ks.claim(TaskRef("w", "e", 0)))  # ...and was lost: open again
    assert claimed(feed, CLOUD, wait, 10.0) == []  # a fresh wait from t=10
    assert claimed(feed, CLOUD, wait, 15.0) == [0]


# ---------------------------------------------------------------------- the leader
CFG = BurstConfig(wait_threshold_s=60, target_drain_s=600)


def test_leader_scales_preferred_pools_first() -> None:
    a = Pool("a", kind="local", max_nodes=5)
    b = Pool("b", kind="local", max_nodes=1)
    item = Backlog("wf/e", 3, 100.0, 600.0, ("b", "a"), preferred=("b",))
    launches = [(x.pool, x.count) for x in decide(Snapshot({"a": a, "b": b},
                                                           backlog=(item,)), CFG)
                if isinstance(x, Launch)]
    assert launches == [("a", 2), ("b", 1)]  # b (preferred) filled to its max first


def test_free_slots_of_preferred_pools_are_drawn_on_first() -> None:
    # A preferred provisioned pool with a starting node absorbs the backlog before
    # the static pool's free slot; nothing more is started.
    cloud = Pool("cloud", kind="local", max_nodes=3, slots=2)
    onprem = Pool("onprem")
    snap = Snapshot({"cloud": cloud, "onprem": onprem},
                    nodes=(NodeState("s1", "onprem", False, 1, 0, 0.0, False),),
                    starting=(Starting("c1", "cloud", False, 1.0),),
                    backlog=(Backlog("wf/e", 3, 100.0, 600.0, ("cloud", "onprem"),
                                     preferred=("cloud",)),))
    assert [x for x in decide(snap, CFG) if isinstance(x, Launch)] == []


def test_backlog_lists_preferred_pools_first() -> None:
    feed = Feed()
    feed.put(feed.ks.node("s1"), NodeRecord("s1", "a:1", pool="onprem").to_json())
    feed.workflow("w", "experiments:\n  e:\n    command: echo\n"
                       "    pools: [onprem, cloud, gpu]\n    prefer_pools: [gpu, cloud]\n")
    feed.tasks("w", "e", 3)
    pools = {"cloud": Pool("cloud", kind="local", max_nodes=2),
             "gpu": Pool("gpu", kind="local", max_nodes=2)}
    in_use = burst_view.pools_in_use(feed.view, pools)
    (item,), _ = burst_view.backlog(feed.view, in_use, {}, 10.0, 5.0)
    assert item.pools == ("gpu", "cloud", "onprem")
    assert item.preferred == ("gpu", "cloud")


# ---------------------------------------------------------------------- the setting
def test_pool_delay_setting_is_checked(tmp_path: Path) -> None:
    assert AgentConfig.lan().pool_delay == 5.0 and AgentConfig.local().pool_delay == 2.0
    with pytest.raises(UsageError, match=r"--pool-delay 601\.0 is out of range"):
        AgentConfig.local(pool_delay=601.0)
    out = agent_start(tmp_path, "--pool-delay", "-1")
    assert out.returncode == 2
    assert "--pool-delay -1.0 is out of range: allowed 0..600" in out.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written
