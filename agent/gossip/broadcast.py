"""What gossip carries — :class:`Update` and :class:`Message` — and the piggyback queue.

An update is one member's state as its sender knows it: alive, suspect, dead
or left, at an incarnation, with the member's meta while alive. A message is
one protocol step (ping, ack, ...) with updates riding on it; ``to_json`` /
``from_json`` are the wire format the transport sends. Pure.

The :class:`BroadcastQueue` picks the updates for each message: least
transmitted first, most recent first among equals, each one dropped once it was
sent ``retransmit_limit`` times, and a newer update about a member replacing the
queued one about the same member.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ALIVE = "alive"
SUSPECT = "suspect"
DEAD = "dead"
LEFT = "left"
STATES = (ALIVE, SUSPECT, DEAD, LEFT)
_STATE_CODE = {state: code for code, state in enumerate(STATES)}


def encode_meta(meta: dict[str, Any]) -> str:
    """Canonical JSON of a meta dict (sorted keys, no spaces): equal dicts, equal text."""
    return json.dumps(meta, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Update:
    """One member's state as a sender knows it. Immutable and hashable.

    ``meta_json`` is the member's meta as canonical JSON text (None: not carried,
    as on suspect/dead/left updates); ``source`` names who said so, for suspect
    and dead updates (a suspicion counts confirmations by distinct sources).
    """

    member: str
    address: str
    state: str
    incarnation: int
    meta_version: int = 0
    meta_json: str | None = None
    source: str = ""

    @classmethod
    def alive(
        cls, member: str, address: str, incarnation: int, meta_version: int, meta: dict[str, Any]
    ) -> Update:
        """An alive update carrying ``meta``."""
        return cls(member, address, ALIVE, incarnation, meta_version, encode_meta(meta))

    @property
    def meta(self) -> dict[str, Any] | None:
        """The carried meta as a fresh dict, or None."""
        return None if self.meta_json is None else dict(json.loads(self.meta_json))

    def to_wire(self) -> list[Any]:
        """A compact JSON-able list: ``[member, address, state code, incarnation,
        meta_version, meta or null, source]``, trailing defaults left off."""
        meta = None if self.meta_json is None else json.loads(self.meta_json)
        row: list[Any] = [
            self.member,
            self.address,
            _STATE_CODE[self.state],
            self.incarnation,
            self.meta_version,
            meta,
            self.source,
        ]
        while len(row) > 4 and row[-1] in (None, "", 0):
            row.pop()
        return row

    @classmethod
    def from_wire(cls, row: list[Any]) -> Update:
        """Inverse of :meth:`to_wire`; raises ValueError on a malformed row."""
        if not isinstance(row, list) or not 4 <= len(row) <= 7:
            raise ValueError(f"an update is a list of 4 to 7 fields, got {row!r}")
        member, address, code, incarnation = row[:4]
        meta_version = row[4] if len(row) > 4 else 0
        meta = row[5] if len(row) > 5 else None
        source = row[6] if len(row) > 6 else ""
        if not isinstance(code, int) or not 0 <= code < len(STATES):
            raise ValueError(f"unknown state code {code!r}")
        if not (isinstance(member, str) and isinstance(address, str) and isinstance(source, str)):
            raise ValueError(f"member, address and source must be strings in {row!r}")
        if not (isinstance(incarnation, int) and isinstance(meta_version, int)):
            raise ValueError(f"incarnation and meta_version must be integers in {row!r}")
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"meta must be an object in {row!r}")
        meta_json = None if meta is None else encode_meta(meta)
        return cls(member, address, STATES[code], incarnation, meta_version, meta_json, source)


KINDS = ("ping", "ack", "nack", "ping_req", "push_pull", "push_pull_reply", "gossip")


@dataclass(frozen=True, slots=True)
class Message:
    """One one-way protocol message. ``refused`` marks a nack whose target refused."""

    kind: str
    sender: str
    sender_addr: str
    seq: int = 0
    target: str = ""
    target_addr: str = ""
    updates: tuple[Update, ...] = ()
    table: tuple[Update, ...] = ()
    refused: bool = False

    def to_json(self) -> dict[str, Any]:
        """A compact JSON-able dict; fields at their defaults are left out."""
        out: dict[str, Any] = {"k": self.kind, "f": self.sender, "fa": self.sender_addr}
        if self.seq:
            out["q"] = self.seq
        if self.target:
            out["t"] = self.target
        if self.target_addr:
            out["ta"] = self.target_addr
        if self.updates:
            out["u"] = [u.to_wire() for u in self.updates]
        if self.table:
            out["tb"] = [u.to_wire() for u in self.table]
        if self.refused:
            out["r"] = 1
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Message:
        """Inverse of :meth:`to_json`; raises ValueError on anything malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"a message is an object, got {type(data).__name__}")
        kind = data.get("k")
        if kind not in KINDS:
            raise ValueError(f"unknown message kind {kind!r}; expected one of {KINDS}")
        strings = {key: data.get(key, "") for key in ("f", "fa", "t", "ta")}
        if not all(isinstance(v, str) for v in strings.values()) or not strings["f"]:
            raise ValueError("sender, addresses and target must be strings (sender non-empty)")
        seq = data.get("q", 0)
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise ValueError(f"seq must be an integer, got {seq!r}")
        rows = {key: data.get(key, []) for key in ("u", "tb")}
        if not all(isinstance(v, list) for v in rows.values()):
            raise ValueError("updates and table must be lists")
        return cls(
            kind=kind,
            sender=strings["f"],
            sender_addr=strings["fa"],
            seq=seq,
            target=strings["t"],
            target_addr=strings["ta"],
            updates=tuple(Update.from_wire(r) for r in rows["u"]),
            table=tuple(Update.from_wire(r) for r in rows["tb"]),
            refused=bool(data.get("r", 0)),
        )


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A message the transport must send to member ``to`` at ``address``."""

    to: str
    address: str
    message: Message


class BroadcastQueue:
    """Updates waiting to be piggybacked, with how often each was sent.

    Holds at most one update per member. Only its owner (one ``Swim``) changes it.
    Internally one bucket per transmit count, each in insertion order, so taking
    ``n`` updates costs O(n + limit), not a sort of the whole queue.
    """

    def __init__(self) -> None:
        self._buckets: list[dict[str, Update]] = [{}]
        self._where: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __contains__(self, member: object) -> bool:
        return member in self._where

    def push(self, update: Update) -> None:
        """Queue ``update``, unsent, in place of any queued update about the same member."""
        self.drop(update.member)
        self._buckets[0][update.member] = update
        self._where[update.member] = 0

    def drop(self, member: str) -> None:
        """Forget the queued update about ``member``, if any."""
        sent = self._where.pop(member, None)
        if sent is not None:
            del self._buckets[sent][member]

    def get(self, member: str) -> Update | None:
        """The queued update about ``member``, if any."""
        sent = self._where.get(member)
        return None if sent is None else self._buckets[sent][member]

    def transmits(self, member: str) -> int | None:
        """How often the queued update about ``member`` was taken so far."""
        return self._where.get(member)

    def take(self, limit: int, max_transmits: int, skip: str = "") -> list[Update]:
        """Up to ``limit`` updates for one message: least sent first; among updates sent
        equally often, the one that reached that count last first (so among unsent
        updates, the newest).

        Each one taken counts one transmission; one that reaches ``max_transmits``
        leaves the queue. Updates about ``skip`` are left alone (the caller carries
        its own).
        """
        self._trim(max_transmits)
        chosen: list[tuple[int, Update]] = []
        wanted = min(limit, len(self._where))
        for sent, bucket in enumerate(self._buckets):
            if len(chosen) >= wanted:
                break
            for member in reversed(bucket):
                if member != skip:
                    chosen.append((sent, bucket[member]))
                    if len(chosen) >= wanted:
                        break
        # Move the taken ones up a bucket, oldest first, so newest stays first.
        for sent, update in reversed(chosen):
            member = update.member
            del self._buckets[sent][member]
            if sent + 1 >= max_transmits:
                del self._where[member]
                continue
            if sent + 1 == len(self._buckets):
                self._buckets.append({})
            self._buckets[sent + 1][member] = update
            self._where[member] = sent + 1
        return [update for _, update in chosen]

    def pending(self) -> list[Update]:
        """Everything queued, in the order :meth:`take` would pick it."""
        return [bucket[m] for bucket in self._buckets for m in reversed(bucket)]

    def _trim(self, max_transmits: int) -> None:
        # The limit shrinks when the mesh does: drop what was already sent enough.
        while len(self._buckets) > max(1, max_transmits):
            for member in self._buckets.pop():
                del self._where[member]
