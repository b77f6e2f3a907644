"""What the leader's offer planning (``agent/leader/offers.py``) asks of the rest of the
agent: gossip's free GPUs, where blocks' data is, which node a block is kept for, and
whether a block may go to a node."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

from hypermesh.state.keyspace import BlockRef, TaskRef
from hypermesh.state.records import NodeRecord

if TYPE_CHECKING:
    from hypermesh.state.view import MeshView

FreeGpus = Callable[[str], "float | None"]
"""A node's free GPUs by its name, as gossip last said; None when it has said nothing."""

KeepFor = Callable[[BlockRef], "str | None"]
"""The node a block is kept for now: for an experiment with ``inputs``, the one that holds
most of its task's data, while the block has waited less than the locality delay (""
while its data is still being looked up: kept for no node); for one with
``prefer_pools``, a node of a preferred pool with room, while it has waited less than the
pool delay; None: any node may take it. Only blocks of experiments with ``inputs`` or
``prefer_pools`` are asked about (``_kept_kind``)."""

Opener = Callable[[BlockRef, NodeRecord], bool]

CapOpener = Callable[[BlockRef, NodeRecord], bool]
"""Whether a block of an experiment with a ``workers`` cap may be offered to a node: it
has a slot of the cap (``agent/leader/cap_slots.py``), and the node has room for it."""


class BlockLocality(Protocol):
    """Where the data of a block's task is, for the leader (``agent/claims/locality.py``)."""

    delay_s: float  # how long a block waits for the node that holds its data
    looked_up: int  # grows whenever tasks' inputs were looked up

    def holder(self, view: MeshView, ref: TaskRef) -> str | None:
        """The node that may run ``ref`` and holds most of its inputs; "" while they are
        being looked up (a lookup is started); None when no such node holds any."""
        ...

    def forget(self, keep: Collection[TaskRef]) -> None:
        """Drop what was looked up for tasks not in ``keep``."""
        ...
