"""``agent start --watch auto`` (the default) on real agents and a real etcd: a node
watches the whole namespace while one of the mesh's ``watch-all`` seats is free, and
only its own part once they are all taken; a seat lives on its holder's lease. A node
that watches its own part receives the keys of the workflows it works on, and of no
other, until they are deleted."""

from __future__ import annotations

import asyncio

from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.local.agents import AgentProcess
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.settings import take_watch_seat
from tests.conftest import Mesh
from tests.mesh.test_mesh import successes
from tests.ops.test_metrics import parse, scrape


def watching(mesh: Mesh) -> dict[str, str]:
    return {n["name"]: n["watch"] for n in mesh.hm_json("nodes")}


def test_auto_nodes_take_the_watch_all_seats_then_watch_their_own_part(mesh: Mesh) -> None:
    mesh.hm("settings", "watch-all=1", check=True)
    for name in ("node1", "node2", "node3"):
        mesh.agent(name, slots=2)  # --watch auto
    wait_for(lambda: len(watching(mesh)) == 3, 15, "three nodes registered")
    watch = watching(mesh)
    assert sorted(watch.values()) == ["all", "own", "own"], watch
    recipe = mesh.write_recipe(
        "experiments:\n  e:\n    samples: 24\n    batch: 2\n    command: ['true']\n"
    )
    wid = mesh.submit(recipe)
    status = mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)
    assert status["state"] == "succeeded", status
    tasks = mesh.hm_json("tasks", wid)
    assert len(tasks) == 24 and all(successes(t) == 1 for t in tasks), tasks
    # The seat holder leaves: its seat goes with its lease, and the next node takes it.
    seated = next(name for name, w in watch.items() if w == "all")
    mesh.agents[seated].terminate()
    mesh.agent("node4", slots=2)
    wait_for(lambda: watching(mesh).get("node4") is not None, 15, "node4 registered")
    assert watching(mesh)["node4"] == "all"
    # Explicit modes take no seat.
    mesh.hm("settings", "watch-all=3", check=True)
    mesh.agent("node5", slots=2, extra=("--watch", "own"))
    mesh.agent("node6", slots=2)
    wait_for(lambda: len(watching(mesh)) == 5, 15, "five nodes registered")
    assert watching(mesh)["node5"] == "own" and watching(mesh)["node6"] == "all"


def test_nodes_starting_at_once_never_take_more_seats_than_there_are(mesh: Mesh) -> None:
    """Eight takers at once against three seats (the setting): three seats taken, each
    by one taker, and every other taker told there is none."""
    mesh.hm("settings", "watch-all=3", check=True)
    ks = Keyspace(mesh.namespace)

    async def take_all() -> tuple[list[int | None], dict[str, str]]:
        async with Etcd(parse_endpoints(mesh.etcd.url)) as etcd:
            lease = await etcd.grant(30)
            try:
                seats = await asyncio.gather(*(
                    take_watch_seat(etcd, ks, f"n{i}", lease) for i in range(8)
                ))
                kvs, _ = await etcd.get_prefix(ks.watch_seats)
                held = {kv.key.decode(): kv.value.decode() for kv in kvs}
            finally:
                await etcd.revoke(lease)
            return list(seats), held

    seats, held = asyncio.run(take_all())
    taken = [s for s in seats if s is not None]
    assert sorted(taken) == [0, 1, 2], seats
    assert sorted(held) == [ks.watch_seat(s) for s in (0, 1, 2)]
    assert sorted(held.values()) == sorted(f"n{i}" for i, s in enumerate(seats) if s is not None)


def followed(agent: AgentProcess) -> float:
    """The workflows whose keys the agent receives, from its /metrics."""
    metrics = parse(scrape((agent.work_dir / "agent.metrics").read_text().strip()))
    return metrics[("hypermesh_node_followed_workflows", ())]


def test_a_node_that_watches_its_own_part_follows_only_the_workflows_it_works_on(
    mesh: Mesh,
) -> None:
    """Two workflows in blocks, each restricted to one follower's pool: while they run,
    each follower follows only its own (its offer named it), and neither once they
    ended; the leader, whose view is whole, sees both, then one once one is deleted."""
    own = ("--watch", "own")
    lead = mesh.agent("node1", slots=1, extra=(*own, "--pool", "lead"))  # runs nothing
    wait_for(lambda: [n["name"] for n in mesh.hm_json("nodes") if n["leader"]] == ["node1"],
             30, "node1 to lead")
    followers = {pool: mesh.agent(f"node-{pool}", slots=2, extra=(*own, "--pool", pool))
                 for pool in ("a", "b")}
    wait_for(lambda: len(mesh.hm_json("nodes")) == 3, 30, "three nodes registered")
    go = mesh.root / "go"
    wids = {}
    for pool in ("a", "b"):
        recipe = mesh.write_recipe(
            f"experiments:\n  e:\n    samples: 6\n    batch: 2\n    pools: [{pool}]\n"
            f"    command:\n      - while [ ! -e {go} ]; do sleep 0.05; done\n",
            name=f"{pool}.yaml")
        wids[pool] = mesh.submit(recipe)
    for agent in followers.values():
        wait_for(lambda agent=agent: followed(agent) == 1, 30, "each follower to follow one")
    assert followed(lead) == 2
    go.touch()
    for pool, wid in wids.items():
        assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=90)["state"] == "succeeded"
        tasks = mesh.hm_json("tasks", wid)
        assert {t["node"] for t in tasks} == {f"node-{pool}"}, tasks
    for agent in followers.values():
        wait_for(lambda agent=agent: followed(agent) == 0, 15, "the ended ones no longer followed")
    assert followed(lead) == 2
    mesh.hm_json("delete", wids["a"])
    wait_for(lambda: followed(lead) == 1, 15, "the leader to drop the deleted workflow")
