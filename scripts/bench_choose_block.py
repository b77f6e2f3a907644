"""A node that chooses blocks itself, on a large mesh: ``choose_block`` with and without
its cursors past the finished blocks (issue 23).

On a mesh of 64 slots or more a small experiment runs in one-task blocks, so an
experiment may have tens of thousands of blocks. A view is fed key by key, as a node's
watch would: one running workflow of ``--blocks`` one-task blocks of which all but
``--open`` have a result, and 64 nodes. Then ``choose_block`` is timed (medians of
``--rounds`` calls): without cursors (every call scans from the first block, as before)
and with the cursors a node keeps (``BlockDuty.cursors``; the first call scans, the
next start where it stopped).

    .venv/bin/python scripts/bench_choose_block.py [--blocks 16000] [--open 500]
        [--rounds 50] [--json]

Pure Python on one core, no etcd. It asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_offers import one_workflow

from hypermesh.agent.tasks.blocks import choose_block
from hypermesh.state.blocks import Batch, ResultEntry
from hypermesh.state.keyspace import BlockRef
from hypermesh.state.view import MeshView


def view_of(blocks: int, still_open: int) -> MeshView:
    """A node's view of one running workflow of ``blocks`` one-task blocks, all but the
    last ``still_open`` finished, and 64 nodes."""
    view, put = one_workflow(64, offers=False)
    ks = view.ks
    for first in range(blocks):
        put(ks.block(BlockRef("w", "e", first)), {"params": [{"i": first}]})
    put(ks.expanded("w", "e"), {"count": blocks})
    for first in range(blocks - still_open):
        done = Batch("n1", (), (ResultEntry(first, "succeeded", 1, 0, 1.0),))
        put(f"{ks.block_batches(BlockRef('w', 'e', first))}b{first}", done.to_json())
    return view


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=16000)
    p.add_argument("--open", type=int, default=500)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not 0 < args.open <= args.blocks:
        p.error("--open must be between 1 and --blocks")
    view = view_of(args.blocks, args.open)
    me = view.nodes["n0"]
    rng = random.Random(1)
    cursors: dict[tuple[str, str], int] = {}

    def per_call(**kw: Any) -> float:
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            choose_block(view, me, set(), rng, **kw)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    result = {"blocks": args.blocks, "open": args.open,
              "without_cursors_ms": per_call(), "with_cursors_ms": per_call(cursors=cursors)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.blocks} one-task blocks, {args.open} open: choose_block "
              f"{result['without_cursors_ms']:.3f} ms a call without cursors, "
              f"{result['with_cursors_ms']:.3f} ms with (medians of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
