"""Which provisioner carries out a pool: one per pool ``kind`` (``local``, ``ec2``).

The interface and its records live in :mod:`~hypermesh.agent.burst.provisioner`; each kind's
module imports that one, and only this registry imports the kinds. A kind's module loads when
a pool of that kind is first used (``ec2`` brings boto3, which an agent without such a pool
never needs).
"""

from __future__ import annotations

from hypermesh.agent.burst.provisioner import Context, Provisioner, ProvisionError
from hypermesh.state.pools import Pool


def make_provisioner(pool: Pool, ctx: Context) -> Provisioner:
    """The provisioner of ``pool``'s kind."""
    if pool.kind == "local":
        from hypermesh.agent.burst.local import LocalProvisioner

        return LocalProvisioner(pool, ctx)
    if pool.kind == "ec2":
        from hypermesh.agent.burst.ec2 import Ec2Provisioner

        return Ec2Provisioner(pool, ctx)
    raise ProvisionError(f"pool {pool.name!r} of kind {pool.kind!r} has no provisioner")
