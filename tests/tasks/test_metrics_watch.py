"""MetricsWatch reading real files: reports from the log and the metrics file, partial
lines, throttled and final stores, and the pruning callback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from hypermesh.agent.tasks import metrics_watch
from hypermesh.agent.tasks.metrics_watch import MetricsWatch
from hypermesh.state.task_metrics import AttemptMetrics


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
