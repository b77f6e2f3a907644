"""Deleting a workflow: every key it has, in pages, safe against a leader racing it.

A workflow is deleted in two steps (``hypermesh delete`` and the leader's retention
both come here):

1. ``forget_workflow``: one transaction deletes its own keys (``wf/``, ``wfstate/``,
   ``progress/``, ``wfusage/``), guarded by the state key's mod revision as the caller
   read it, an ended state. From that revision on the workflow is gone for every reader
   (``status`` and ``tasks`` say NotFound), and every write the leader fences on the
   state key's revision (expansions, trials, progress, final states:
   ``hypermesh/state/txns.py``) fails: a deleted key has no revision to match. A
   workflow that changed since it was read (``retry`` reopened it) is not deleted.
2. ``purge_workflow``: every range of ``Keyspace.workflow_prefixes``, a page of
   ``PAGE_KEYS`` keys per transaction: a transaction is one revision, and each revision's
   changes reach every agent's watch as one message, which must stay small. Running
   work goes first (claims, block claims, slots, gang seats): every write of an attempt
   still running is fenced on its claim, so once the claim is gone nothing of it can be
   recorded again. The ``expanded/`` markers go last, so that a purge cut short leaves
   markers behind, which the leader's retention finds and purges (``leftover_wids``).

Agents stop the attempts of a workflow that is gone as they do for a cancelled one
(``MeshView.workflow_state``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypermesh.errors import NotFound, UsageError
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.records import TERMINAL
from hypermesh.state.txns import cancel_workflow

PAGE_KEYS = 1000
"""Keys deleted per transaction: one watch message of about 100 bytes a key to every
agent. Fewer: more revisions (and leader rounds) per workflow deleted."""

RUNNING_KINDS = ("claim", "bclaim", "bcap", "slot", "gang")
"""Kinds purged first: what running attempts hold and fence their writes on."""


@dataclass(frozen=True)
class Deleted:
    """What deleting one workflow did: the state it had ("" when only leftovers of an
    earlier deletion were found) and how many keys went."""

    workflow: str
    state: str
    keys: int

    def to_json(self) -> dict[str, object]:
        return {"workflow": self.workflow, "state": self.state, "keys": self.keys}


def purge_order(ks: Keyspace, wid: str) -> list[str]:
    """The range prefixes of ``wid`` in the order they are purged."""
    ranges = [p for p in ks.workflow_prefixes(wid) if p.endswith("/")]
    first = [ks.kind_prefix(k, wid) for k in RUNNING_KINDS]
    last = [ks.kind_prefix("expanded", wid)]
    middle = [p for p in ranges if p not in first and p not in last]
    return [p for p in first if p in ranges] + middle + [p for p in last if p in ranges]


def own_keys(ks: Keyspace, wid: str) -> list[str]:
    """The exact keys of ``wid`` (its record, state, progress and usage)."""
    return [p for p in ks.workflow_prefixes(wid) if not p.endswith("/")]


async def read_state(etcd: Etcd, ks: Keyspace, wid: str) -> tuple[str, int] | None:
    """The workflow's state and the state key's mod revision; None when no workflow
    ``wid`` is stored. A workflow without a state key (never so since submit writes
    both) reads as pending, revision 0."""
    if await etcd.get(ks.workflow(wid)) is None:
        return None
    found = await etcd.get(ks.workflow_state(wid))
    if found is None:
        return "pending", 0
    return str(json.loads(found[0])["state"]), found[1]


async def forget_workflow(
    etcd: Etcd, ks: Keyspace, wid: str, state_revision: int
) -> int | None:
    """Delete the workflow's own keys if its state key is still at ``state_revision``
    (step 1 above): how many there were, or None if the state changed since."""
    keys = own_keys(ks, wid)
    done = await etcd.txn(
        [etcd.mod_revision_is(ks.workflow_state(wid), state_revision)],
        [etcd.op_delete(key) for key in keys],
    )
    if not done.succeeded:
        return None
    return _deleted(done.responses, len(keys))


def _deleted(responses: Sequence[Any], otherwise: int) -> int:
    """Keys the delete operations of a transaction removed; ``otherwise`` when its
    answer was lost and only its effect was read back (``Etcd.txn``)."""
    return sum(r.response_delete_range.deleted for r in responses) if responses else otherwise


async def purge_prefix(etcd: Etcd, prefix: str, page: int = PAGE_KEYS) -> int:
    """Delete every key under ``prefix``, ``page`` keys per transaction; how many."""
    deleted = 0
    while True:
        keys = await etcd.keys(prefix, page)
        if not keys:
            return deleted
        # Every key from the prefix up to the last one read: the ones read, and any
        # created among them since, which are as unwanted.
        done = await etcd.txn([], [etcd.op_delete_range(prefix.encode(), keys[-1] + b"\0")])
        deleted += _deleted(done.responses, len(keys))


async def purge_workflow(etcd: Etcd, ks: Keyspace, wid: str, page: int = PAGE_KEYS) -> int:
    """Delete every key of ``wid`` under its range prefixes (step 2 above); how many."""
    deleted = 0
    for prefix in purge_order(ks, wid):
        deleted += await purge_prefix(etcd, prefix, page)
    return deleted


async def has_leftovers(etcd: Etcd, ks: Keyspace, wid: str) -> bool:
    """Whether keys of ``wid`` remain under its range prefixes."""
    for prefix in purge_order(ks, wid):
        if await etcd.keys(prefix, 1):
            return True
    return False


async def running_work(etcd: Etcd, ks: Keyspace, wid: str) -> bool:
    """Whether an attempt of ``wid`` still holds a claim, a block or a gang seat."""
    for kind in ("claim", "bclaim", "gang"):
        if await etcd.keys(ks.kind_prefix(kind, wid), 1):
            return True
    return False


async def check_deletable(
    etcd: Etcd, ks: Keyspace, wid: str, force: bool
) -> tuple[str, int] | None:
    """The state and state revision of a workflow ``delete`` may go on with; None for
    leftovers of an earlier deletion alone. Raises NotFound for an unknown id, and
    UsageError (exit 2) for a workflow that has not ended, unless ``force``."""
    found = await read_state(etcd, ks, wid)
    if found is None:
        if await has_leftovers(etcd, ks, wid):
            return None
        raise NotFound(f"no workflow {wid!r} in namespace {ks.namespace!r}")
    state = found[0]
    if state not in TERMINAL and not force:
        raise UsageError(
            f"workflow {wid} is {state}; cancel it first (hypermesh cancel {wid}) "
            "or delete it with --force"
        )
    return found


async def delete_workflow(
    etcd: Etcd, ks: Keyspace, wid: str, *, force: bool = False, drain_s: float = 30.0,
    page: int = PAGE_KEYS,
) -> Deleted:
    """Delete workflow ``wid`` and every key it has (steps 1 and 2 above).

    A workflow that has not ended is refused (UsageError) unless ``force``: then it is
    cancelled first and its running attempts get up to ``drain_s`` seconds to stop and
    give back their claims (the agents stop them when they see the cancel), after which
    it is deleted whatever still runs (the agents stop those once it is gone)."""
    found = await check_deletable(etcd, ks, wid, force)
    if found is None:
        return Deleted(wid, "", await purge_workflow(etcd, ks, wid, page))
    for _ in range(20):
        state, revision = found
        if state not in TERMINAL:
            await cancel_workflow(etcd, ks, wid)
            deadline = time.monotonic() + drain_s
            while await running_work(etcd, ks, wid) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        else:
            forgotten = await forget_workflow(etcd, ks, wid, revision)
            if forgotten is not None:
                return Deleted(wid, state, forgotten + await purge_workflow(etcd, ks, wid, page))
        again = await read_state(etcd, ks, wid)
        if again is None:  # deleted meanwhile (the leader's retention): finish the purge
            return Deleted(wid, state, await purge_workflow(etcd, ks, wid, page))
        if again[0] not in TERMINAL and not force:  # reopened meanwhile (retry)
            await check_deletable(etcd, ks, wid, force)  # raises, naming what to do
        found = again
    raise UsageError(f"workflow {wid} kept changing state; try delete again")
