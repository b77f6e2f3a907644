"""Slots of ``workers`` caps for the blocks the leader offers.

On a large mesh an experiment with a ``workers`` cap runs in one-task blocks
(``hypermesh.state.blocks.placed_per_block``), and each block's claim takes a slot of
the cap (``bcap/``) in the same transaction. A node that chooses from offers does not
see those slots, so the leader gives each block of a capped experiment it offers a
slot: below the cap, held by no block, given to no other block, and no more of them
than the cap leaves room for above the blocks held now. The offer carries the slot and
the claim takes it; a slot taken meanwhile by a node that watches everything costs one
refused claim, as any stale offer does. The blocks the cap has no room for wait here,
in order (``penned``), until slots free: a round looks at them per experiment, not
per block.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hypermesh.state.keyspace import BlockRef

if TYPE_CHECKING:
    from hypermesh.state.view import MeshView

ExpKey = tuple[str, str]  # (workflow, experiment)


@dataclass
class _Budget:
    """One experiment's cap this round: the room left, the blocks whose slots stand,
    and the free slots not given yet."""

    room: int
    valid: set[BlockRef]
    free: Iterator[int] = field(default_factory=lambda: iter(()))


def capped(view: MeshView, bref: BlockRef) -> bool:
    """Whether ``bref``'s experiment has a ``workers`` cap now (the recipe's, or one set
    live with ``hypermesh scale``); False once its workflow is gone."""
    return _workers(view, (bref.workflow, bref.experiment)) is not None


def _workers(view: MeshView, key: ExpKey) -> int | None:
    """The cap of experiment ``key`` now; None without one, or once its workflow is gone."""
    wf = view.workflows.get(key[0])
    return None if wf is None else view.workers(key[0], wf.recipe.experiment(key[1]))


class CapSlots:
    """The cap slots the leader's offers give blocks; planning runs one round at a time
    (:meth:`begin` starts one)."""

    def __init__(self) -> None:
        self.given: dict[ExpKey, dict[BlockRef, int]] = {}
        self.penned: dict[ExpKey, dict[BlockRef, None]] = {}
        self._budgets: dict[ExpKey, _Budget] = {}
        self._capped: dict[ExpKey, bool] = {}

    def begin(self) -> None:
        """A new round: the budgets are worked out again from the view."""
        self._budgets.clear()
        self._capped.clear()

    def clear(self) -> None:
        self.given.clear()
        self.penned.clear()
        self.begin()

    def is_capped(self, view: MeshView, bref: BlockRef) -> bool:
        """``capped``, asked once per experiment and round."""
        key = (bref.workflow, bref.experiment)
        known = self._capped.get(key)
        if known is None:
            known = self._capped[key] = capped(view, bref)
        return known

    def is_penned(self, bref: BlockRef) -> bool:
        return bref in self.penned.get((bref.workflow, bref.experiment), {})

    def drop(self, bref: BlockRef) -> None:
        """``bref`` is no longer offered nor waiting: its slot goes back."""
        key = (bref.workflow, bref.experiment)
        given = self.given.get(key)
        if given is not None and given.pop(bref, None) is not None:
            budget = self._budgets.get(key)
            if budget is not None and bref in budget.valid:
                budget.valid.discard(bref)
            if not given:
                del self.given[key]

    def slot(self, bref: BlockRef) -> int | None:
        """The slot given to ``bref``, if it has one."""
        given = self.given.get((bref.workflow, bref.experiment))
        return None if given is None else given.get(bref)

    def admit(self, view: MeshView, bref: BlockRef) -> bool:
        """Whether ``bref`` has a slot (giving it one if the cap has room)."""
        key = (bref.workflow, bref.experiment)
        budget = self._budgets.get(key)
        if budget is None:
            budget = self._budgets[key] = self._budget(view, key)
        if bref in budget.valid:
            return True
        if budget.room <= 0:
            return False
        k = next(budget.free, None)
        if k is None:
            budget.room = 0
            return False
        budget.room -= 1
        budget.valid.add(bref)
        self.given.setdefault(key, {})[bref] = k
        return True

    def _budget(self, view: MeshView, key: ExpKey) -> _Budget:
        """The cap of ``key`` this round: its slots held by blocks (``bcap/``), the
        blocks held (a cap lowered live, or set on blocks claimed without one, counts
        them all), and the slots given before that still stand."""
        workers = _workers(view, key)
        given = self.given.get(key, {})
        if workers is None:
            given.clear()
            return _Budget(0, set())
        taken = view.block_slots.get(key, {})
        room = workers - view.cap_held(key)
        valid: set[BlockRef] = set()
        for bref, k in sorted(given.items(), key=lambda row: row[1]):
            if k < workers and k not in taken and room > 0:
                valid.add(bref)
                room -= 1
            else:
                del given[bref]
        busy = taken.keys() | set(given.values())
        return _Budget(room, valid, (k for k in range(workers) if k not in busy))

    def pen(self, bref: BlockRef) -> None:
        self.penned.setdefault((bref.workflow, bref.experiment), {})[bref] = None

    def unpen(self, bref: BlockRef) -> None:
        key = (bref.workflow, bref.experiment)
        pen = self.penned.get(key)
        if pen is not None and pen.pop(bref, 0) is None and not pen:
            del self.penned[key]

    def released(self, view: MeshView) -> list[BlockRef]:
        """The penned blocks, in order, that the caps now have room for (given slots), and
        those whose experiment has no cap any more (or no workflow: the caller checks)."""
        out: list[BlockRef] = []
        for key in list(self.penned):
            pen = self.penned[key]
            workers = _workers(view, key)
            if workers is None:  # its workflow is gone, or the cap was lifted
                del self.penned[key]
                out.extend(pen)
                continue
            room = workers - view.cap_held(key) - len(self.given.get(key, ()))
            if key not in self._budgets and room <= 0:
                continue  # no room (what was given stands until a block of it changes)
            while pen:
                bref = next(iter(pen))
                if not self.admit(view, bref):
                    break
                del pen[bref]
                out.append(bref)
            if not pen:
                del self.penned[key]
        return out

    def keep_only(self, live: Collection[BlockRef]) -> None:
        """Forget the slots given to blocks not in ``live`` (offered or waiting)."""
        for key in list(self.given):
            given = self.given[key]
            for bref in [b for b in given if b not in live]:
                del given[bref]
            if not given:
                del self.given[key]
