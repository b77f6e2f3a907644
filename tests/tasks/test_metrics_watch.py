"""MetricsWatch reading real files: reports from the log and the metrics file, partial
lines, throttled and final stores, and the pruning callback; and the trials a node that
watches its own part reads from a real etcd for its pruning checks."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

from hypermesh.agent.tasks import metrics_watch
from hypermesh.agent.tasks.metrics_watch import MetricsWatch
from hypermesh.local.etcd import EtcdServer
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.blocks import AttemptEntry, Batch, ResultEntry
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef
from hypermesh.state.records import dumps
from hypermesh.state.task_metrics import AttemptMetrics
from hypermesh.state.view import load_view
from tests.state.fence_kit import endpoint, fresh_keyspace, running, workflow


def test_reads_log_and_file_reports_and_stores_the_final_record(tmp_path: Path) -> None:
    log, file = tmp_path / "output.log", tmp_path / "metrics.jsonl"
    stored: list[dict] = []

    async def store(value: bytes) -> None:
        stored.append(json.loads(value))

    async def scenario() -> None:
        watch = MetricsWatch(log, file, store)
        await watch.finish()
        assert stored == []  # nothing reported: nothing written
        log.write_text('epoch 1\nHM_METRIC {"loss": 3, "step": 0}\nHM_METRIC {"loss": 2')
        assert watch.read()
        assert watch.metrics.last == {"loss": 3.0}  # the partial line waits for its end
        with open(log, "a") as f:
            f.write(', "step": 1}\nHM_METRIC oops\n')
        file.write_text('{"acc": 0.5}\n')
        await watch.finish()
        assert stored[-1]["last"] == {"loss": 2.0, "acc": 0.5}
        assert stored[-1]["history"]["loss"] == [[0, 3.0], [1, 2.0]]
        assert stored[-1]["ignored"] == 1
        await watch.finish()
        assert len(stored) == 1  # unchanged: not stored again

    asyncio.run(scenario())


def test_follow_prunes_once_and_throttles_stores(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(metrics_watch, "POLL_S", 0.01)
    log = tmp_path / "output.log"
    stores: list[bytes] = []
    asked: list[dict[int, float]] = []
    pruned: list[bool] = []

    async def store(value: bytes) -> None:
        stores.append(value)

    async def prune(m: AttemptMetrics) -> bool:
        asked.append(m.intermediate("loss"))
        return max(m.intermediate("loss"), default=-1) >= 1

    async def scenario() -> None:
        watch = MetricsWatch(log, tmp_path / "m.jsonl", store, prune)
        follower = asyncio.create_task(watch.follow(lambda: pruned.append(True)))
        for step in range(3):
            with open(log, "a") as f:
                f.write(f'HM_METRIC {{"loss": {step}, "step": {step}}}\n')
            await asyncio.sleep(0.05)
        follower.cancel()

    asyncio.run(scenario())
    assert pruned == [True]  # once, at the first report that asked for it
    assert len(stores) == 1  # within STORE_EVERY_S only the first store happens


SEARCHES = """
experiments:
  e:
    parameters: {lr: {values: [0.1, 0.2, 0.3]}}
    objective: {metric: loss, goal: minimize}
    pruning: median
    command: ["true {{lr}}"]
  ex:
    parameters: {lr: {values: [0.5]}}
    objective: {metric: loss, goal: minimize}
    command: ["true {{lr}}"]
"""


def test_a_node_that_watches_its_part_reads_an_experiments_trials_from_etcd(
    etcd_server: EtcdServer, monkeypatch  # type: ignore[no-untyped-def]
) -> None:
    """``TrialSnapshots`` read experiment ``e`` alone (not ``ex``, whose name it starts):
    its one-task blocks, their batches and the metrics stored; one read serves the
    checks of ``SNAPSHOT_S``."""
    ks = fresh_keyspace()
    wf = replace(workflow(), recipe=parse_recipe(SEARCHES))
    exp = wf.recipe.experiment("e")

    def report(loss: float) -> bytes:
        m = AttemptMetrics()
        m.add_text(json.dumps({"loss": loss, "step": 0}))
        return dumps(m.to_json())

    async def scenario() -> None:
        async with Etcd(endpoint(etcd_server)) as etcd:
            wid, _ = await running(etcd, ks, wf)
            for exp_name, index, lr in (("e", 0, 0.1), ("e", 1, 0.2), ("e", 2, 0.3),
                                        ("ex", 0, 0.5)):
                bref = BlockRef(wid, exp_name, index)
                await etcd.put(ks.block(bref), dumps({"params": [{"lr": lr}]}))
                await etcd.put(ks.metrics(bref.task(0), 1), report(lr))
                ended = [AttemptEntry(index, 1, "succeeded", 0, None, 1.0, 2.0)]
                done = (ResultEntry(index, "succeeded", 1, 0, 2.0),)
                if index == 2:  # still running: no result yet
                    ended, done = [AttemptEntry(index, 1, "running", started_at=1.0)], ()
                await etcd.put(ks.block_batch(bref, 1, 1),
                               dumps(Batch("n1", tuple(ended), done).to_json()))

            view = await load_view(etcd, ks, wid, experiment="e")
            assert sorted(r.index for r in view.task_refs(wid)) == [0, 1, 2]
            assert {r.experiment for r in view.metrics} == {"e"}

            snapshots = metrics_watch.TrialSnapshots(etcd, ks)
            trials = await snapshots.trials(wid, exp)
            assert [(t.index, t.state, t.value) for t in trials] == [
                (0, "complete", 0.1), (1, "complete", 0.2), (2, "running", 0.3)]
            assert await snapshots.trials(wid, exp) is trials and snapshots.reads == 1
            monkeypatch.setattr(metrics_watch, "SNAPSHOT_S", 0.0)
            await etcd.put(ks.block_batch(BlockRef(wid, "e", 2), 2, 1), dumps(Batch(
                "n1", (AttemptEntry(2, 1, "succeeded", 0, None, 1.0, 3.0),),
                (ResultEntry(2, "succeeded", 1, 0, 3.0),)).to_json()))
            trials = await snapshots.trials(wid, exp)
            assert snapshots.reads == 2 and trials[2].state == "complete"

    asyncio.run(scenario())
