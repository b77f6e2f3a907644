"""The rows of ``hypermesh nodes --json``: etcd's registry joined with one agent's
gossip view. Pure; shared by the CLI and the agent's dashboard so both show the
same fields."""

from __future__ import annotations

import json
from typing import Any

from hypermesh.state.view import MeshView

# name -> {"state", "incarnation", "meta", "since", "address"}
Gossip = dict[str, dict[str, Any]]


def gossip_table(members: Any) -> Gossip:
    """A gossip member table (the ``Members`` message of the agent API) as a dict."""
    return {
        m.name: {
            "state": m.state,
            "incarnation": m.incarnation,
            "meta": json.loads(m.meta_json or "{}"),
            "since": m.state_since,
            "address": m.address,
        }
        for m in members.members
    }


def hit_rates(reads: Any) -> dict[str, float] | None:
    """Shares of the blocks a node's mounts read that came from its own cache, a
    peer and the object store (gossip meta ``reads``); None before any read."""
    if not isinstance(reads, dict):
        return None
    counts = {s: reads.get(s) for s in ("cache", "peer", "store")}
    if not all(isinstance(n, int) and n >= 0 for n in counts.values()):
        return None
    total = sum(n for n in counts.values() if isinstance(n, int))
    if total == 0:
        return None
    return {s: round(n / total, 4) for s, n in counts.items() if isinstance(n, int)}


def node_rows(
    view: MeshView, gossip: Gossip, seen_by: str | None, show_all: bool = False
) -> list[dict[str, Any]]:
    """One row per live node (and, with ``show_all``, per member gossip still
    remembers that etcd no longer lists: ``state`` ``gone``)."""
    leader = view.leader()
    rows = []
    for n in sorted(view.nodes.values(), key=lambda n: n.name):
        g = gossip.get(n.name, {})
        rows.append(
            {
                "name": n.name,
                "address": n.address,
                "state": n.state,
                "pool": n.pool,
                "spot": n.spot,
                "slots": n.slots,
                "running": len(view.running_on(n.name)),
                "gpus": n.gpus,
                "gpu_type": n.gpu_type,
                "cpus": n.cpus,
                "memory": n.memory,
                "labels": n.labels,
                "leader": n.name == leader,
                "gossip": g.get("state"),
                "incarnation": g.get("incarnation"),
                "load": g.get("meta"),
                "cached_bytes": (g.get("meta") or {}).get("cached_bytes"),
                "hit_rates": hit_rates((g.get("meta") or {}).get("reads")),
                "seen_by": seen_by if gossip else None,
                # Where gossip (as ``seen_by`` sees it) reaches the node; after a restart
                # at a new address it follows ``address`` once the node has refuted
                # its old life's record.
                "gossip_address": g.get("address"),
                "metrics": n.metrics or None,
                # What of the namespace it watches (``agent start --watch``, auto resolved).
                "watch": "own" if n.offers else "all",
            }
        )
    if show_all:
        for name, g in sorted(gossip.items()):
            if name not in view.nodes:
                rows.append(
                    {
                        "name": name, "address": None, "state": "gone", "pool": None,
                        "spot": None, "slots": None, "running": 0, "gpus": None,
                        "gpu_type": None, "cpus": None, "memory": None, "labels": {},
                        "leader": False, "gossip": g["state"], "incarnation": g["incarnation"],
                        "load": g["meta"], "cached_bytes": (g["meta"] or {}).get("cached_bytes"),
                        "hit_rates": hit_rates((g["meta"] or {}).get("reads")),
                        "seen_by": seen_by, "metrics": None,
                        "gossip_address": g.get("address"), "watch": None,
                    }
                )
    return rows
