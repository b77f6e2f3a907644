"""The fence on the leader's burst writes: its candidacy must still stand.

A leader that lost its candidacy lease, or was cut off while another node stood, can
still reach etcd for a while and still believe it leads (its view lags). If it went on
writing node records, two leaders could each launch nodes for the same backlog, or one
forget a node the other just started. So every leader-only burst write (node records,
events, usage counters) is one transaction that also compares the candidacy key this
agent stood with: it exists, and was created at the revision this agent created it
(a key of the same name put again since is someone else's candidacy, not ours).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hypermesh.errors import LeadershipLost

if TYPE_CHECKING:
    from hypermesh.state.etcd import Etcd

Candidacy = tuple[str, int]
"""The election key (``elect/<lease hex>``) and the revision it was created at."""


async def leader_txn(etcd: Etcd, candidacy: Candidacy | None, compare: Sequence[Any],
                     ops: Sequence[Any]) -> bool:
    """Apply ``ops`` if ``candidacy`` still stands and every compare of ``compare`` holds.

    Returns False when only ``compare`` failed (the caller's own guard, e.g. a counter
    someone else updated first). Raises :class:`LeadershipLost`, writing nothing, when
    the candidacy is gone or was never held (``None``)."""
    if candidacy is None:
        raise LeadershipLost("this node holds no candidacy")
    key, created = candidacy
    stands = etcd.created_at(key, created)
    result = await etcd.txn([stands, *compare], list(ops))
    if result.succeeded:
        return True
    if compare and (await etcd.txn([stands], [])).succeeded:
        return False
    raise LeadershipLost(f"candidacy {key.rsplit('/', 1)[-1]} (created at revision "
                         f"{created}) no longer stands")
