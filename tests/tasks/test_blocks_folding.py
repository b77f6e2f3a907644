"""Folded blocks (issue 22, ``hypermesh/state/folding.py``): a mirror keeps settled blocks
as counts and a packed copy past ``fold_after`` settled tasks, and what it answers is
what a mirror that never folds answers; unfolding brings back exactly the records."""

from __future__ import annotations

import random
import textwrap
from collections import Counter

import pytest

from hypermesh.agent.ops.metrics import Snapshot, count_attempts, count_folded_attempts
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.records import WorkflowRecord, dumps
from hypermesh.state.view import MeshView
from tests.tasks.test_blocks import _block_events, _tables

RECIPE = """
experiments:
  e: {samples: 8, command: ["true"]}
"""
BLOCKS = (BlockRef("w", "e", 0), BlockRef("w", "e", 4))


def views(ks: Keyspace) -> tuple[MeshView, MeshView, MeshView]:
    """A view that never folds, one that folds every settled block at once, and one
    that also defers batches (a node that does not lead), each knowing workflow w."""
    plain, folding, lazy = MeshView(ks), MeshView(ks), MeshView(ks)
    folding.fold_after = lazy.fold_after = 0
    lazy.defer_batches = True
    wf = WorkflowRecord(id="w", name="w", recipe=parse_recipe(textwrap.dedent(RECIPE)), seed=1,
                        submitted_at=1.0, workdir="/tmp")
    for view in (plain, folding, lazy):
        view.apply(ks.workflow("w"), dumps(wf.to_json()), 1, 1)
    return plain, folding, lazy


def settled(view: MeshView, b: BlockRef) -> bool:
    written = b.first in view.blocks.get((b.workflow, b.experiment), {})
    return written and b not in view.block_claims and view.block_unfinished(b) == 0


@pytest.mark.parametrize("seed", range(20))
def test_folding_answers_what_the_records_answer_and_unfolds_to_them(seed: int) -> None:
    ks = Keyspace("t")
    rng = random.Random(seed)
    plain, folding, lazy = views(ks)
    for rev, (key, value) in enumerate(_block_events(rng, ks), start=2):
        for view in (plain, folding, lazy):
            view.apply(key, None if value is None else dumps(value), rev, rev)
            view.fold_settled()
        for b in BLOCKS:
            assert (b in folding.folded) == settled(plain, b) == (b in lazy.folded)
            assert folding.block_unfinished(b) == lazy.block_unfinished(b) == (
                plain.block_unfinished(b))
        assert {k: +c for k, c in folding.counts.items()} == {
            k: +c for k, c in plain.counts.items()}
        wf = plain.workflows["w"]
        exp = wf.recipe.experiment("e")
        assert folding.experiment_summary(wf, exp) == plain.experiment_summary(wf, exp)
    lazy.settle()
    assert lazy.experiment_summary(wf, exp) == plain.experiment_summary(wf, exp)
    for view in (folding, lazy):
        for b in list(view.folded):
            view.unfold(b)
        view.settle()
        assert _tables(view) == _tables(plain)


def test_a_folded_block_keeps_counts_and_attempts_and_drops_its_records() -> None:
    ks = Keyspace("t")
    plain, folding, _ = views(ks)
    b = BLOCKS[0]
    events = [
        (ks.block(b), {"params": [{"i": i} for i in range(4)]}),
        (ks.block_claim(b), {"node": "n1", "lease": 1}),
        (f"{ks.block_batches(b)}1", {"node": "n1", "a": [[0, 1, "failed", None, "node-lost",
                                                          1.0, 2.0]]}),
        (f"{ks.block_batches(b)}2", {"node": "n2", "a": [
            [i, 2 if i == 0 else 1, "succeeded", 0, "exit", 1.0, 2.0] for i in range(4)],
            "r": [[i, "succeeded", 2 if i == 0 else 1, 0, 2.0] for i in range(4)]}),
        (ks.block_claim(b), None),
    ]
    for rev, (key, value) in enumerate(events, start=2):
        for view in (plain, folding):
            view.apply(key, None if value is None else dumps(value), rev, rev)
            view.fold_settled()
    assert b in folding.folded and not any(r.workflow == "w" for r in folding.tasks)
    assert not folding.results and not any(folding.attempts.values())
    assert folding.counts[("w", "e")]["succeeded"] == 4
    assert folding.folded_attempts() == Counter({
        ("n1", "failed", "node-lost", ""): 1, ("n2", "succeeded", "exit", "node-lost"): 1,
        ("n2", "succeeded", "exit", ""): 3})
    # A retry reopens a task: the block unfolds and the task is open again.
    folding.apply(f"{ks.block_batches(b)}3", dumps({"node": "cli", "o": [[2, 1]]}), 9, 9)
    folding.fold_settled()
    assert b not in folding.folded and folding.open[("w", "e")] == {2}
    assert folding.tasks[TaskRef("w", "e", 2)] == {"params": {"i": 2}}
    # Deleting the workflow's blocks while folded forgets them and their counts.
    plain.apply(f"{ks.block_batches(b)}3", dumps({"node": "cli", "o": [[2, 1]]}), 9, 9)
    for view in (plain, folding):
        view.apply(f"{ks.block_batches(b)}4", dumps(
            {"node": "n1", "r": [[2, "succeeded", 2, 0, 3.0]]}), 10, 10)
        view.fold_settled()
    assert b in folding.folded
    rev = 10
    for key in [k for k, _ in events[2:4]] + [f"{ks.block_batches(b)}3",
                                              f"{ks.block_batches(b)}4", ks.block(b)]:
        rev += 1
        for view in (plain, folding):
            view.apply(key, None, 0, rev)
            view.fold_settled()
    assert not folding.folded and not folding.blocks.get(("w", "e"))
    assert {k: +c for k, c in folding.counts.items() if +c} == {
        k: +c for k, c in plain.counts.items() if +c} == {}


def test_an_experiment_ranked_by_a_metric_is_never_folded() -> None:
    ks = Keyspace("t")
    view = MeshView(ks)
    view.fold_after = 0
    wf = WorkflowRecord(
        id="w", name="w", seed=1, submitted_at=1.0, workdir="/tmp",
        recipe=parse_recipe(textwrap.dedent("""
            experiments:
              e:
                samples: 4
                command: ["true"]
                objective: {metric: loss, goal: minimize}
            """)),
    )
    view.apply(ks.workflow("w"), dumps(wf.to_json()), 1, 1)
    b = BLOCKS[0]
    view.apply(ks.block(b), dumps({"params": [{}] * 4}), 2, 2)
    view.apply(f"{ks.block_batches(b)}1", dumps(
        {"node": "n", "r": [[i, "succeeded", 1, 0, 1.0] for i in range(4)]}), 3, 3)
    view.fold_settled()
    assert not view.folded and len(view.results) == 4


@pytest.mark.parametrize("seed", range(5))
def test_metrics_count_folded_attempts_as_they_count_records(seed: int) -> None:
    """An agent's attempt counters (``/metrics``) do not fall when blocks fold."""
    ks = Keyspace("t")
    plain, folding, _ = views(ks)
    for rev, (key, value) in enumerate(_block_events(random.Random(seed), ks), start=2):
        for view in (plain, folding):
            view.apply(key, None if value is None else dumps(value), rev, rev)
            view.fold_settled()
    for node in ("n1", "n2"):
        expected, got = Snapshot(node=node), Snapshot(node=node)
        count_attempts(expected, plain.attempts.values())
        count_attempts(got, folding.attempts.values())
        count_folded_attempts(got, folding.folded_attempts())
        assert (got.node_attempts, got.node_recoveries, got.mesh_lost_attempts) == (
            expected.node_attempts, expected.node_recoveries, expected.mesh_lost_attempts)
