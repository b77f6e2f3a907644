"""The leader's offer planning at 256 to 10,000 nodes: a whole plan against a round that
plans only what changed (issue 23).

A leader's view is fed key by key, as its watch would: one running workflow of
``4 * nodes`` blocks of 2 tasks (half of them offered, half waiting; with ``--workers``,
one-task blocks of an experiment with that cap), and ``nodes``
nodes that choose from offers. Then, timed with ``time.perf_counter`` (medians of ``--rounds``):

- a whole plan (``plan_offers``, what every leader round did before: every node, every
  block);
- a round after nothing changed;
- a round after ``--claims`` nodes each claimed one of their offered blocks (the common
  busy round: each such node's offer is rewritten).

    .venv/bin/python scripts/bench_offers.py [--nodes 256 1000 10000] [--claims 10]
        [--rounds 5] [--prefer-pools] [--workers W] [--json]

Pure Python on one core, no etcd: the planning alone. It asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypermesh.agent.leader.offers import Offers, plan_offers
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.keyspace import BlockRef, Keyspace
from hypermesh.state.records import NodeRecord, WorkflowRecord, dumps
from hypermesh.state.view import MeshView

RECIPE = """
experiments:
  e:
    command: 'true'
    samples: 10
"""


def one_workflow(nodes: int, offers: bool, extra: str = ""
                 ) -> tuple[MeshView, Callable[[str, Any], None]]:
    """A view of one running workflow (experiment ``e``) and ``nodes`` nodes (taking
    offers or not), and what feeds it one more key as a watch would."""
    ks = Keyspace("bench")
    view = MeshView(ks)
    revisions = iter(range(1, 1 << 40))

    def put(key: str, value: Any) -> None:
        rev = next(revisions)
        view.apply(key, dumps(value), rev, rev)

    wf = WorkflowRecord(id="w", name="bench",
                        recipe=parse_recipe(textwrap.dedent(RECIPE) + extra),
                        seed=7, submitted_at=1.0, workdir="/tmp")
    put(ks.workflow("w"), wf.to_json())
    put(ks.workflow_state("w"), {"state": "running"})
    for i in range(nodes):
        put(ks.node(f"n{i}"), NodeRecord(f"n{i}", "a:1", offers=offers).to_json())
    return view, put


def mesh(nodes: int, extra: str = "", size: int = 2) -> MeshView:
    """A leader's view of one running workflow of ``4 * nodes`` blocks of ``size`` tasks
    and ``nodes`` nodes that take offers; ``extra``: more of the experiment's fields."""
    view, put = one_workflow(nodes, offers=True, extra=extra)
    ks = view.ks
    for first in range(0, 4 * size * nodes, size):
        put(ks.block(BlockRef("w", "e", first)),
            {"params": [{"i": first + k} for k in range(size)]})
    put(ks.expanded("w", "e"), {"count": 4 * size * nodes})
    return view


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(nodes: int, claims: int, rounds: int, prefer: bool = False,
            workers: int | None = None) -> dict[str, Any]:
    extra = "    prefer_pools: [default]\n" if prefer else ""
    if workers is not None:
        extra += f"    workers: {workers}\n"
    view = mesh(nodes, extra, size=1 if workers is not None else 2)
    offers = Offers(cast(Any, SimpleNamespace(view=view)))
    if prefer:
        offers.pool_delay = 5.0
    offers.changes(0.0)
    whole = [timed(lambda: plan_offers(view, {}, current=offers._written))
             for _ in range(rounds)]
    # A whole plan as a leader round makes it (``Offers``: the waiting blocks and, with
    # prefer_pools, which node each block is kept for), every RESCAN_S.
    whole_round = [timed(functools.partial(offers.changes, 10.0 * (r + 1)))
                   for r in range(rounds)]
    offers.changes(10.0 * (rounds + 1))
    rev = view.revision
    idle = [timed(lambda: offers.changes(0.1)) for _ in range(rounds)]
    busy, written = [], []
    for r in range(rounds):
        for i in range(claims):
            name = f"n{(r * claims + i) % nodes}"
            held = offers._written.get(name) or ()
            if held:
                rev += 1
                view.apply(view.ks.block_claim(held[0]), dumps({"node": name, "lease": 1}),
                           rev, rev)
                slot = offers._caps.slot(held[0])
                if slot is not None:  # a capped block's claim takes its slot with it
                    key = view.ks.block_slot("w", "e", slot)
                    view.apply(key, dumps({"node": name, "first": held[0].first}), rev, rev)
        t0 = time.perf_counter()
        out = offers.changes(10.0 * (rounds + 1) + 0.2 + r * 0.01)
        busy.append(time.perf_counter() - t0)
        written.append(len(out))
    return {
        "nodes": nodes, "blocks": 4 * nodes, "claims": claims,
        "whole_plan_ms": 1e3 * statistics.median(whole),
        "whole_round_ms": 1e3 * statistics.median(whole_round),
        "round_unchanged_ms": 1e3 * statistics.median(idle),
        "round_after_claims_ms": 1e3 * statistics.median(busy),
        "offers_written_per_round": statistics.median(written),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[256, 1000, 10000])
    p.add_argument("--claims", type=int, default=10, help="claims between busy rounds [10]")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefer-pools", action="store_true",
                   help="the experiment prefers the nodes' pool: its blocks are kept for "
                   "a node with room as they are offered")
    p.add_argument("--workers", type=int, default=None, metavar="W",
                   help="the experiment has a workers cap of W (one-task blocks, each "
                   "offered with a slot of the cap; claims take theirs)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = [measure(n, args.claims, args.rounds, args.prefer_pools, args.workers)
            for n in args.nodes]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'nodes':>7}{'blocks':>8}{'whole plan':>13}{'whole round':>14}{'unchanged':>12}"
          f"{'after ' + str(args.claims) + ' claims':>18}{'offers written':>16}")
    for r in rows:
        print(f"{r['nodes']:>7}{r['blocks']:>8}{r['whole_plan_ms']:>10.2f} ms"
              f"{r['whole_round_ms']:>11.2f} ms"
              f"{r['round_unchanged_ms']:>9.3f} ms{r['round_after_claims_ms']:>15.3f} ms"
              f"{r['offers_written_per_round']:>16g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
