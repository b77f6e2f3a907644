"""What gossip carries — :class:`Update` and :class:`Message` — and the piggyback queue.

An update is one member's state as its sender knows it: alive, suspect, dead
or left, at an incarnation, with the member's meta while alive. A message is
one protocol step (ping, ack, ...) with updates riding on it; ``to_json`` /
``from_json`` are the wire format the transport sends. Pure.

The :class:`BroadcastQueue` picks the updates for each message: loud ones before
quiet ones, least transmitted first, most recent first among equals, each one
dropped once it was sent ``retransmit_limit`` times, and a newer update about a
member replacing the queued one about the same member. Quiet updates (a member's
load counts, see ``GossipConfig.quiet_meta``) only ride on messages sent anyway;
only loud ones start gossip rounds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

from hypermesh.agent.gossip.trust import brief, check_address, check_counter, check_name

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

    def _fields(self) -> list[Any]:
        """The row's fields, the meta as its JSON text, trailing defaults left off."""
        fields: list[Any] = [self.member, self.address, _STATE_CODE[self.state],
                             self.incarnation, self.meta_version, self.meta_json, self.source]
        while len(fields) > 4 and fields[-1] in (None, "", 0):
            fields.pop()
        return fields

    def to_wire(self) -> list[Any]:
        """A compact JSON-able list: ``[member, address, state code, incarnation,
        meta_version, meta or null, source]``, trailing defaults left off."""
        row = self._fields()
        if len(row) > 5 and row[5] is not None:
            row[5] = json.loads(row[5])
        return row

    def wire_text(self) -> str:
        """:meth:`to_wire` as compact JSON text, the meta spliced in as the canonical
        JSON it is held as (no parsing and writing it again)."""
        parts = [
            "null" if f is None else f if i == 5 else
            encode_basestring_ascii(f) if isinstance(f, str) else str(int(f))
            for i, f in enumerate(self._fields())
        ]
        return f"[{','.join(parts)}]"

    @classmethod
    def from_wire(cls, row: list[Any]) -> Update:
        """Inverse of :meth:`to_wire`; raises ValueError on a malformed row: one whose
        member or source (when given) is not a node name, whose address is not
        host:port, whose incarnation or meta version is outside ``0 .. 2**63 - 1``,
        or whose meta is not an object (see :mod:`~hypermesh.agent.gossip.trust`)."""
        if not isinstance(row, list) or not 4 <= len(row) <= 7:
            raise ValueError(f"an update is a list of 4 to 7 fields, got {brief(row)}")
        member, address, code, incarnation = row[:4]
        meta_version = row[4] if len(row) > 4 else 0
        meta = row[5] if len(row) > 5 else None
        source = row[6] if len(row) > 6 else ""
        if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < len(STATES):
            raise ValueError(f"unknown state code {code!r}")
        check_name(member, "an update's member")
        check_address(address, f"{member}'s address")
        if source != "":
            check_name(source, f"the source of an update about {member}")
        check_counter(incarnation, f"{member}'s incarnation")
        check_counter(meta_version, f"{member}'s meta version")
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"meta must be an object in the update about {member}")
        meta_json = None if meta is None else encode_meta(meta)
        return cls(member, address, STATES[code], incarnation, meta_version, meta_json, source)


KINDS = ("ping", "ack", "nack", "ping_req", "push_pull", "push_pull_reply", "gossip")


@dataclass(frozen=True, slots=True)
class Message:
    """One one-way protocol message. ``refused`` marks a nack whose target refused.

    ``page`` pages a joining member through a table (see
    :mod:`~hypermesh.agent.gossip.antientropy`): on a push-pull request, 1 + the
    table position to send rows from (0: an ordinary exchange); on its reply, 1 +
    the position the next page starts at (0: no more pages)."""

    kind: str
    sender: str
    sender_addr: str
    seq: int = 0
    target: str = ""
    target_addr: str = ""
    updates: tuple[Update, ...] = ()
    table: tuple[Update, ...] = ()
    refused: bool = False
    page: int = 0

    def to_json(self) -> dict[str, Any]:
        """A compact JSON-able dict; fields at their defaults are left out."""
        out = self._head()
        if self.updates:
            out["u"] = [u.to_wire() for u in self.updates]
        if self.table:
            out["tb"] = [u.to_wire() for u in self.table]
        return out

    def encode(self) -> bytes:
        """The message as the transport sends it: ``to_json`` as compact JSON, written
        without parsing each row's meta and writing it again (its canonical JSON text
        goes in as it is held, see :meth:`Update.wire_text`)."""
        text = json.dumps(self._head(), separators=(",", ":"))
        rows = [f'"{key}":[{",".join(u.wire_text() for u in updates)}]'
                for key, updates in (("u", self.updates), ("tb", self.table)) if updates]
        if rows:
            text = f"{text[:-1]},{','.join(rows)}}}"
        return text.encode()

    def _head(self) -> dict[str, Any]:
        """``to_json`` but the rows."""
        out: dict[str, Any] = {"k": self.kind, "f": self.sender, "fa": self.sender_addr}
        if self.seq:
            out["q"] = self.seq
        if self.target:
            out["t"] = self.target
        if self.target_addr:
            out["ta"] = self.target_addr
        if self.refused:
            out["r"] = 1
        if self.page:
            out["pg"] = self.page
        return out

    @classmethod
    def from_json(
        cls,
        data: dict[str, Any],
        bad_rows: list[str] | None = None,
        stale: Callable[[Any], bool] | None = None,
    ) -> Message:
        """Inverse of :meth:`to_json`; raises ValueError on anything malformed.

        The message itself must be well formed: a known kind, a sender that is a node
        name at a host:port address, a target (when given) likewise, a sequence
        number and a page in ``0 .. 2**63 - 1``. Its rows (updates and table) are
        checked one by one (:meth:`Update.from_wire`): with ``bad_rows``, a malformed
        row is left out and its error appended there, and the rest of the message
        still counts (a row is one member's news, and a sender that relays a row
        another version of the agent accepts must not have its pings refused);
        without it, one malformed row fails the whole message.

        ``stale``: a test of a raw update row (as :meth:`Update.to_wire` writes it) that
        says the receiver already holds its news or newer; such rows are left out
        unread, neither checked nor decoded (most piggybacked rows a member receives
        are news it heard before). Table rows are always read: a push-pull reply is
        worked out from them.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a message is an object, got {type(data).__name__}")
        kind = data.get("k")
        if kind not in KINDS:
            raise ValueError(f"unknown message kind {brief(kind)}; expected one of {KINDS}")
        sender = check_name(data.get("f"), "the sender")
        sender_addr = check_address(data.get("fa"), "the sender's address")
        target = data.get("t", "")
        if target != "":
            check_name(target, "the target")
        target_addr = data.get("ta", "")
        if target_addr != "":
            check_address(target_addr, "the target's address")
        seq = check_counter(data.get("q", 0), "seq")
        page = check_counter(data.get("pg", 0), "page")
        rows = {key: data.get(key, []) for key in ("u", "tb")}
        if not all(isinstance(v, list) for v in rows.values()):
            raise ValueError("updates and table must be lists")
        return cls(
            kind=kind,
            sender=sender,
            sender_addr=sender_addr,
            seq=seq,
            target=target,
            target_addr=target_addr,
            updates=_rows(rows["u"] if stale is None else [r for r in rows["u"] if not stale(r)],
                          bad_rows),
            table=_rows(rows["tb"], bad_rows),
            refused=data.get("r", 0) == 1,
            page=page,
        )


def _rows(rows: list[Any], bad_rows: list[str] | None) -> tuple[Update, ...]:
    if bad_rows is None:
        return tuple(Update.from_wire(r) for r in rows)
    out = []
    for r in rows:
        try:
            out.append(Update.from_wire(r))
        except ValueError as exc:
            bad_rows.append(str(exc))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A message the transport must send to member ``to`` at ``address``."""

    to: str
    address: str
    message: Message


class BroadcastQueue:
    """Updates waiting to be piggybacked, in two tiers: loud and quiet.

    Holds at most one update per member. Loud updates (membership news, meta that
    peers act on) go out first and are what :attr:`loud` reports, which is what
    starts gossip rounds; quiet ones fill what room a message has left. A quiet
    update that replaces a loud one about the same member stays loud, since it
    carries that news too, but only for the transmissions the loud one had left: it
    takes over the loud one's count. A member whose load changes faster than its
    loud news spreads would otherwise keep its updates loud for ever, and with it
    every member gossiping. Once the loud news is sent enough, the update stays on
    as a quiet one for the rest of its own ``max_transmits``: its counts, newer than
    the loud news, get a full life too. Only its owner (one ``Swim``) changes it.
    """

    def __init__(self) -> None:
        self._loud = _Pile()
        self._quiet = _Pile()
        # member -> the loud count a quiet update took over (its own sends: the rest)
        self._carried: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._loud) + len(self._quiet)

    def __bool__(self) -> bool:
        return bool(self._loud) or bool(self._quiet)

    def __contains__(self, member: object) -> bool:
        return member in self._loud or member in self._quiet

    @property
    def loud(self) -> bool:
        """Whether any loud update waits (the gossip rounds' cue)."""
        return bool(self._loud)

    def push(self, update: Update, quiet: bool = False) -> None:
        """Queue ``update``, unsent, in place of any queued update about the same member."""
        sent = self._loud.transmits(update.member) if quiet else None
        self.drop(update.member)
        if sent is not None:  # it still carries the loud news, for what was left of it
            self._loud.push(update, sent)
            if sent:
                self._carried[update.member] = sent
        else:
            (self._quiet if quiet else self._loud).push(update)

    def drop(self, member: str) -> None:
        """Forget the queued update about ``member``, if any."""
        self._loud.drop(member)
        self._quiet.drop(member)
        self._carried.pop(member, None)

    def get(self, member: str) -> Update | None:
        """The queued update about ``member``, if any."""
        found = self._loud.get(member)
        return found if found is not None else self._quiet.get(member)

    def is_quiet(self, member: str) -> bool:
        """Whether the update queued about ``member`` is a quiet one."""
        return member in self._quiet

    def transmits(self, member: str) -> int | None:
        """How often the queued update about ``member`` was taken so far."""
        sent = self._loud.transmits(member)
        return sent if sent is not None else self._quiet.transmits(member)

    def take(self, limit: int, max_transmits: int, skip: str = "") -> list[Update]:
        """Up to ``limit`` updates for one message: loud ones first, then quiet ones;
        within a tier least sent first and, among updates sent equally often, the one
        that reached that count last first (so among unsent updates, the newest).

        Each one taken counts one transmission; one that reaches ``max_transmits``
        leaves the queue. Updates about ``skip`` are left alone (the caller carries
        its own).
        """
        chosen = self._loud.take(limit, max_transmits, skip)
        quiet = self._quiet.take(limit - len(chosen), max_transmits, skip)
        for update in chosen:
            carried = self._carried.get(update.member)
            if carried is not None and update.member not in self._loud:
                # Its loud news is sent enough; its own counts were sent only since it
                # took over: quiet from here, for the rest of their transmissions.
                del self._carried[update.member]
                self._quiet.push(update, max_transmits - carried)
        return chosen + quiet

    def pending(self) -> list[Update]:
        """Everything queued, in the order :meth:`take` would pick it."""
        return self._loud.pending() + self._quiet.pending()


class _Pile:
    """One tier of a :class:`BroadcastQueue`, with how often each update was sent.

    Holds at most one update per member. Internally one bucket per transmit count, each
    in insertion order, so taking ``n`` updates costs O(n + limit), not a sort of the
    whole queue.
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

    def push(self, update: Update, sent: int = 0) -> None:
        """Queue ``update``, counted as sent ``sent`` times, in place of any queued
        update about the same member."""
        self.drop(update.member)
        while len(self._buckets) <= sent:
            self._buckets.append({})
        self._buckets[sent][update.member] = update
        self._where[update.member] = sent

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
