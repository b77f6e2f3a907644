#!/usr/bin/env python3
"""What writing and reading a busy mesh's gossip messages costs a member, before and
after the wire path's two shortcuts (issue 23).

    bench_gossip_wire.py [--sizes 32,256] [--seconds 20] [--rounds 3] [--json]

Simulates the busy mesh of ``bench_gossip_sim.py --busy`` (every member's task counts
change every 2 s). At every delivery of a message that carries rows it times, message
by message and in the same run:

- *writing* it: ``json.dumps(message.to_json())`` (each row's meta parsed from its
  canonical JSON and written again: the agent before) against ``message.encode()``
  (the meta text spliced in as held: the agent now);
- *reading* it against the receiver's table at that moment: every row checked and its
  meta re-encoded as canonical JSON (before) against ``Message.from_json`` with the
  receiver's ``stale_row``, which leaves out unread the rows that carry nothing new
  (now).

Reports the rows per message, the share of rows read, and microseconds per message
each way (medians over ``--rounds`` runs). Not a figure the issue names: it tells what
gossip's wire path costs per message, which a one-slot agent of a busy mesh pays a few
times a second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gossip_sim import busy

from hypermesh.agent.gossip.broadcast import Message
from hypermesh.agent.gossip.simnet import SimNet


class TimedNet(SimNet):
    """The simulated mesh, timing both ways of writing and reading each message with
    rows it delivers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.messages = self.rows = self.read = 0
        self.seconds = dict.fromkeys(("write_before", "write_now", "read_before",
                                      "read_now"), 0.0)

    def _deliver(self, src: int, dst: int, msg: Message) -> None:
        if msg.updates:
            clock, took = time.perf_counter, self.seconds
            t0 = clock()
            before = json.dumps(msg.to_json(), separators=(",", ":")).encode()
            t1 = clock()
            payload = msg.encode()
            t2 = clock()
            every = Message.from_json(json.loads(before), [])
            t3 = clock()
            news = Message.from_json(json.loads(payload), [], self.nodes[dst].stale_row)
            t4 = clock()
            took["write_before"] += t1 - t0
            took["write_now"] += t2 - t1
            took["read_before"] += t3 - t2
            took["read_now"] += t4 - t3
            self.messages += 1
            self.rows += len(every.updates)
            self.read += len(news.updates)
        super()._deliver(src, dst, msg)


def run(n: int, seconds: float) -> dict[str, Any]:
    nets: list[TimedNet] = []

    def make(*args: Any, **kwargs: Any) -> TimedNet:
        nets.append(TimedNet(*args, **kwargs))
        return nets[-1]

    busy(n, seconds, make_net=make)
    net = nets[0]
    us = {f"{k}_us": 1e6 * v / net.messages for k, v in net.seconds.items()}
    return {"n": n, "messages": net.messages, "rows_per_message": net.rows / net.messages,
            "share_read": net.read / net.rows, **us,
            "write_ratio": us["write_now_us"] / us["write_before_us"],
            "read_ratio": us["read_now_us"] / us["read_before_us"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="32,256", help="members, comma-separated [32,256]")
    p.add_argument("--seconds", type=float, default=20.0, help="busy seconds simulated [20]")
    p.add_argument("--rounds", type=int, default=3, help="runs per size; medians [3]")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    args = p.parse_args(argv)
    log = sys.stderr if args.json else sys.stdout
    out = []
    for n in (int(s) for s in args.sizes.split(",") if s):
        runs = [run(n, args.seconds) for _ in range(args.rounds)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        out.append(row)
        print(f"{n} members: {row['rows_per_message']:.1f} rows a message, "
              f"{100 * row['share_read']:.0f} % of them read. Writing a message "
              f"{row['write_before_us']:.1f} us before, {row['write_now_us']:.1f} us now "
              f"({row['write_ratio']:.2f}x); reading it {row['read_before_us']:.1f} us "
              f"before, {row['read_now_us']:.1f} us now ({row['read_ratio']:.2f}x)",
              file=log, flush=True)
    if args.json:
        print(json.dumps({"command": " ".join(sys.argv), "sizes": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
