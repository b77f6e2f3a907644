"""How big etcd's database is, against its quota.

etcd refuses every write once its database reaches its quota (``--quota-backend-bytes``,
2 GiB by default) and raises a NOSPACE alarm: a mesh that stops being able to claim or
record anything. ``hypermesh status`` and ``nodes`` warn from ``QUOTA_WARN`` of the quota
on, and the leader notes it in its decision log (``agent/leader/housekeeping.py``).

The size and the size in use come from the member's maintenance status. The quota does
from etcd 3.6 on (``dbSizeQuota``); etcd 3.5 reports it only on its ``/metrics`` page
(``etcd_server_quota_backend_bytes``), read from the same client URL (https, with the
client's CA and certificate, when the client uses TLS). Failing both, the default quota
is assumed.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import urllib.request
from dataclasses import dataclass

from hypermesh.etcd_security import EtcdSecurity
from hypermesh.state.etcd import Etcd

DEFAULT_QUOTA = 2 * 1024**3
"""etcd's quota when ``--quota-backend-bytes`` is not given, bytes."""

QUOTA_WARN = 0.8
"""Share of the quota from which the database counts as near it."""

_QUOTA_METRIC = re.compile(rb"^etcd_server_quota_backend_bytes\s+(\S+)\s*$", re.M)


@dataclass(frozen=True)
class DbSize:
    """One member's database: bytes on disk, bytes in use, and its quota."""

    endpoint: str
    size: int
    in_use: int
    quota: int

    def to_json(self) -> dict[str, object]:
        return {"endpoint": self.endpoint, "db_size": self.size, "db_size_in_use": self.in_use,
                "quota": self.quota}


def quota_warning(db: DbSize) -> str | None:
    """The warning for a database near its quota (None below ``QUOTA_WARN`` of it)."""
    if db.quota <= 0 or db.size < QUOTA_WARN * db.quota:
        return None
    return (
        f"etcd's database at {db.endpoint} is {_mib(db.size)}, {100 * db.size / db.quota:.0f}% "
        f"of its quota ({_mib(db.quota)}); at the quota etcd refuses every write. Delete "
        "finished workflows (hypermesh delete) or shorten their retention (hypermesh "
        "settings retention=...); the leader compacts and defragments etcd to give the "
        "space back"
    )


def _mib(n: int) -> str:
    return f"{n / 1024**2:.0f} MiB"


def parse_quota(metrics: bytes) -> int | None:
    """The quota a member's ``/metrics`` page states, or None."""
    found = _QUOTA_METRIC.search(metrics)
    if found is None:
        return None
    try:
        return int(float(found.group(1)))
    except ValueError:
        return None


def _metrics_quota(endpoint: str, timeout: float, security: EtcdSecurity) -> int | None:
    context = None
    try:
        if security.ca is not None:
            context = ssl.create_default_context(cafile=str(security.ca))
            if security.cert is not None and security.key is not None:
                context.load_cert_chain(str(security.cert), str(security.key))
        url = f"{'https' if context else 'http'}://{endpoint}/metrics"
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return parse_quota(resp.read())
    except (OSError, ValueError):
        return None


async def db_size(etcd: Etcd, endpoint: str | None = None, timeout: float = 2.0) -> DbSize:
    """The size of the database of the member ``etcd`` reaches (``endpoint`` names it;
    default: the client's first endpoint, for ``/metrics``)."""
    status = await etcd.status()
    endpoint = endpoint or etcd.endpoints[0]
    quota: int | None = int(getattr(status, "dbSizeQuota", 0) or 0)
    if not quota:
        quota = await asyncio.to_thread(_metrics_quota, endpoint, timeout, etcd.security)
    return DbSize(endpoint, int(status.dbSize), int(status.dbSizeInUse), quota or DEFAULT_QUOTA)
