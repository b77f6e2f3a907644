"""Which nodes may run an experiment's tasks, and why none does.

``fits`` and ``allowed_on`` are the test every claimer applies before it takes a task
(``agent/claims/choose.py``), the burst leader before it counts a pool as able to run
an experiment, and the gang policy before it seats a member. ``unmet_needs`` explains
the opposite case to people: the tasks of an experiment that no live node may run wait
forever unless such a node joins, and ``status``, ``tasks``, the dashboard and
``submit`` say so in the words of the recipe (``no live node has gpu k80 (0 of 3
nodes match)``).

Pure: reads records, returns answers. No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hypermesh.recipe.recipe import Experiment, Hardware
from hypermesh.recipe.units import format_size
from hypermesh.state.records import NodeRecord


def gpu_type_matches(wanted: str | None, have: str) -> bool:
    """``k80`` matches ``Tesla K80``: a case-insensitive substring test."""
    return not wanted or wanted.lower() in have.lower()


def _gpus_fit(hw: Hardware, node: NodeRecord) -> bool:
    if hw.gpus > node.gpus or (hw.gpu and not node.gpus):
        return False
    return not hw.gpu or gpu_type_matches(hw.gpu, node.gpu_type)


def _memory_fits(hw: Hardware, node: NodeRecord) -> bool:
    """Memory unstated on either side fits."""
    return not (hw.memory and node.memory and hw.memory > node.memory)


def fits(hw: Hardware, node: NodeRecord) -> bool:
    """Whether a task with ``hw`` could ever run on ``node`` (ignoring current load)."""
    return _gpus_fit(hw, node) and hw.cpus <= node.cpus and _memory_fits(hw, node)


def allowed_on(exp: Experiment, node: NodeRecord) -> bool:
    """Whether ``exp``'s tasks may ever run on ``node``: hardware and pool fit."""
    return fits(exp.hardware, node) and (not exp.pools or node.pool in exp.pools)


Need = tuple[str, Callable[[NodeRecord], bool]]


def _needs(exp: Experiment) -> list[Need]:
    """Each thing ``exp`` asks of a node, as the recipe words it, with its test. Together
    they are ``allowed_on``."""
    hw = exp.hardware
    needs: list[Need] = []
    if exp.pools:
        needs.append((f"pool {' or '.join(exp.pools)}", lambda n: n.pool in exp.pools))
    if hw.gpu or hw.gpus:
        needs.append((_gpu_words(hw), lambda n: _gpus_fit(hw, n)))
    needs.append((_counted(hw.cpus, "cpu"), lambda n: hw.cpus <= n.cpus))
    if hw.memory:
        needs.append((f"{format_size(hw.memory)} memory", lambda n: _memory_fits(hw, n)))
    return needs


def _counted(count: float, noun: str) -> str:
    return f"{count:g} {noun}" + ("s" if count > 1 else "")


def _gpu_words(hw: Hardware) -> str:
    """``gpu k80``, ``2 k80 gpus``, ``0.5 gpu``."""
    if not hw.gpu:
        return _counted(hw.gpus, "gpu")
    return f"gpu {hw.gpu}" if hw.gpus <= 1 else _counted(hw.gpus, f"{hw.gpu} gpu")


def unmet_needs(exp: Experiment, nodes: Iterable[NodeRecord]) -> str | None:
    """Why no live node may run ``exp``'s tasks, in the recipe's words; None when one may.

    The needs no live node meets at all are named; when each is met by some node but
    none meets them all, every need that some node misses is named."""
    live = [n for n in nodes if n.state == "alive"]
    if any(allowed_on(exp, n) for n in live):
        return None
    if not live:
        return "no live node in the mesh"
    needs = _needs(exp)
    missed = [what for what, ok in needs if not any(ok(n) for n in live)]
    if not missed:
        missed = [what for what, ok in needs if not all(ok(n) for n in live)]
        return f"no live node has {' and '.join(missed)} at once (0 of {len(live)} nodes match)"
    return f"no live node has {' and '.join(missed)} (0 of {len(live)} nodes match)"
