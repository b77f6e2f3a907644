"""Locality-aware claims, pure: a task's inputs (templates, manifest coverage) and the
placement policy (preference by bytes held, delay scheduling), driven with a fake
chunk locator and a virtual clock."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from hypermesh.agent.claims.choose import LocalLoad, choose_claims
from hypermesh.agent.claims.locality import Locality
from hypermesh.agent.claims.placement import Placement, held, prune_since
from hypermesh.chunkfs.coverage import CoverageCache, covered_chunks
from hypermesh.chunkfs.format import Entry, Extent
from hypermesh.chunkfs.holdings import Holding
from hypermesh.chunkfs.manifest import Manifest
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import FileStore
from hypermesh.config import AgentConfig, parse_locality_delay
from hypermesh.errors import RecipeError, UsageError
from hypermesh.recipe.inputs import input_problems, render_input
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.fit import fits
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import NodeRecord
from tests.chunkfs.test_chunkfs_manifest import build
from tests.claims.test_claims import Feed, node

# ------------------------------------------------------------------ the recipe field

SHARDS = """
experiments:
  e:
    data: {coco: coco}
    parameters: {shard: {values: [0, 1, 2, 3]}}
    inputs: ["coco/train/shard-{{shard}}"]
    command: echo {{shard}}
"""


def test_inputs_are_parsed_and_stored() -> None:
    exp = parse_recipe(SHARDS).experiment("e")
    assert exp.inputs == ("coco/train/shard-{{shard}}",)
    assert render_input(exp.inputs[0], {"shard": 2}) == ("coco", "train/shard-2")
    assert render_input("coco", {}) == ("coco", "")
    assert render_input("coco/a/", {}) == ("coco", "a")


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ('"other/x"', "'other' is not one of the experiment's data aliases (coco)"),
        ('"coco/{{nope}}"', "unknown template variable 'nope'"),
        ('"coco/{{attempt}}"', "unknown template variable 'attempt'"),
        ('"coco/a/../b"', "'..' segment"),
        ('"{{shard}}/x"', "must be a data alias, not a placeholder"),
        ("[]", "got an empty list"),
        ("[3]", "expected a non-empty string, got 3"),
    ],
)
def test_bad_inputs_are_named_with_field_and_line(inputs: str, message: str) -> None:
    text = SHARDS.replace('["coco/train/shard-{{shard}}"]', inputs)
    with pytest.raises(RecipeError) as err:
        parse_recipe(text, "r.yaml")
    assert "r.yaml:6: experiments.e.inputs" in str(err.value)
    assert message in str(err.value)


def test_inputs_need_data() -> None:
    assert input_problems("x/y", {}, []) == [
        "an experiment with 'inputs' needs 'data' (the data sets they are in)"
    ]


def test_a_value_cannot_escape_the_data_set() -> None:
    with pytest.raises(UsageError, match=r"'\.\.' segment"):
        render_input("coco/shard-{{s}}/x", {"s": "0/../../etc"})


# ------------------------------------------------------------------ manifest coverage


def tree() -> Manifest:
    """train/shard-0/{a,b} and train/shard-1/c over three chunks; a file spans two."""
    entries = [
        Entry("", "train", "d", 0o755, 1, 0),
        Entry("train", "shard-0", "d", 0o755, 1, 0),
        Entry("train", "shard-1", "d", 0o755, 1, 0),
        Entry("train/shard-0", "a", "f", 0o644, 1, 10, (Extent(0, 0, 10, 0),)),
        Entry("train/shard-0", "b", "f", 0o644, 1, 25,
              (Extent(0, 10, 10, 0), Extent(1, 0, 15, 10))),
        Entry("train/shard-0", "link", "l", 0o777, 1, 1, (), "a"),
        Entry("train/shard-1", "c", "f", 0o644, 1, 30, (Extent(2, 0, 30, 0),)),
    ]
    root, pages = build(sorted(entries, key=lambda e: e.sort_key), per_page=2)
    return Manifest(root, pages.__getitem__, cache_pages=1)


def test_a_directory_covers_every_file_below_it_by_bytes_per_chunk() -> None:
    m = tree()
    c0, c1, c2 = (c.id for c in m.root.chunks)
    assert covered_chunks(m, "train/shard-0") == {c0: 20, c1: 15}
    assert covered_chunks(m, "train/shard-1/c") == {c2: 30}
    assert covered_chunks(m, "train") == {c0: 20, c1: 15, c2: 30}
    assert covered_chunks(m, "") == {c.id: c.size for c in m.root.chunks}
    assert covered_chunks(m, "train/shard-0/link") == {}
    assert covered_chunks(m, "no/such") == {}


def test_answers_are_cached_per_version_and_path() -> None:
    m = tree()
    cache = CoverageCache(limit=1)
    first = cache.covered(m, "train/shard-0")
    loaded = m.pages_loaded
    assert cache.covered(m, "train/shard-0") is first
    assert m.pages_loaded == loaded
    cache.covered(m, "train/shard-1")  # evicts the first answer (limit 1)
    assert cache.covered(m, "train/shard-0") == first


# ------------------------------------------------------------------ the policy


class Locator:
    """Chunks this node holds, and the other nodes that advertise each chunk."""

    def __init__(self, mine: set[str], others: Mapping[str, set[str]]) -> None:
        self.mine = mine
        self.others = others

    def local(self, chunk: str) -> bool:
        return chunk in self.mine

    def holders(self, chunk: str) -> frozenset[str]:
        return frozenset(n for n, chunks in self.others.items() if chunk in chunks)


def test_held_counts_bytes_per_node_and_only_eligible_peers() -> None:
    loc = Locator({"a"}, {"p": {"a", "b"}, "q": {"b"}, "gone": {"a", "b", "c"}, "me": {"c"}})
    inputs = {"a": 10, "b": 20, "c": 5}
    h = held(inputs, loc, "me", ["p", "q"])
    assert (h.mine, h.best_other, h.best_node) == (10, 30, "p")
    assert held(inputs, loc, "me", []).best_node is None


SHARD_OF = {0: "s0", 1: "s1", 2: "s2", 3: "s3"}


def setup(
    locator: Locator, now: float = 0.0, since: dict[TaskRef, float] | None = None,
    peers: dict[str, NodeRecord] | None = None, known: bool = True, recipe: str = SHARDS,
) -> tuple[Feed, Placement]:
    feed = Feed()
    feed.workflow("w", recipe)
    feed.tasks("w", "e", 4)

    def inputs(ref: TaskRef) -> dict[str, int] | None:
        return {SHARD_OF[ref.index]: 100} if known else None

    placement = Placement(
        me="me", locator=locator, inputs=inputs,
        peers=peers if peers is not None else {"p": NodeRecord("p", "p:1", slots=1)},
        now=now, since={} if since is None else since, delay_s=3.0,
        fits=lambda exp, rec: fits(exp.hardware, rec) and (not exp.pools or rec.pool in exp.pools),
    )
    return feed, placement


def claimed(feed: Feed, placement: Placement, slots: int = 1) -> list[int]:
    plans = choose_claims(feed.view, node(slots=slots), LocalLoad(), 32, None, placement)
    return [p.ref.index for p in plans]


def test_a_node_takes_the_task_whose_data_it_holds_first() -> None:
    feed, placement = setup(Locator({"s2"}, {}))
    assert claimed(feed, placement) == [2]


def test_tasks_held_by_a_peer_wait_the_delay_then_anyone_takes_them() -> None:
    since: dict[TaskRef, float] = {}
    loc = Locator(set(), {"p": {"s0", "s1"}})
    feed, placement = setup(loc, now=10.0, since=since)
    assert claimed(feed, placement, slots=4) == [2, 3]  # nobody holds 2 and 3: at once
    assert placement.deferred == {TaskRef("w", "e", 0): "p", TaskRef("w", "e", 1): "p"}
    assert placement.next_deadline == 13.0
    feed, placement = setup(loc, now=12.9, since=since)
    assert claimed(feed, placement, slots=4) == [2, 3]
    feed, placement = setup(loc, now=13.0, since=since)
    assert claimed(feed, placement, slots=4) == [0, 1, 2, 3]
    assert placement.next_deadline is None


def test_more_bytes_held_wins_and_ties_stay_with_this_node() -> None:
    feed = Feed()
    feed.workflow("w", SHARDS)
    feed.tasks("w", "e", 3)
    per_task = {0: {"x": 10, "y": 10}, 1: {"x": 10, "y": 30}, 2: {"y": 5, "z": 50}}
    placement = Placement(
        me="me", locator=Locator({"x", "y"}, {"p": {"z", "x"}}),
        inputs=lambda ref: per_task[ref.index], peers={"p": NodeRecord("p", "p:1")},
        now=0.0, since={},
    )
    # task 1: 40 bytes here; task 0: 20 here vs 10 at p; task 2: 5 here, 50 at p -> deferred
    assert claimed(feed, placement, slots=3) == [1, 0]


def test_a_holder_that_cannot_run_the_task_is_not_waited_for() -> None:
    pinned = SHARDS.replace("    command:", "    pools: [gpu]\n    command:")
    loc = Locator(set(), {"p": {"s0"}})
    feed, placement = setup(loc, recipe=pinned, peers={"p": NodeRecord("p", "p:1", pool="cpu")})
    # this node is in no allowed pool either; give it one
    plans = choose_claims(feed.view, node(slots=4, pool="gpu"), LocalLoad(), 32, None, placement)
    assert [p.ref.index for p in plans] == [0, 1, 2, 3]
    feed, placement = setup(loc, recipe=pinned, peers={"p": NodeRecord("p", "p:1", pool="gpu")})
    plans = choose_claims(feed.view, node(slots=4, pool="gpu"), LocalLoad(), 32, None, placement)
    assert [p.ref.index for p in plans] == [1, 2, 3]


def test_unresolved_inputs_wait_at_most_the_delay() -> None:
    since: dict[TaskRef, float] = {}
    feed, placement = setup(Locator(set(), {}), now=0.0, since=since, known=False)
    assert claimed(feed, placement, slots=4) == []
    assert len(placement.missing) == 4 and placement.next_deadline == 3.0
    feed, placement = setup(Locator(set(), {}), now=3.0, since=since, known=False)
    assert claimed(feed, placement, slots=4) == [0, 1, 2, 3]


def test_experiments_without_inputs_are_untouched() -> None:
    plain = (
        "experiments:\n  e:\n    parameters: {s: {values: [0, 1, 2, 3]}}\n"
        "    command: echo {{s}}\n"
    )
    feed, placement = setup(Locator(set(), {"p": {"s0", "s1", "s2", "s3"}}), recipe=plain)
    assert claimed(feed, placement, slots=4) == [0, 1, 2, 3]
    assert placement.since == {} and placement.missing == []


def test_a_task_that_opens_again_waits_afresh() -> None:
    a, b = TaskRef("w", "e", 0), TaskRef("w", "e", 1)
    since = {a: 1.0, b: 2.0}
    prune_since(since, lambda r: r == b)
    assert since == {b: 2.0}


# ------------------------------------------------------------------ the setting


def test_locality_delay_setting_is_checked() -> None:
    assert parse_locality_delay("off") is None
    assert parse_locality_delay("2.5") == 2.5
    with pytest.raises(UsageError, match="expected seconds"):
        parse_locality_delay("soon")
    with pytest.raises(UsageError, match="--locality-delay 601"):
        AgentConfig.local(locality_delay=601.0)


def agent_start(work_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``hypermesh agent start`` with ``args``, run to its end (for refused settings)."""
    return subprocess.run(
        [sys.executable, "-m", "hypermesh", "agent", "start", "--work-dir", str(work_dir),
         *args],
        capture_output=True, text=True, timeout=60,
    )


def test_agent_start_refuses_a_bad_locality_delay(tmp_path: Path) -> None:
    out = agent_start(tmp_path, "--locality-delay", "soon")
    assert out.returncode == 2
    assert "--locality-delay 'soon': expected seconds (0-600) or 'off'" in out.stderr


# ------------------------------------------------------------------ the I/O layer


class FakeMounts:
    """``Mounts.holdings`` of a node whose caches hold ``held`` (chunk ids)."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.scans = 0

    def holdings(self) -> dict[str, Holding]:
        self.scans += 1
        return {c: Holding(c, 1, frozenset({0})) for c in self.held}


def test_locality_resolves_inputs_through_the_manifest_then_prefers_local_data(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    for shard in (0, 1):
        (src / f"shard-{shard}").mkdir(parents=True)
        (src / f"shard-{shard}" / "part").write_bytes(bytes([shard]) * (4 << 20))
    root = put_dataset(FileStore(tmp_path / "store"), src, "ds", chunk_size=4 << 20)
    chunk_of = {}
    for shard in (0, 1):
        entry = Manifest(root, FileStore(tmp_path / "store").get).lookup(f"shard-{shard}/part")
        assert entry is not None
        chunk_of[shard] = root.chunks[entry.extents[0].chunk].id
    feed = Feed()
    feed.workflow("w", SHARDS.replace("coco/train/", "coco/").replace("{coco: coco}",
                                                                       "{coco: ds}"))
    for i in (0, 1):
        feed.put(feed.ks.task(TaskRef("w", "e", i)), {"params": {"shard": i}})
    feed.put(feed.ks.expanded("w", "e"), {"count": 2})
    mounts = FakeMounts()
    mounts.held = {chunk_of[1]}
    decisions: list[str] = []

    async def scenario() -> list[list[int]]:
        woken = asyncio.Event()
        loc = Locality("me", f"file://{tmp_path / 'store'}", 5.0, mounts,  # type: ignore[arg-type]
                       woken.set, decisions.append)
        rounds = []
        try:
            for _ in range(3):
                placement = loc.placement(feed.view)
                plans = choose_claims(feed.view, node(slots=1), LocalLoad(), 32, None, placement)
                rounds.append([p.ref.index for p in plans])
                loc.after_round(placement, feed.view)
                if plans:
                    break
                await asyncio.wait_for(woken.wait(), 10)
                woken.clear()
        finally:
            loc.close()
        return rounds

    rounds = asyncio.run(scenario())
    # nothing until the caches were scanned and the inputs resolved; then shard 1 (held)
    assert rounds[0] == [] and rounds[-1] == [1], rounds
    assert mounts.scans >= 1 and decisions == []
