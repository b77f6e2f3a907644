"""The pruning medians against a real etcd: the leader publishes, for an experiment with
pruning, how many trials completed and the per-step medians of their values; a node
that sees no metrics reads them (one key, shared by its checks for ``MEDIANS_S``) and
the median pruner answers from them as it does from the trials themselves."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field, replace

import pytest

from hypermesh.agent.leader import prune_medians
from hypermesh.agent.leader.prune_medians import PruneMedians
from hypermesh.agent.tasks import metrics_watch
from hypermesh.agent.tasks.metrics_watch import PruningMedians
from hypermesh.local.etcd import EtcdServer
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state import search
from hypermesh.state.blocks import AttemptEntry, Batch, ResultEntry
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace
from hypermesh.state.records import NodeRecord, dumps
from hypermesh.state.task_metrics import AttemptMetrics
from hypermesh.state.view import MeshView, load_view
from tests.state.fence_kit import endpoint, fresh_keyspace, running, workflow
from tests.state.test_model import Feed

PRUNED = """
experiments:
  e:
    parameters: {lr: {range: [0, 1]}}
    samples: 8
    objective: {metric: loss, goal: %s}
    pruning: median
    command: ["true {{lr}}"]
"""


@dataclass
class Host:
    etcd: Etcd
    ks: Keyspace
    view: MeshView
    wakes: list[float] = field(default_factory=list)
    pruning_medians: PruningMedians = field(init=False)

    def __post_init__(self) -> None:
        self.pruning_medians = PruningMedians(self.etcd, self.ks)


def curve(base: float, steps: int = 3) -> bytes:
    m = AttemptMetrics()
    for step in range(steps):
        m.add_text(json.dumps({"loss": base / (step + 1), "step": step}))
    return dumps(m.to_json())


async def finish(etcd: Etcd, ks: Keyspace, wid: str, index: int, base: float) -> None:
    """Trial ``index`` (a one-task block) reported ``curve(base)`` and succeeded."""
    bref = BlockRef(wid, "e", index)
    await etcd.put(ks.block(bref), dumps({"params": [{"lr": index / 10}]}))
    await etcd.put(ks.metrics(bref.task(0), 1), curve(base))
    await etcd.put(ks.block_batch(bref, 1, 1), dumps(Batch(
        "n1", (AttemptEntry(index, 1, "succeeded", 0, None, 1.0, 2.0),),
        (ResultEntry(index, "succeeded", 1, 0, 2.0),)).to_json()))


def test_the_leader_publishes_the_medians_and_a_node_prunes_by_them(
    etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ks = fresh_keyspace()
    wf = replace(workflow(), recipe=parse_recipe(PRUNED % "minimize"))
    exp = wf.recipe.experiment("e")
    bad = search.Trial(9, {"lr": 0.5}, "running", None, {0: 30.0, 1: 14.0})
    good = search.Trial(9, {"lr": 0.5}, "running", None, {0: 2.0})

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, _ = await running(etcd, ks, wf)
            for index, base in enumerate((1.0, 2.0, 3.0, 4.0)):
                await finish(etcd, ks, wid, index, base)
            await etcd.put(ks.node("n1"), dumps(NodeRecord("n1", "a:1").to_json()))
            host = Host(etcd, ks, await load_view(etcd, ks))
            medians = PruneMedians(host, host.wakes.append)
            key = ks.prune_medians(wid, "e")
            await medians.publish()
            assert await etcd.get(key) is None  # every node sees the metrics: none to read it
            await etcd.put(ks.node("n2"), dumps(NodeRecord("n2", "a:2", offers=True).to_json()))
            host.view = await load_view(etcd, ks)
            await medians.publish()
            got = await etcd.get(key)
            assert got is not None
            completed, steps = search.parse_medians(got[0])  # bases 1-4: medians of 2.5/(s+1)
            assert completed == 4 and steps == pytest.approx({0: 2.5, 1: 1.25, 2: 2.5 / 3})
            written = got[1]

            reader = PruningMedians(etcd, ks)
            first = await reader.of(wid, "e")
            assert not search.prune_by_medians(exp, *first, bad)  # 4 < 5 completed

            await medians.publish()  # nothing finished since: not looked at, not written
            assert (await etcd.get(key))[1] == written  # type: ignore[index]
            await finish(etcd, ks, wid, 4, 5.0)
            host.view = await load_view(etcd, ks)
            await medians.publish()  # within PUBLISH_S of the last look: a round later
            assert (await etcd.get(key))[1] == written  # type: ignore[index]
            assert host.wakes and host.wakes[-1] > 0
            monkeypatch.setattr(prune_medians, "PUBLISH_S", 0.0)
            await medians.publish()
            completed, steps = search.parse_medians((await etcd.get(key))[0])  # type: ignore[index]
            assert completed == 5 and steps == pytest.approx({0: 3.0, 1: 1.5, 2: 1.0})

            assert await reader.of(wid, "e") == first  # within MEDIANS_S: kept
            assert reader.reads == 1
            monkeypatch.setattr(metrics_watch, "MEDIANS_S", 0.0)
            completed, steps = await reader.of(wid, "e")
            assert reader.reads == 2 and completed == 5
            assert search.prune_by_medians(exp, completed, steps, bad)  # 14 > 1.5 at step 1
            assert not search.prune_by_medians(exp, completed, steps, good)
            assert await reader.of(wid, "other") == (0, {})  # none published: no verdict

    asyncio.run(scenario())


@pytest.mark.parametrize("seed", range(4))
def test_the_pruner_answers_from_the_medians_as_from_the_trials(seed: int) -> None:
    """Random searches (some trials completed, running, failed or pruned, at random
    steps, some values tied), either goal: ``prune_by_medians`` with ``median_curve``'s
    figures says what ``should_prune`` says with the trials."""
    rng = random.Random(seed)
    said: list[bool] = []
    for _ in range(100):
        exp = parse_recipe(PRUNED % rng.choice(["minimize", "maximize"])).experiments[0]
        trials = []
        for i in range(rng.randint(0, 14)):
            state = rng.choice(["complete"] * 4 + ["running", "failed", "pruned"])
            steps = rng.sample(range(12), rng.randint(0, 8))
            trials.append(search.Trial(
                i, {"lr": rng.random()}, state, rng.random() if state == "complete" else None,
                {s: rng.choice([rng.random(), 0.5]) for s in steps}))
        current = search.Trial(99, {"lr": 0.3}, "running", None,
                               {s: rng.random() * 2 for s in rng.sample(range(12),
                                                                        rng.randint(0, 2))})
        expected = search.should_prune(exp, trials, current)
        completed, medians = search.median_curve(exp, trials)
        assert search.prune_by_medians(exp, completed, medians, current) == expected, trials
        said.append(expected)
    assert 0 < sum(said) < len(said)  # both answers were asked for


def test_a_node_that_sees_every_trial_works_the_medians_out_again_as_trials_finish() -> None:
    """A follower's view defers block batches: the medians still count every completed
    trial, and are worked out again when a task finished, not at every check."""
    feed = Feed()
    wf = feed.workflow("w", PRUNED % "minimize", state="running")
    exp = wf.recipe.experiment("e")
    feed.view.defer_batches = True
    medians = PruningMedians(Etcd(["127.0.0.1:1"]), feed.ks)  # never reads etcd here

    def finish_in(index: int, base: float) -> None:
        bref = BlockRef("w", "e", index)
        feed.put(feed.ks.block(bref), {"params": [{"lr": index / 10}]})
        feed.put(feed.ks.metrics(bref.task(0), 1), json.loads(curve(base)))
        feed.put(f"{feed.ks.block_batches(bref)}b{index}", Batch(
            "n1", (AttemptEntry(index, 1, "succeeded", 0, None, 1.0, 2.0),),
            (ResultEntry(index, "succeeded", 1, 0, 2.0),)).to_json())

    async def scenario() -> None:
        for index, base in enumerate((1.0, 2.0, 3.0, 4.0, 5.0)):
            finish_in(index, base)
        first = await medians.from_view(feed.view, "w", exp)
        assert first[0] == 5 and first[1] == pytest.approx({0: 3.0, 1: 1.5, 2: 1.0})
        assert await medians.from_view(feed.view, "w", exp) is first and medians.worked == 1
        finish_in(5, 9.0)
        again = await medians.from_view(feed.view, "w", exp)
        assert medians.worked == 2 and again[0] == 6
        assert again[1] == pytest.approx({0: 3.5, 1: 1.75, 2: 3.5 / 3})

    asyncio.run(scenario())
