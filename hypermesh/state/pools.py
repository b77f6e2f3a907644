"""Pools: named groups of nodes, declared in the mesh configuration in etcd.

Every agent belongs to one pool (``agent start --pool``). A pool's declaration
(``hypermesh pool set``) says where its nodes come from — ``static`` machines
that someone started by hand, or a provisioner (``local``, ``ec2``) that the
leader asks for more nodes when the backlog outgrows the mesh — what a node
costs, whether to ask for spot machines, and how far the leader may scale it.

A ``Pool`` is validated once, at construction; every error names the field and
the allowed range. ``BurstTables`` are the mirror's tables of the bursting records
(pools, provisioned nodes, usage). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from hypermesh.errors import UsageError
from hypermesh.state.keyspace import NAME_RE

STATIC = "static"
PROVISIONERS = ("local", "ec2")
KINDS = (STATIC, *PROVISIONERS)
MAX_NODES = 10_000


@dataclass(frozen=True)
class Pool:
    """One pool's declaration. Only ``hypermesh pool set`` writes it; the leader reads it."""

    name: str
    kind: str = STATIC
    """``static`` (machines started by hand; never scaled) or a provisioner name."""

    price: float = 0.0
    """On-demand price of one node, per hour (any currency; 0-1e6). For a static
    pool, what a machine costs you per hour (amortised); 0 if you do not care."""

    spot_price: float | None = None
    """Price of one spot node per hour; None means the same as ``price``."""

    spot: bool = False
    """Ask the provisioner for spot (preemptible) nodes first; on-demand is the
    fallback when spot capacity is refused or preemptions come too often."""

    min_nodes: int = 0
    """The leader never releases a node that would leave fewer than this (0-10000).
    It never starts nodes when nothing is pending, so min only holds nodes back."""

    max_nodes: int = 0
    """The leader never has more nodes of this pool (running or starting) than
    this (0-10000). 0 for a static pool."""

    idle_timeout: float = 300.0
    """Seconds a provisioned node may sit with nothing running before the leader
    releases it (0.1-86400). Lower: less paid idle time; higher: fewer restarts
    when work arrives in bursts."""

    slots: int = 1
    """Tasks one provisioned node runs at once (its ``--slots``; 1-4096)."""

    gpus: int = 0
    """GPUs of one provisioned node (its ``--gpus``), used to decide which
    pending tasks a new node could run (0-1024)."""

    gpu_type: str = ""
    """GPU type of one provisioned node (its ``--gpu-type``)."""

    options: dict[str, str] = field(default_factory=dict)
    """Provisioner settings (``--option KEY=VALUE``), e.g. ``region``,
    ``launch_template``, ``image_id``, ``instance_type``, ``etcd`` for ec2; ``ca_dir``
    for local (an absolute path to a ``hypermesh tls init`` directory, whose CA issues
    each node's certificate when the mesh runs TLS)."""

    def __post_init__(self) -> None:
        if not NAME_RE.fullmatch(self.name):
            raise UsageError(
                f"pool name {self.name!r}: 1-63 letters, digits, '-' or '_', "
                "starting with a letter or digit"
            )
        if self.kind not in KINDS:
            raise UsageError(f"--kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        _check("--price", self.price, 0, 1e6)
        if self.spot_price is not None:
            _check("--spot-price", self.spot_price, 0, 1e6)
        _check("--min", self.min_nodes, 0, MAX_NODES, integral=True)
        _check("--max", self.max_nodes, 0, MAX_NODES, integral=True)
        _check("--idle-timeout", self.idle_timeout, 0.1, 86400)
        _check("--slots", self.slots, 1, 4096, integral=True)
        _check("--gpus", self.gpus, 0, 1024, integral=True)
        if self.min_nodes > self.max_nodes and self.kind != STATIC:
            raise UsageError(f"--min {self.min_nodes} is more than --max {self.max_nodes}")
        if self.kind == STATIC and (self.max_nodes or self.min_nodes):
            raise UsageError("--min/--max apply to provisioned pools; a static pool is not scaled")
        if self.kind == STATIC and self.spot:
            raise UsageError("--spot applies to provisioned pools; static machines are on-prem")
        for key in self.options:
            if not key or not key.replace("_", "").isalnum():
                raise UsageError(f"--option {key!r}: keys are letters, digits and '_'")
        ca_dir = self.options.get("ca_dir")
        if ca_dir is not None and self.kind != "local":
            raise UsageError("--option ca_dir applies to local pools (an ec2 node's "
                             "certificates come through its tls_dir option)")
        if ca_dir is not None and not ca_dir.startswith("/"):
            raise UsageError(f"--option ca_dir={ca_dir}: give an absolute path (the leader "
                             "reads it from its own working directory)")

    @property
    def provisioned(self) -> bool:
        return self.kind != STATIC

    def node_price(self, spot: bool) -> float:
        """Price per hour of one node of this pool, spot or on-demand."""
        if spot and self.spot_price is not None:
            return self.spot_price
        return self.price

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Pool:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _check(name: str, value: float, low: float, high: float, integral: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise UsageError(f"{name} {value!r}: expected a number")
    if integral and value != int(value):
        raise UsageError(f"{name} {value}: expected a whole number")
    if not low <= value <= high:
        raise UsageError(f"{name} {value:g} is out of range: allowed {low:g}..{high:g}")


def cost(seconds: float, price_per_hour: float) -> float:
    """What ``seconds`` node-seconds cost at ``price_per_hour``."""
    return seconds / 3600.0 * price_per_hour


def parse_pools(declared: Mapping[str, Any]) -> dict[str, Pool]:
    """Pools from their stored declarations by name (a malformed one is skipped)."""
    pools = {}
    for name, data in declared.items():
        try:
            pools[name] = Pool.from_json(data)
        except (UsageError, TypeError):
            continue
    return pools


def usage_cost(usage: dict[str, dict[str, float]], pools: dict[str, Pool]) -> dict[str, Any]:
    """Cost of node-seconds per pool (``{pool: {"spot_s", "on_demand_s"}}``) at the
    pools' prices, and what the same node-seconds would have cost on-demand. A
    pool that is no longer declared costs 0 (its prices are gone)."""
    total_s = total = on_demand = 0.0
    per_pool: dict[str, Any] = {}
    for name, used in sorted(usage.items()):
        pool = pools.get(name)
        spot_s = float(used.get("spot_s", 0.0))
        od_s = float(used.get("on_demand_s", 0.0))
        c = cost(spot_s, pool.node_price(True)) + cost(od_s, pool.price) if pool else 0.0
        c_od = cost(spot_s + od_s, pool.price) if pool else 0.0
        per_pool[name] = {
            "spot_s": round(spot_s, 3),
            "on_demand_s": round(od_s, 3),
            "cost": round(c, 6),
            "on_demand_cost": round(c_od, 6),
        }
        total_s += spot_s + od_s
        total += c
        on_demand += c_od
    return {
        "node_seconds": round(total_s, 3),
        "cost": round(total, 6),
        "on_demand_cost": round(on_demand, 6),
        "pools": per_pool,
    }


def _put_or_pop(table: dict[str, Any], key: str, value: Any) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


class BurstTables:
    """The mirror's tables of bursting records (raw JSON and mod revision, read by
    ``agent/burst/duty.py`` and the CLI): pool declarations, provisioned nodes,
    node-seconds per pool and per workflow. Part of ``hypermesh.state.mirror.Mirror``
    (which calls ``_init_burst_tables`` and holds ``nodes``), fed by its ``apply``."""

    nodes: Mapping[str, Any]

    def _init_burst_tables(self) -> None:
        self.pools: dict[str, dict[str, Any]] = {}
        self.instances: dict[str, dict[str, Any]] = {}
        # Provisioned nodes this view saw registered, even if gone again since: a spot
        # node preempted within seconds of booting was up, not still booting.
        self.booted: set[str] = set()
        self.usage: dict[str, tuple[dict[str, Any], int]] = {}
        self.workflow_usage: dict[str, tuple[dict[str, Any], int]] = {}

    def _apply_pool(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        _put_or_pop(self.pools, parts[0], data)

    def _apply_inst(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        _put_or_pop(self.instances, parts[0], data)
        if data is None:
            self.booted.discard(parts[0])
        elif parts[0] in self.nodes:
            self.booted.add(parts[0])

    def _apply_usage(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        _put_or_pop(self.usage, parts[0], None if data is None else (data, mrev))

    def _apply_wfusage(self, parts: list[str], data: Any, crev: int, mrev: int) -> None:
        _put_or_pop(self.workflow_usage, parts[0], None if data is None else (data, mrev))
