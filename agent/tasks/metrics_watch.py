"""Collecting the metrics a running attempt reports, storing them, and pruning.

While an attempt runs, ``MetricsWatch`` reads what was appended to the attempt's log
(``HM_METRIC {...}`` lines) and to ``$HM_METRICS_FILE`` (JSON lines) every
``POLL_S``, feeds ``AttemptMetrics``, stores the record in etcd at most every
``STORE_EVERY_S`` (fenced by the attempt's claim), and asks ``search.should_prune``
whether the trial should stop. When the attempt ends it reads and stores one last time,
before the attempt's result is recorded, so the result always sees the final values.
Attempts that report nothing cost one small read per poll and no etcd write.

The pruner compares a trial with the experiment's completed trials, by the per-step
medians of their values (``search.prune_by_medians``: the answer ``should_prune`` gives
with the trials themselves, in a millisecond whatever their number). A node that
watches the whole namespace works the medians out from its view, again only when one of
the experiment's tasks finished; one that watches its own part (``--watch own``)
receives neither blocks nor metrics, and reads the medians the leader publishes
(``agent/leader/prune_medians.py``): one small key per experiment, at most every
``MEDIANS_S`` (:class:`PruningMedians`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hypermesh.recipe.recipe import Experiment
from hypermesh.state import search
from hypermesh.state.records import dumps
from hypermesh.state.task_metrics import LINE_PREFIX, AttemptMetrics, report_in_line
from hypermesh.state.txns import put_metrics

if TYPE_CHECKING:
    from hypermesh.agent.tasks.running import Running
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace
    from hypermesh.state.view import MeshView

log = logging.getLogger("hypermesh.agent")

POLL_S = 0.5  # how often a running attempt's outputs are read
MEDIANS_S = 2.0  # the oldest pruning medians a check on a node that sees no metrics uses
STORE_EVERY_S = 1.0  # least time between two etcd writes of one attempt's metrics
MAX_READ = 4 << 20  # bytes read per poll and file; the rest waits for the next poll


class _Tail:
    """New complete lines of a growing file, from where the last read stopped."""

    def __init__(self, path: str | Path, marker: bytes = b"") -> None:
        self.path = path
        self.marker = marker  # only lines holding it matter (b"": every line)
        self.offset = 0
        self.partial = b""
        self.more = False  # the last read stopped at MAX_READ: more is waiting

    def lines(self) -> list[str]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        try:
            # read what is there, not MAX_READ: a 4 MiB buffer costs an mmap each time
            size = os.fstat(fd).st_size
            want = min(MAX_READ, size - self.offset)
            data = os.pread(fd, want, self.offset) if want > 0 else b""
        finally:
            os.close(fd)
        self.more = len(data) == MAX_READ
        self.offset += len(data)
        data = self.partial + data
        complete, _, self.partial = data.rpartition(b"\n")
        if len(self.partial) > MAX_READ:
            self.partial = b""  # a line longer than MAX_READ is no report: drop it
        if not complete or self.marker not in complete:
            return []
        return [
            line.decode("utf-8", "replace")
            for line in complete.split(b"\n")
            if self.marker in line
        ]


class MetricsWatch:
    """The metrics of one attempt. The agent's task that runs the attempt owns it."""

    def __init__(
        self,
        log_path: str | Path,
        metrics_path: str | Path,
        store: Callable[[bytes], Awaitable[object]],
        prune: Callable[[AttemptMetrics], Awaitable[bool]] | None = None,
    ) -> None:
        self.metrics = AttemptMetrics()
        self._log = _Tail(log_path, LINE_PREFIX.strip().encode())
        self._file = _Tail(metrics_path)
        self._store = store
        self._prune = prune
        self._stored_reports = -1
        self._stored_at = 0.0

    def read(self) -> bool:
        """Take in what the task wrote since the last read; whether anything was new."""
        before = sum(self.metrics.reports.values()) + self.metrics.ignored
        for line in self._log.lines():
            text = report_in_line(line)
            if text is not None:
                self.metrics.add_text(text)
        for line in self._file.lines():
            if line.strip():
                self.metrics.add_text(line)
        return sum(self.metrics.reports.values()) + self.metrics.ignored != before

    async def flush(self, force: bool = False) -> None:
        """Store the record if it changed (and, unless ``force``, not too recently)."""
        count = sum(self.metrics.reports.values()) + self.metrics.ignored
        if not self.metrics or count == self._stored_reports:
            return
        now = time.monotonic()
        if not force and now - self._stored_at < STORE_EVERY_S:
            return
        await self._store(dumps(self.metrics.to_json()))
        self._stored_reports = count
        self._stored_at = now

    def follow_later(self, on_prune: Callable[[], None]) -> Callable[[], None]:
        """``follow`` from one poll period on; the function returned stops it. Most
        trivial attempts end before that, and no task is ever made for them."""
        loop = asyncio.get_running_loop()
        started: list[asyncio.Task[None]] = []

        def start() -> None:
            started.append(loop.create_task(self.follow(on_prune, wait_first=False)))

        handle = loop.call_later(POLL_S, start)

        def stop() -> None:
            handle.cancel()
            for task in started:
                task.cancel()

        return stop

    async def follow(self, on_prune: Callable[[], None], wait_first: bool = True) -> None:
        """Poll until cancelled; call ``on_prune`` once if the search stops the trial."""
        pruned = False
        while True:
            if wait_first:
                await asyncio.sleep(POLL_S)
            wait_first = True
            changed = self.read()
            try:
                await self.flush()
            except Exception as exc:  # etcd briefly away: the next poll stores it
                log.warning("storing metrics: %s", exc)
            if changed and not pruned and self._prune is not None:
                try:
                    pruned = await self._prune(self.metrics)
                except Exception:
                    log.exception("pruning check failed; the trial goes on")
                if pruned:
                    on_prune()

    async def finish(self) -> None:
        """The last read and store, after the attempt's processes ended."""
        if not self.metrics and not (self._log.offset or self._file.offset) and not (
            os.path.exists(self._log.path) or os.path.exists(self._file.path)
        ):
            return  # nothing was reported and nothing could be (most trivial attempts)
        self.read()
        while self._log.more or self._file.more:
            self.read()
        await self.flush(force=True)


Medians = tuple[int, dict[int, float]]  # (completed trials, {step: median})

CURVES_KEPT = 8
"""Experiments whose medians a node keeps between looks (``search.MedianCurve``); one
dropped is worked out from all its trials at its next look."""


class PruningMedians:
    """What a node's pruning checks compare with, per experiment: the leader's medians
    (``prunemed/``) read from etcd, each at most ``MEDIANS_S`` old, for a node that does
    not watch the whole namespace, or worked out from the view of one that does. One
    read or one working-out serves every trial of the experiment on the node."""

    def __init__(self, etcd: Etcd, ks: Keyspace) -> None:
        self.etcd = etcd
        self.ks = ks
        self.reads = 0
        self.worked = 0
        self._got: dict[tuple[str, str], tuple[float, Medians]] = {}
        self._from_view: dict[tuple[str, str], tuple[int, Medians]] = {}
        # The experiments' kept medians, the least recently looked at dropped past
        # CURVES_KEPT (one holds its trials' reports: megabytes at thousands of trials)
        self._curves: collections.OrderedDict[tuple[str, str], search.MedianCurve] = (
            collections.OrderedDict())
        self._lock = asyncio.Lock()

    async def from_view(self, view: MeshView, wid: str, exp: Experiment) -> Medians:
        """The medians of ``exp``'s completed trials in ``view``, brought up to date
        only when one of its tasks finished since (nothing else changes them), from
        those of the last time (``search.MedianCurve``: the trials that changed)."""
        key = (wid, exp.name)
        async with self._lock:
            ended = search.settle_experiment(view, wid, exp.name)
            got = self._from_view.get(key)
            if got is None or got[0] != ended:
                self._from_view = {k: v for k, v in self._from_view.items()
                                   if k[0] in view.workflows}  # forget deleted workflows
                curve = self._curves.pop(key, None)
                if curve is None or curve.exp is not exp:  # new, or its recipe put again
                    curve = search.MedianCurve(exp)
                self._curves[key] = curve
                while len(self._curves) > CURVES_KEPT:
                    self._curves.popitem(last=False)
                self.worked += 1
                got = self._from_view[key] = (ended, curve.update(view, wid))  # reads view
            return got[1]

    async def of(self, wid: str, experiment: str) -> Medians:
        """``(completed trials, {step: median})``; ``(0, {})`` before the leader's first."""
        async with self._lock:  # trials of one experiment asking at once share a read
            now = time.monotonic()
            got = self._got.get((wid, experiment))
            if got is None or now - got[0] > MEDIANS_S:
                self._got = {k: v for k, v in self._got.items() if now - v[0] <= MEDIANS_S}
                found = await self.etcd.get(self.ks.prune_medians(wid, experiment))
                self.reads += 1
                value = search.parse_medians(found[0]) if found is not None else (0, {})
                got = self._got[(wid, experiment)] = (now, value)
            return got[1]


class WatchHost(Protocol):
    """What :func:`attempt_watch` uses of the agent; it writes ``written_revision`` (never
    lowers it) after each store. ``view_whole``: set while ``view`` holds the whole
    namespace, else ``pruning_medians`` give the pruner what it compares with."""

    etcd: Etcd
    ks: Keyspace
    view: MeshView
    view_whole: asyncio.Event
    pruning_medians: PruningMedians
    written_revision: int

    def decide(self, message: str) -> None: ...


def attempt_watch(
    agent: WatchHost, r: Running, exp: Experiment, log_path: str | Path, attempt_dir: str
) -> MetricsWatch:
    """The watch of attempt ``r`` of ``agent`` (its scratch folder ``attempt_dir``): stores
    fenced by the attempt's claim, and prunes through ``search.should_prune`` when the
    experiment asks for pruning."""
    ref, n = r.plan.ref, r.plan.attempt

    async def store(value: bytes) -> None:
        written = await put_metrics(agent.etcd, agent.ks, ref, n, r.claim_revision, value,
                                    r.block)
        if written is not None:
            agent.written_revision = max(agent.written_revision, written)

    async def prune(metrics: AttemptMetrics) -> bool:
        assert exp.objective is not None
        params = r.params if r.params is not None else (
            agent.view.tasks.get(ref, {}).get("params", {}))
        current = search.Trial(
            ref.index, params, "running", None, metrics.intermediate(exp.objective.metric)
        )
        medians = agent.pruning_medians
        if agent.view_whole.is_set():
            completed, steps = await medians.from_view(agent.view, ref.workflow, exp)
        else:
            completed, steps = await medians.of(ref.workflow, exp.name)
        decided = await asyncio.to_thread(search.prune_by_medians, exp, completed, steps,
                                          current)
        if decided:
            agent.decide(f"{ref} attempt {n} pruned at step {max(current.intermediate)}")
        return decided

    return MetricsWatch(
        log_path,
        metrics_file(attempt_dir),
        store,
        prune if exp.pruning and exp.objective else None,
    )


def metrics_file(attempt_dir: str | Path) -> str:
    """Where ``$HM_METRICS_FILE`` points for an attempt."""
    return f"{attempt_dir}/metrics.jsonl"
