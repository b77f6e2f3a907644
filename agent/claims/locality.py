"""The I/O around locality-aware claims (``placement.py``): it resolves tasks' inputs to
chunks, keeps this node's view of which chunks it holds, and wakes the claim loop when
a deferral ends or something it waited for arrived.

Per claim round the agent asks :meth:`Locality.placement` for a ``Placement`` and hands
it to ``choose_claims``; afterwards :meth:`Locality.after_round` starts what the round
found missing, in worker threads (never on the event loop):

- a task's inputs: its experiment's ``inputs`` templates rendered with its parameters
  (``hypermesh/recipe/inputs.py``), each ``ALIAS/PATH`` looked up in the manifest of the data
  set version the alias names (``chunkfs/coverage.py``). Versions are resolved once per
  workflow and data set spec (``NAME`` alone: the newest at that moment); manifests and
  answers are cached per version, which never changes. A task whose inputs cannot be
  resolved (store unreachable, bad rendered path) counts as having none: it is placed
  like any other task, and the node's decision log says why once.
- this node's holdings: ``Mounts.holdings()`` (the caches' records). A task counts as
  resolved only once a scan that started after the task became claimable has finished,
  so a decision never rests on what the caches held before the previous round ran.

Other nodes' holdings come from ``holders`` (``ChunkPeers.holders``: the chunk sets peers
advertise in gossip, alive members only). Owned by the agent's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from hypermesh.agent.claims.placement import Inputs, Placement, prune_since
from hypermesh.agent.claims.wake_timer import WakeTimer
from hypermesh.agent.share.peers import HoldersView
from hypermesh.agent.tasks.mounts import Mounts
from hypermesh.chunkfs.coverage import CoverageCache
from hypermesh.chunkfs.datasets import resolve
from hypermesh.chunkfs.format import Root
from hypermesh.chunkfs.manifest import Manifest
from hypermesh.chunkfs.store import ObjectStore, open_store
from hypermesh.errors import HypermeshError
from hypermesh.recipe.inputs import render_input
from hypermesh.recipe.recipe import Experiment
from hypermesh.state.fit import allowed_on
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import TERMINAL
from hypermesh.state.view import MeshView

log = logging.getLogger(__name__)

NO_HOLDERS: frozenset[str] = frozenset()


class _Locator:
    """``ChunkLocator`` over this node's last scan and the peers' advertisements."""

    def __init__(self, local: frozenset[str], holders: Callable[[str], frozenset[str]]) -> None:
        self._local = local
        self._holders = holders

    def local(self, chunk: str) -> bool:
        return chunk in self._local

    def holders(self, chunk: str) -> frozenset[str]:
        return self._holders(chunk)


class Locality:
    """Task inputs, local holdings and deferral timers for one agent's claim loop."""

    def __init__(
        self,
        name: str,
        store_url: str | None,
        delay_s: float,
        mounts: Mounts,
        wake: Callable[[], None],
        decide: Callable[[str], None],
        alive: Callable[[str], bool] = lambda name: True,
        holders: HoldersView = lambda chunk: NO_HOLDERS,
    ) -> None:
        self.name = name
        self.store_url = store_url
        self.delay_s = delay_s
        self.mounts = mounts
        self.wake = wake
        self.decide = decide
        self.alive = alive  # gossip's verdict on a peer
        self.holders = holders  # who else holds a chunk: the peers' gossiped chunk sets
        self.since: dict[TaskRef, float] = {}
        self._inputs: dict[TaskRef, Inputs] = {}
        self._resolving: set[TaskRef] = set()
        self._roots: dict[tuple[str, str], Root] = {}  # (workflow, spec) -> version's root
        self._coverage = CoverageCache()
        self._lock = threading.Lock()  # one resolving thread at a time (caches)
        self._store: ObjectStore | None = None
        self._local: frozenset[str] = frozenset()
        self._local_at = float("-inf")  # when the last finished scan started
        self._scan: asyncio.Task[None] | None = None
        self._jobs: set[asyncio.Task[None]] = set()
        self._timer = WakeTimer(wake)
        self._told: set[TaskRef] = set()  # deferrals already in the decision log
        # The leader's offers (``holder``): the inputs of blocks' tasks, looked up apart
        # from this node's own claims.
        self.looked_up = 0  # grows whenever a lookup for the offers ended
        self._block_inputs: dict[TaskRef, Inputs] = {}
        self._block_lookups: set[TaskRef] = set()  # asked for or being looked up
        self._block_asked: list[TaskRef] = []  # asked for since the last lookup began
        self._block_view: MeshView | None = None

    # ------------------------------------------------------------------ a round
    def placement(self, view: MeshView, now: float | None = None) -> Placement:
        """This round's placement. Peers that may take a task: the other registered,
        not draining nodes that gossip has alive."""
        now = time.monotonic() if now is None else now
        prune_since(self.since, lambda r: r.index in view.open.get((r.workflow, r.experiment), ()))
        for ref in [r for r in self._inputs if r not in self.since]:
            del self._inputs[ref]
        self._told &= self.since.keys()
        ended = [k for k in self._roots
                 if k[0] not in view.workflows or view.workflow_state(k[0]) in TERMINAL]
        for key in ended:
            del self._roots[key]  # ended (or gone): its tasks will not ask again
        peers = {n: rec for n, rec in view.nodes.items() if n != self.name and self.alive(n)}
        return Placement(
            me=self.name,
            locator=_Locator(self._local, self.holders),
            inputs=self._known,
            peers={n: rec for n, rec in peers.items() if rec.state == "alive"},
            now=now,
            since=self.since,
            delay_s=self.delay_s,
            fits=allowed_on,
        )

    def _known(self, ref: TaskRef) -> Inputs | None:
        if self._local_at < self.since[ref]:
            return None  # the caches have not been looked at since it became claimable
        return self._inputs.get(ref)

    def after_round(self, placement: Placement, view: MeshView) -> None:
        """Start what ``placement`` missed and wake the claim loop when a deferral ends."""
        for ref, holder in placement.deferred.items():
            if holder and ref not in self._told:
                self._told.add(ref)
                self.decide(f"leaving {ref} to {holder}, which holds more of its data "
                            f"(for up to {self.delay_s:g}s)")
        missing = [r for r in placement.missing if r not in self._resolving]
        stale = any(self._local_at < self.since.get(r, -math.inf) for r in placement.missing)
        if stale and self._scan is None:
            self._scan = asyncio.create_task(self._rescan(), name="locality scan")
        unresolved = [r for r in missing if r not in self._inputs]
        if unresolved:
            jobs = [(r, self._specs(view, r)) for r in unresolved]
            self._resolving.update(unresolved)
            task = asyncio.create_task(self._resolve(jobs), name="locality inputs")
            self._jobs.add(task)
            task.add_done_callback(self._jobs.discard)
        if placement.next_deadline is not None:
            self._timer.at(placement.next_deadline)

    # ------------------------------------------------------------------ the leader's offers
    def holder(self, view: MeshView, ref: TaskRef) -> str | None:
        """For the leader's offers (``BlockLocality`` in ``agent/leader/offer_hooks.py``): the
        node that may run ``ref`` and holds most of its inputs, as gossip says (ties to
        the first name); "" while its inputs are being looked up (a lookup starts); None
        when no such node holds any, or its inputs cannot be known."""
        inputs = self._block_inputs.get(ref)
        if inputs is None:
            if ref not in self._block_lookups:
                self._block_lookups.add(ref)
                self._block_asked.append(ref)
                if self._block_view is None:
                    asyncio.get_running_loop().call_soon(self._look_up_blocks)
                self._block_view = view
            return ""
        wf = view.workflows.get(ref.workflow)
        if wf is None or not inputs:
            return None
        exp = wf.recipe.experiment(ref.experiment)
        held: dict[str, int] = {}
        for chunk, size in inputs.items():
            for node in self.holders(chunk):
                held[node] = held.get(node, 0) + size
        best, most = None, 0
        for node in sorted(held):
            rec = view.nodes.get(node)
            if (held[node] > most and rec is not None and rec.state == "alive"
                    and (node == self.name or self.alive(node)) and allowed_on(exp, rec)):
                best, most = node, held[node]
        return best

    def forget(self, keep: Collection[TaskRef]) -> None:
        """Drop what was looked up for the offers of tasks not in ``keep``."""
        for ref in [r for r in self._block_inputs if r not in keep]:
            del self._block_inputs[ref]

    def _look_up_blocks(self) -> None:
        view, self._block_view = self._block_view, None
        asked, self._block_asked = self._block_asked, []
        if view is None or not asked:
            return
        jobs = [(r, self._specs(view, r)) for r in asked]
        task = asyncio.create_task(self._resolve_blocks(jobs), name="locality inputs (offers)")
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    async def _resolve_blocks(
        self, jobs: list[tuple[TaskRef, list[tuple[str, str, str]] | str]]
    ) -> None:
        try:
            results = await asyncio.to_thread(self._resolve_all, jobs)
        finally:
            self._block_lookups.difference_update(ref for ref, _ in jobs)
        for ref, (inputs, problem) in results.items():
            self._block_inputs[ref] = inputs
            if problem:
                self.decide(f"inputs of {ref} unknown, offered anywhere: {problem}")
        self.looked_up += 1

    def close(self) -> None:
        for task in [*self._jobs, *([self._scan] if self._scan else [])]:
            task.cancel()
        self._timer.cancel()
        if self._store is not None:
            self._store.close()

    # ------------------------------------------------------------------ holdings
    async def _rescan(self) -> None:
        started = time.monotonic()
        try:
            held = await asyncio.to_thread(self.mounts.holdings)
            self._local = frozenset(held)
            self._local_at = started
        except Exception:  # a bad cache directory must not stop claims
            log.exception("%s: scanning the chunk caches failed", self.name)
            self._local_at = started
        finally:
            self._scan = None
        self.wake()

    # ------------------------------------------------------------------ inputs
    def _specs(self, view: MeshView, ref: TaskRef) -> list[tuple[str, str, str]] | str:
        """``[(workflow, spec, path)]`` of the task's inputs, or why there are none."""
        wf = view.workflows.get(ref.workflow)
        if wf is None:
            return "its workflow is gone"
        exp: Experiment = wf.recipe.experiment(ref.experiment)
        params: dict[str, Any] = view.tasks.get(ref, {}).get("params", {})
        values = dict(params) | {
            "workflow_id": ref.workflow,
            "experiment": ref.experiment,
            "task_id": ref.id,
            "task_index": ref.index,
        }
        out = []
        try:
            for template in exp.inputs:
                alias, path = render_input(template, values)
                out.append((ref.workflow, exp.data[alias], path))
        except (HypermeshError, KeyError) as exc:
            return str(exc)
        return out

    async def _resolve(self, jobs: list[tuple[TaskRef, list[tuple[str, str, str]] | str]]) -> None:
        try:
            results = await asyncio.to_thread(self._resolve_all, jobs)
        finally:
            self._resolving.difference_update(ref for ref, _ in jobs)
        for ref, (inputs, problem) in results.items():
            if ref in self.since:
                self._inputs[ref] = inputs
            if problem:
                self.decide(f"inputs of {ref} unknown, placed anywhere: {problem}")
        self.wake()

    def _resolve_all(
        self, jobs: list[tuple[TaskRef, list[tuple[str, str, str]] | str]]
    ) -> dict[TaskRef, tuple[Inputs, str]]:
        """In a worker thread: each task's chunks, or none and why."""
        with self._lock:
            return self._resolve_locked(jobs)

    def _resolve_locked(
        self, jobs: list[tuple[TaskRef, list[tuple[str, str, str]] | str]]
    ) -> dict[TaskRef, tuple[Inputs, str]]:
        out: dict[TaskRef, tuple[Inputs, str]] = {}
        for ref, specs in jobs:
            if isinstance(specs, str):
                out[ref] = ({}, specs)
                continue
            total: dict[str, int] = {}
            try:
                for workflow, spec, path in specs:
                    for chunk, size in self._covered(workflow, spec, path).items():
                        total[chunk] = total.get(chunk, 0) + size
            except (HypermeshError, OSError) as exc:
                out[ref] = ({}, str(exc))
                continue
            out[ref] = (total, "")
        return out

    def _covered(self, workflow: str, spec: str, path: str) -> dict[str, int]:
        if self.store_url is None:
            raise HypermeshError("this agent has no object store (--store)")
        if self._store is None:
            self._store = open_store(self.store_url)
        root = self._roots.get((workflow, spec))
        if root is None:
            root = self._roots[(workflow, spec)] = resolve(self._store, spec)
        key = (root.name, root.version)
        manifest = self._coverage.manifest(key)
        if manifest is None:
            manifest = Manifest(root, self._store.get, cache_pages=8)
            self._coverage.add_manifest(manifest)
        return self._coverage.covered(manifest, path)
