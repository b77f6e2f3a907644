"""Many :class:`~hypermesh.agent.gossip.swim.Swim` members in one process, on a virtual clock.

A discrete-event simulation: one heap of timed events (message deliveries,
ticks, send failures), each member ticked exactly when its ``next_deadline``
says. The network can delay (uniformly within a range), lose (independently,
per message), partition (groups that cannot reach each other), and its members
can crash silently (messages vanish, like a stopped or unplugged machine),
crash "refused" (every send fails with a refused connection after one network
delay, like a killed process on a live host), or pause and resume (messages
wait in the member's inbox, like SIGSTOP/SIGCONT; the resumed member then ticks
late).

Members start from a shared :class:`~hypermesh.agent.gossip.swim.Roster` (everyone
knows everyone, alive at incarnation 0) or join through a seed, and more can join
later (:meth:`SimNet.add`). Ten thousand
members for tens of protocol periods take about a minute on one core.

Observation: ``deaths`` lists every (time, observer, member) death verdict and
``false_deaths`` those about a member that was in fact up (or only paused);
``first_refusal`` when each refusing member first refused a message;
``watch(member)`` records when each observer first saw each state of it, and
each meta version; ``stats`` counts messages (and bytes, when measured) in all and
by sender.
"""

from __future__ import annotations

import functools
import heapq
import json
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hypermesh.agent.gossip.broadcast import DEAD
from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.swim import Message, Outgoing, Roster, Swim

UP, SILENT, REFUSING, PAUSED = 0, 1, 2, 3
_DELIVER, _TICK, _FAIL, _CALL = 0, 1, 2, 3
_INF = float("inf")


@dataclass
class Watch:
    """First time each observer saw a member in each state, and each meta version."""

    states: dict[str, dict[str, float]] = field(default_factory=dict)
    meta: dict[int, dict[str, float]] = field(default_factory=dict)


@dataclass
class SimStats:
    """Traffic counters. ``bytes``, ``largest`` (bytes of the largest message of each
    kind) and ``sent_bytes`` only when the net measures them; ``sent`` and
    ``sent_bytes`` by sender, in the order of ``SimNet.names``."""

    messages: int = 0
    updates: int = 0  # rows carried, summed over the messages
    delivered: int = 0
    lost: int = 0
    bytes: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    sent: list[int] = field(default_factory=list)
    sent_bytes: list[int] = field(default_factory=list)
    largest: Counter[str] = field(default_factory=Counter)


class SimNet:
    """The simulated network and its members; the only mutator of both."""

    def __init__(
        self,
        n: int,
        cfg: GossipConfig | None = None,
        seed: int = 0,
        latency: tuple[float, float] = (0.0005, 0.002),
        loss: float = 0.0,
        bootstrap: str = "roster",
        measure_bytes: bool = False,
        start: float = 0.0,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {loss}")
        if not 0.0 <= latency[0] <= latency[1]:
            raise ValueError(f"latency must be a range 0 <= low <= high, got {latency}")
        if bootstrap not in ("roster", "join"):
            raise ValueError(f"bootstrap must be 'roster' or 'join', got {bootstrap!r}")
        self.cfg = cfg or GossipConfig.lan()
        self.now = start
        self.loss = loss
        self.latency = latency
        self.measure_bytes = measure_bytes
        self.stats = SimStats()
        self.deaths: list[tuple[float, str, str]] = []
        self.false_deaths: list[tuple[float, str, str]] = []
        self.transitions: Counter[tuple[str, str]] = Counter()
        self.first_refusal: dict[str, float] = {}  # member -> first send it refused
        self._rng = random.Random(seed)
        self.names = [f"n{i}" for i in range(n)]
        self.index = {name: i for i, name in enumerate(self.names)}
        addresses = [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:7946" for i in range(n)]
        self.meta = meta  # every member's meta from the start (and a later one's)
        roster = Roster(list(zip(self.names, addresses, strict=True)), start, meta)
        use_roster = roster if bootstrap == "roster" else None
        self.nodes = [
            Swim(
                name,
                addresses[i],
                self.cfg,
                random.Random(seed * 1_000_003 + i),
                start,
                meta=meta,
                roster=use_roster,
            )
            for i, name in enumerate(self.names)
        ]
        self.status = [UP] * n
        self.stats.sent = [0] * n
        self.stats.sent_bytes = [0] * n
        self._group = [0] * n
        self._inbox: dict[int, list[tuple[int, Message]]] = {}
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._sched = [_INF] * n
        self._watches: dict[str, Watch] = {}
        for i in range(n):
            self._reschedule(i)
        if bootstrap == "join":
            seed_pair = [(self.names[0], addresses[0])]
            for i in range(1, n):
                at = start + (i / n) * self.cfg.protocol_period
                self.at(at, functools.partial(self._join, i, seed_pair))

    # ---------------------------------------------------------------- control

    def at(self, t: float, action: Callable[[], object]) -> None:
        """Run ``action()`` at virtual time ``t``."""
        self._push(t, _CALL, -1, action)

    def run_until(self, t: float) -> None:
        """Process every event up to virtual time ``t``; the clock then reads ``t``."""
        heap = self._heap
        while heap and heap[0][0] <= t:
            when, _, kind, i, payload = heapq.heappop(heap)
            self.now = when
            if kind == _DELIVER:
                src, msg = payload
                self._deliver(src, i, msg)
            elif kind == _TICK:
                if when == self._sched[i]:
                    self._sched[i] = _INF
                    if self.status[i] == UP:
                        self._call(i, self.nodes[i].tick(when))
            elif kind == _FAIL:
                to, refused = payload
                if self.status[i] == UP:
                    self._call(i, self.nodes[i].send_failed(to, when, refused))
            else:
                payload()
        self.now = max(self.now, t)

    def run_periods(self, periods: float) -> None:
        """Run for ``periods`` protocol periods of virtual time."""
        self.run_until(self.now + periods * self.cfg.protocol_period)

    def crash(self, name: str, refused: bool = False) -> None:
        """Stop ``name`` for good: silently, or refusing every connection."""
        self.status[self.index[name]] = REFUSING if refused else SILENT

    def pause(self, name: str) -> None:
        """Stop ``name`` until :meth:`resume`; messages to it wait in its inbox."""
        self.status[self.index[name]] = PAUSED

    def resume(self, name: str) -> None:
        """Resume ``name``: it ticks (late), then reads its inbox."""
        i = self.index[name]
        self.status[i] = UP
        self._call(i, self.nodes[i].tick(self.now))
        for src, msg in self._inbox.pop(i, []):
            self._deliver(src, i, msg)

    def add(self, seeds: Iterable[str]) -> str:
        """A new member, in no roster, that joins now through ``seeds``; its name."""
        i = len(self.nodes)
        name = f"n{i}"
        address = f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:7946"
        rng = random.Random(self._rng.random())
        self.names.append(name)
        self.index[name] = i
        self.nodes.append(Swim(name, address, self.cfg, rng, self.now, meta=self.meta))
        self.status.append(UP)
        self.stats.sent.append(0)
        self.stats.sent_bytes.append(0)
        self._group.append(0)
        self._sched.append(_INF)
        self._join(i, [(s, self.nodes[self.index[s]].address) for s in seeds])
        return name

    def set_meta(self, name: str, meta: dict[str, Any]) -> None:
        """``name`` publishes new meta now."""
        i = self.index[name]
        self.nodes[i].set_meta(meta, self.now)
        self._call(i, [])

    def leave(self, name: str) -> None:
        """``name`` leaves gracefully now (it keeps running until crashed)."""
        i = self.index[name]
        self._call(i, self.nodes[i].leave(self.now))

    def partition(self, groups: Iterable[Iterable[str]]) -> None:
        """Cut the network into ``groups``; members not named form one more group."""
        self._group = [0] * len(self.nodes)
        for g, members in enumerate(groups, start=1):
            for name in members:
                self._group[self.index[name]] = g

    def heal(self) -> None:
        """Undo :meth:`partition`."""
        self._group = [0] * len(self.nodes)

    def watch(self, member: str) -> Watch:
        """Start recording when each observer first sees each state and meta version
        of ``member``."""
        return self._watches.setdefault(member, Watch())

    def up(self) -> list[str]:
        """Members currently running (not crashed; paused ones included)."""
        return [n for i, n in enumerate(self.names) if self.status[i] in (UP, PAUSED)]

    def views_of(self, member: str) -> Counter[str]:
        """How many running members see ``member`` in each state (itself excluded)."""
        states: Counter[str] = Counter()
        for i, node in enumerate(self.nodes):
            if self.status[i] in (UP, PAUSED) and node.name != member:
                view = node.member(member)
                states[view.state if view else "unknown"] += 1
        return states

    # ---------------------------------------------------------------- machinery

    def _push(self, t: float, kind: int, i: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, i, payload))

    def _join(self, i: int, seeds: list[tuple[str, str]]) -> None:
        self._call(i, self.nodes[i].join(seeds, self.now))

    def _reschedule(self, i: int) -> None:
        d = self.nodes[i].next_deadline()
        if d < self._sched[i]:
            d = max(d, self.now)
            self._sched[i] = d
            self._push(d, _TICK, i, None)

    def _call(self, i: int, outs: list[Outgoing]) -> None:
        """Send what member ``i`` returned, note its state changes, reschedule it."""
        node = self.nodes[i]
        if outs:
            self._send(i, outs)
        events = node.drain_events()
        if events:
            self._observe(node.name, events)
        if self._watches:
            for member in node.drain_meta_changes():
                w = self._watches.get(member)
                if w is not None:
                    view = node.member(member)
                    if view is not None:
                        w.meta.setdefault(view.meta_version, {}).setdefault(node.name, self.now)
        self._reschedule(i)

    def _send(self, src: int, outs: list[Outgoing]) -> None:
        stats = self.stats
        lo, hi = self.latency
        rng = self._rng
        for out in outs:
            stats.messages += 1
            stats.updates += len(out.message.updates)
            stats.by_kind[out.message.kind] += 1
            stats.sent[src] += 1
            if self.measure_bytes:
                size = len(json.dumps(out.message.to_json(), separators=(",", ":")))
                stats.bytes += size
                stats.sent_bytes[src] += size
                kind = out.message.kind
                if size > stats.largest[kind]:
                    stats.largest[kind] = size
            dst = self.index.get(out.to)
            if dst is None or (self.loss and rng.random() < self.loss):
                stats.lost += 1
                continue
            self._push(self.now + lo + (hi - lo) * rng.random(), _DELIVER, dst, (src, out.message))

    def _deliver(self, src: int, dst: int, msg: Message) -> None:
        status = self.status[dst]
        if self._group[src] != self._group[dst] or status == SILENT:
            self.stats.lost += 1
        elif status == REFUSING:
            self.first_refusal.setdefault(self.names[dst], self.now)
            if self.status[src] == UP:
                self._call(src, self.nodes[src].send_failed(self.names[dst], self.now, True))
        elif status == PAUSED:
            self._inbox.setdefault(dst, []).append((src, msg))
        else:
            self.stats.delivered += 1
            self._call(dst, self.nodes[dst].receive(msg, self.now))

    def _observe(self, observer: str, events: list[tuple[str, str, str]]) -> None:
        for member, old, new in events:
            self.transitions[(old, new)] += 1
            if new == DEAD:
                self.deaths.append((self.now, observer, member))
                i = self.index.get(member)
                if i is not None and self.status[i] in (UP, PAUSED):
                    self.false_deaths.append((self.now, observer, member))
            w = self._watches.get(member)
            if w is not None:
                w.states.setdefault(new, {}).setdefault(observer, self.now)
